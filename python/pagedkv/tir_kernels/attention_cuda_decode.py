"""CUDA paged decode (``attn_decode_paged``).

Design and ABI: the docstring of ``attention_cuda.py``.
"""

from __future__ import annotations

import functools

from tvm.script import tirx as T

from ..kernel_table import choose
from ..ops import ATTN_DECODE_PAGED, shape_values
from ._abi import abi_prim_func, spec_op
from ._common_cuda import (
    WARP,
    check_head_dim,
    chunk_split,
    decode_split_ranges,
    decode_splits,
    itemsize,
    make_merge_splits,
    next_pow2,
    opaque_i32,
    paged_kv_len,
    split_chunk,
    split_count,
    vec16,
    wave_split_count,
)
from ._decode_rope_cuda import make_rope_stages
from ._decode_staged_cuda import make_staged_kernel, staged_plan
from ._decode_staged_rope_cuda import make_staged_rope_kernel
from ._rope_table import cuda_inline_serves, make_no_inline_rope, rope_on, whole_head_scale
from ._decode_tc_cuda import TCD_RESIDENT_BLOCKS, make_tc_kernel
from ._decode_stages_cuda import (
    DecodePlan,
    make_accumulate,
    make_load_kv,
    make_load_q,
    make_score,
    make_softmax,
    make_store,
)
from ._variant_cuda import CudaVariant


def _pick_vec(d: int, dtype: str, max_lanes: int = WARP) -> int:
    """Elements per lane along the head dim: 16 bytes when possible, a divisor of ``d / 2`` (so a RoPE
    partner chunk is a whole chunk), and at most ``max_lanes`` lanes."""
    vec = vec16(dtype)
    while (d // 2) % vec:
        vec //= 2
    while d // vec > max_lanes:
        vec *= 2
    if (d // 2) % vec:
        raise NotImplementedError(f"pagedkv.tir_kernels: no CUDA lane split for head_dim={d}")
    return vec


# ---------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------
#: Threads per decode block.
DECODE_THREADS = 128
#: Query rows (of one kv head's GQA group) per decode block; a larger group is split over blockIdx.z
#: (H200, 64 q / 8 kv heads, D 128, B 64 x 4096 keys: 4 rows 0.62 ms, 8 rows 0.72 ms; B 16 x 2048:
#: 0.085 vs 0.140 ms). Each row chunk reads the kv head's K/V once (mostly from L2 for the second).
DECODE_MAX_ROWS = 4


def _decode_plan(g: int, d: int, dtype: str):
    vec = _pick_vec(d, dtype)
    lanes0 = d // vec
    lanes = next_pow2(lanes0)
    nw = max(1, DECODE_THREADS // lanes)
    # Row chunk (blockIdx.z splits the group): the largest divisor of G up to DECODE_MAX_ROWS, or the whole
    # group when that divisor would be tiny (G = 5, 7: rereading K/V G times costs more than the registers).
    gc = max(c for c in range(1, DECODE_MAX_ROWS + 1) if g % c == 0)
    if 2 * gc < g <= 8:
        gc = g
    # Keys per lane group and step: as many independent loads as the registers allow.
    per_key = 2 * vec * itemsize(dtype) // 4 + gc
    kpt = 4
    while kpt > 1 and 2 * gc * vec + kpt * per_key > 160:
        kpt //= 2
    return vec, lanes0, lanes, nw, gc, kpt


def _split_count(B, nnz, ps, blocks_per_split, var: CudaVariant, forced: int = 0, staged: bool = False,
                 tc: bool = False, max_keys=None):
    """Key splits per (entry, kv head) of the decode kernel (``forced > 0``: that many, clamped, see
    ``split_count``). The staged and tensor-core (``tc``) kernels' blocks are uniform (one per entry, kv head
    and split), so their count fills whole waves (``wave_split_count``; the tc kernel holds 2 blocks an SM,
    ``TCD_RESIDENT_BLOCKS``); the lane-group kernel's comes from ``split_count`` (about two blocks per SM).
    All read the variant's keys per entry (``decode_avg_keys``); ``max_keys`` (the runtime's ``max_kv_len``)
    lets the staged and tc kernels take ``S = 1`` for a single full wave of a balanced batch."""
    if staged or tc:
        return wave_split_count(B, nnz, ps, blocks_per_split,
                                resident_blocks=TCD_RESIDENT_BLOCKS if tc else STAGED_RESIDENT_BLOCKS,
                                min_split_keys=DECODE_MIN_SPLIT_KEYS, max_splits=STAGED_MAX_SPLITS,
                                avg_keys=var.decode_avg_keys, forced=forced, max_keys=max_keys)
    return split_count(B, nnz, ps, blocks_per_split, target_blocks=DECODE_TARGET_BLOCKS,
                       min_split_keys=DECODE_MIN_SPLIT_KEYS, max_splits=DECODE_MAX_SPLITS,
                       avg_keys=var.decode_avg_keys, forced=forced)


def _split_budget(staged: bool, tc: bool) -> int:
    """Blocks a chunked split (``chunk_split``) aims at: ``CHUNK_WAVES`` waves of the kernel's resident blocks
    (the lane-group kernel: its split rule's target)."""
    if staged or tc:
        return CHUNK_WAVES * (TCD_RESIDENT_BLOCKS if tc else STAGED_RESIDENT_BLOCKS)
    return DECODE_TARGET_BLOCKS


#: Split-KV policy of the lane-group decode kernel (see ``_split_count``): about two blocks per SM of an
#: H100/H200.
DECODE_TARGET_BLOCKS = 264
DECODE_MIN_SPLIT_KEYS = 256
DECODE_MAX_SPLITS = 32
#: ... of the staged kernel (``_decode_staged_cuda``; ``_common_cuda.wave_split_count``): fp16 / bf16 at
#: D = 128 and groups 4 / 8 take 160-168 registers, so 3 blocks of 128 threads are resident per SM, 396 on
#: the 132 SMs of an H200 / H100 SXM. 8 kv heads: B = 1 x 32K: S = 49 (392 blocks, one wave); B = 16 x 4K:
#: S = 3 (384); B = 64: S = 3 (1536 blocks, 3.9 waves, where one wave's fill gave S = 1: 512 blocks, a
#: second wave of 116); B = 256 x 2K: S = 1 (2048 blocks, 5.2 waves).
STAGED_RESIDENT_BLOCKS = 3 * 132
STAGED_MAX_SPLITS = 64
#: Waves of resident blocks a chunked split aims at (``chunk_split``; ``wave_split_count`` budgets 4 waves for
#: 0.5 to 2 waves of unsplit blocks): H100, the 32 x 8 kv heads batch of 128 .. 16K keys: ranges of 1024 keys.
CHUNK_WAVES = 4
def use_tc(spec, rope: bool = False) -> bool:
    """Whether the plain (``rope=False``) or inline-RoPE decode runs the tensor-core kernel: the selection
    table's choice (``pagedkv.kernel_table.choose``; ``cuda_decode_kernel=tc`` raises where it does not serve)."""
    return choose(ATTN_DECODE_PAGED, spec, rope=rope).name == "tc"


def use_staged(spec, rope: bool = False) -> bool:
    """Whether the plain (``rope=False``) or inline-RoPE decode runs the staged kernel (the selection table's
    choice; ``cuda_decode_kernel=staged`` raises where ``staged_limits`` / ``staged_rope_limits`` refuse)."""
    return choose(ATTN_DECODE_PAGED, spec, rope=rope).name == "staged"


def _make_key_loop(p: DecodePlan, var: CudaVariant, rope: bool, table=None):
    """``key_loop(...)``: the lane group's softmax state over the split's keys ``[k0, k1)``, in steps of
    ``TKB`` keys: load, score, softmax, accumulate. Inline RoPE first sets up the rotations and walks the
    steps in batches of ``NW``, each with its rotated-q table (``_decode_rope_cuda``)."""
    NW, TKB, KPT = p.nw, p.tkb, p.kpt
    load_kv, score, softmax = make_load_kv(p, rope), make_score(p, rope), make_softmax(p, var)
    accumulate, load_q = make_accumulate(p), make_load_q(p)
    rope_setup, rope_q_table, load_q_table = make_rope_stages(p, table)

    @T.macro
    def key_step(regs, pages, page_values, pbase, ps, h, key0, k1, tx):
        Qr, Kr, Vr, S_, Oc, Os, m, lsum, Orr, st = regs
        load_kv(Kr, Vr, pages, page_values, pbase, ps, h, key0, k1, tx)
        score(S_, Qr, Kr, Oc, Os)
        softmax(S_, m, lsum, Orr, st, key0, k1)
        accumulate(Orr, S_, Vr)

    @T.macro
    def key_loop(regs, rope_regs, q, pages, page_indptr, page_values, k_pos_offset, q_pos, b, h, row0, k0, k1,
                 ps, rope_scale, rope_theta, sm_scale, tx, ty):
        Qr, _Kr, _Vr, _S, Oc, Os, m, lsum, Orr, _st = regs
        w_s, q_raw, red_o = rope_regs  # red_o: the rotated-q table until the store
        steps: T.let[T.int32] = T.truncdiv(k1 - k0 + TKB - 1, TKB)
        if rope:
            rope_setup(w_s, Oc, Os, q_raw, Orr, m, lsum, q, b, row0, rope_theta, rope_scale, sm_scale, tx, ty)
            # Batches of NW steps. Barriers: the previous batch's table readers are done; the table is written.
            for bt in T.serial(T.truncdiv(steps + NW - 1, NW)):
                T.tvm_storage_sync("shared")
                rope_q_table(red_o, q_raw, w_s, q_pos[b] - k_pos_offset[b] - k0 - (bt * NW + ty) * TKB, tx, ty)
                T.tvm_storage_sync("shared")
                for w in T.serial(T.min(NW, steps - bt * NW)):
                    load_q_table(Qr, red_o, w, tx)
                    key_step(regs, pages, page_values, page_indptr[b], ps, h,
                             k0 + (bt * NW + w) * TKB + ty * KPT, k1, tx)
            T.tvm_storage_sync("shared")  # the store reuses the table's shared memory
        else:
            load_q(Qr, Orr, m, lsum, q, b, row0, sm_scale, tx)
            for it in T.serial(steps):
                key_step(regs, pages, page_values, page_indptr[b], ps, h, k0 + it * TKB + ty * KPT, k1, tx)

    return key_loop


def _make_kernel(p: DecodePlan, var: CudaVariant, rope: bool, table=None):
    """The decode kernel (inline RoPE or plain) as a macro: the grid, the registers and shared memory, the
    split's key range, the key loop and the store (``_decode_stages_cuda``); ``table``: inline RoPE with a RoPE
    variant's constants (``_decode_rope_cuda.make_rope_stages``)."""
    GC, VEC, NW, L, H2, TKB = p.gc, p.vec, p.nw, p.l, p.vec // 2, p.tkb
    key_loop, store = _make_key_loop(p, var, rope, table), make_store(p)
    # RoPE-only buffers are 1 element in the plain kernel (its code does not touch them).
    R1 = 1 if not rope else None

    @T.macro
    def kernel(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
               rope_scale, rope_theta, sm_scale, S, C, ws_o, ws_l):
        for bx in T.thread_binding(T.max(B, 1), thread="blockIdx.x"):
            for h in T.thread_binding(p.hkv, thread="blockIdx.y"):
                for zs in T.thread_binding(p.nz * S, thread="blockIdx.z"):
                    for ty in T.thread_binding(NW, thread="threadIdx.y"):
                        for tx in T.thread_binding(L, thread="threadIdx.x"):
                            Qr = T.alloc_buffer((GC, VEC), "float32", scope="local")
                            Orr = T.alloc_buffer((GC, VEC), "float32", scope="local")
                            m = T.alloc_buffer((GC,), "float32", scope="local")
                            lsum = T.alloc_buffer((GC,), "float32", scope="local")
                            Kr = T.alloc_buffer((p.kpt, VEC), p.dtype, scope="local")
                            Vr = T.alloc_buffer((p.kpt, VEC), p.dtype, scope="local")
                            S_ = T.alloc_buffer((p.kpt, GC), "float32", scope="local")
                            st = T.alloc_buffer((2,), "float32", scope="local")
                            # RoPE: key-offset rotations, pair frequencies, the block's unrotated q rows.
                            Oc = T.alloc_buffer((R1 or p.kpt * H2,), "float32", scope="local")
                            Os = T.alloc_buffer((R1 or p.kpt * H2,), "float32", scope="local")
                            w_s = T.alloc_buffer((R1 or 2, R1 or L * H2), "float32", scope="shared")
                            q_raw = T.alloc_buffer((R1 or GC, R1 or p.lanes_width), "float32", scope="shared")
                            red_ml = T.alloc_buffer((NW, GC, 2), "float32", scope="shared")
                            # The lane-group states at the end; with RoPE first the rotated-q table.
                            red_o = T.alloc_buffer((NW, GC, p.lanes_width if rope else p.d), "float32",
                                                   scope="shared")
                            if bx < B:
                                Sk: T.let[T.int32] = opaque_i32(S)  # the split count, opaque in the kernel
                                gz: T.let[T.int32] = T.truncdiv(zs, Sk)
                                sp: T.let[T.int32] = T.truncmod(zs, Sk)
                                kvlen: T.let[T.int32] = paged_kv_len(page_indptr, last_page_len, bx, ps)
                                # This split's keys: [k0, k1) (split_chunk: a chunked or an equal range).
                                chunk: T.let[T.int32] = split_chunk(var, kvlen, Sk, opaque_i32(C), TKB)
                                k0: T.let[T.int32] = T.min(var.decode_key(kvlen, sp * chunk), kvlen)
                                k1: T.let[T.int32] = T.min(k0 + chunk, kvlen)
                                key_loop((Qr, Kr, Vr, S_, Oc, Os, m, lsum, Orr, st), (w_s, q_raw, red_o), q,
                                         pages, page_indptr, page_values, k_pos_offset, q_pos, bx, h,
                                         h * p.g + gz * GC, k0, k1, ps, rope_scale, rope_theta, sm_scale, tx, ty)
                                store(o, lse, ws_o, ws_l, red_ml, red_o, m, lsum, Orr, bx, h, gz, sp, Sk, tx, ty)

    return kernel


def attn_decode_paged_cuda(spec):
    """``pagedkv_attn_decode_paged`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``.

    Split-KV: when ``B * Hkv`` blocks cannot fill the GPU and the entries are long, each (entry, kv head)
    is split into ``S`` key ranges (``_split_count``, computed on the host from the shapes); the blocks
    write normalized partial states (o, lse) to a workspace and a second kernel merges them.

    Mask and logits rules: ``CudaVariant.from_spec(spec)`` (with a sliding window the split ranges cover only
    the window's keys, so a window costs its own keys, not the entry's).

    The path switch ``cuda_decode_splits = N > 0`` (``decode_splits``) forces the split count (tests reach
    the direct-write ``S = 1`` path and the workspace + merge path on any shape); clamped to
    ``[1, nnz * ps]``. Automatic: the kernel is the one from before the switch. The switch
    ``cuda_decode_kernel`` picks the kernels (``use_staged``): "lanes" is the lane-group kernel of this
    module for both variants (with its split policy), "staged" the shared-memory one of ``_decode_staged_cuda``
    (inline RoPE: ``_decode_staged_rope_cuda``) for both; auto: staged per variant where its limits allow.
    """
    HQ, HKV, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    var = CudaVariant.from_spec(spec)
    splits, ranges = decode_splits(spec), decode_split_ranges(spec)
    check_head_dim(ATTN_DECODE_PAGED, D)
    plan = DecodePlan(HQ, HKV, D, dtype, *_decode_plan(HQ // HKV, D, dtype))
    merge_splits = make_merge_splits(HQ, D, 128, dtype)
    # Two kernels: inline RoPE costs registers that the plain kernel does not pay for. Each is the staged kernel
    # where it applies (``use_staged``; RoPE's limits include the plain ones); the split count then follows the
    # staged policy (one block per split and kv head), for a lane-group RoPE kernel too (any S is correct).
    # The plain kernel may be the tensor-core one (``use_tc``); its split policy then rules (2 blocks an SM).
    # A RoPE variant's table: the lane-group kernel's inline RoPE takes a whole-head, halves one, whatever
    # cuda_decode_kernel forces (it picks the plain kernel then: the spec is the same for rope_mode "normal", whose
    # build must not fail on the inline kernel it never runs); other variants have none (refuse).
    TABLE = spec.rope is not None and cuda_inline_serves(spec.rope, D)
    INLINE, refuse = spec.rope is None or TABLE, make_no_inline_rope(ATTN_DECODE_PAGED)
    tc = use_tc(spec)
    tc_rope = use_tc(spec, rope=True) if spec.rope is None else False
    staged = use_staged(spec) and not tc
    staged_rope = use_staged(spec, rope=True) and not tc_rope if spec.rope is None else False
    if not INLINE:
        kernel_rope = None
    elif TABLE:
        kernel_rope = _make_kernel(plan, var, True, spec.rope)
    elif tc_rope:
        kernel_rope = make_tc_kernel(HQ, HKV, D, dtype, var, rope=True)
    elif staged_rope:
        kernel_rope = make_staged_rope_kernel(staged_plan(HQ, HKV, D, dtype), var)
    else:
        kernel_rope = _make_kernel(plan, var, True)
    if tc:
        kernel_plain = make_tc_kernel(HQ, HKV, D, dtype, var)
    elif staged:
        kernel_plain = make_staged_kernel(staged_plan(HQ, HKV, D, dtype), var)
    else:
        kernel_plain = _make_kernel(plan, var, False)
    bps = HKV if staged or tc else HKV * plan.nz

    # The blocks an (entry, kv head) and the keys of each (chunk_split; C = 0: the span in S equal ranges).
    split_plan = functools.partial(chunk_split, ranges=max(1, _split_budget(staged, tc) // bps),
                                   max_splits=STAGED_MAX_SPLITS if staged or tc else DECODE_MAX_SPLITS,
                                   min_keys=DECODE_MIN_SPLIT_KEYS, avg_keys=var.decode_avg_keys, mode=ranges,
                                   forced=splits)

    @T.macro
    def body(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, apply_rope,
             rope_scale, rope_theta, sm_scale, max_kv_len, dims):
        B, _p, ps, nnz = dims
        S0: T.let[T.int32] = _split_count(B, nnz, ps, bps, var, splits, staged, tc, max_kv_len)
        S: T.let[T.int32] = split_plan(B, nnz, S0, ps=ps, max_keys=max_kv_len)[0]
        C: T.let[T.int32] = split_plan(B, nnz, S0, ps=ps, max_keys=max_kv_len)[1]
        # Split partial states (float32); only touched when S > 1.
        ws_o = T.alloc_buffer((T.max(B, 1) * HQ * S, D), "float32")
        ws_l = T.alloc_buffer((T.max(B, 1) * HQ * S,), "float32")
        if TABLE:  # static: the set rides in rope_theta, the attention factor in the scale (_rope_table)
            if rope_on(apply_rope):
                kernel_rope(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                            rope_scale, T.Cast("float32", apply_rope), whole_head_scale(spec.rope, sm_scale), S, C,
                            ws_o, ws_l)
            else:
                kernel_plain(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                             rope_scale, rope_theta, sm_scale, S, C, ws_o, ws_l)
        elif INLINE:  # static
            if apply_rope == 1:
                kernel_rope(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                            rope_scale, rope_theta, sm_scale, S, C, ws_o, ws_l)
            else:
                kernel_plain(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                             rope_scale, rope_theta, sm_scale, S, C, ws_o, ws_l)
        else:
            refuse(apply_rope)
            kernel_plain(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                         rope_scale, rope_theta, sm_scale, S, C, ws_o, ws_l)
        if S > 1:
            merge_splits(o, lse, B, S, ws_o, ws_l)

    return abi_prim_func(spec_op(ATTN_DECODE_PAGED, spec), shape_values(spec), dtype, body, scheduled=True,
                         adapter="direct_max_kv_len")
