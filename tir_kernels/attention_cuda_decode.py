"""CUDA paged decode (``attn_decode_paged``).

Design and ABI: the docstring of ``attention_cuda.py``.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from ..ops import ATTN_DECODE_PAGED, shape_values
from ._abi import abi_prim_func
from ._common import EMPTY_LSE, LOG2E
from ._common_cuda import (
    WARP,
    ceildiv,
    check_head_dim,
    decode_splits,
    make_merge_splits,
    frcp_rn,
    itemsize,
    next_pow2,
    paged_kv_len,
    rope_angle_rcp,
    rope_divisor,
    rotate,
    shfl_xor,
    split_count,
    vec16,
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


def _split_count(B, nnz, ps, blocks_per_split, var: CudaVariant, forced: int = 0):
    """Key splits per (entry, kv head) of the decode kernel (``split_count`` with the decode constants and
    the variant's keys per entry; ``forced > 0``: that many, clamped, see ``split_count``)."""
    return split_count(B, nnz, ps, blocks_per_split, target_blocks=DECODE_TARGET_BLOCKS,
                       min_split_keys=DECODE_MIN_SPLIT_KEYS, max_splits=DECODE_MAX_SPLITS,
                       avg_keys=var.decode_avg_keys, forced=forced)



#: Split-KV policy of the decode kernel (see ``_split_count``): about two blocks per SM of an H100/H200.
DECODE_TARGET_BLOCKS = 264
DECODE_MIN_SPLIT_KEYS = 256
DECODE_MAX_SPLITS = 32


def attn_decode_paged_cuda(spec):
    """``pagedkv_attn_decode_paged`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``.

    Split-KV: when ``B * Hkv`` blocks cannot fill the GPU and the entries are long, each (entry, kv head)
    is split into ``S`` key ranges (``_split_count``, computed on the host from the shapes); the blocks
    write normalized partial states (o, lse) to a workspace and a second kernel merges them.

    Mask and logits rules: ``CudaVariant.from_spec(spec)`` (with a sliding window the split ranges cover only
    the window's keys, so a window costs its own keys, not the entry's).

    The path switch ``cuda_decode_splits = N > 0`` (``decode_splits``) forces the split count (tests reach
    the direct-write ``S = 1`` path and the workspace + merge path on any shape); clamped to
    ``[1, nnz * ps]``. Automatic: the kernel is the one from before the switch.
    """
    HQ, HKV, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    var = CudaVariant.from_spec(spec)
    splits = decode_splits(spec)
    check_head_dim(ATTN_DECODE_PAGED, D)
    G = HQ // HKV
    VEC, L0, L, NW, GC, KPT_PLAIN = _decode_plan(G, D, dtype)
    NZ = G // GC
    HALF = D // 2
    V16 = min(VEC, vec16(dtype))
    NT = L * NW
    SHIFTS = len([L >> (s + 1) for s in range(int(math.log2(L)))])
    MT = 128  # threads of the merge kernel

    H2 = VEC // 2
    V16H = min(H2, vec16(dtype))

    @T.macro
    def load_chunk(dst, pages, pg, c, h, off, d0, kk, base):
        """``dst[kk, base + e] = pages[pg, c, h, off, d0 + e]`` for ``e < VEC`` (16-byte loads)."""
        for u in T.unroll(VEC // V16):
            for e in T.vectorized(V16):
                dst[kk, base + u * V16 + e] = pages[pg, c, h, off, d0 + u * V16 + e]

    @T.macro
    def load_halves(dst, pages, pg, c, h, off, d0h, kk):
        """RoPE lane layout: ``dst[kk, e] = row[d0h + e]``, ``dst[kk, H2 + e] = row[D/2 + d0h + e]``
        (``e < VEC/2``): a lane holds both elements of each of its rotation pairs."""
        for u in T.unroll(H2 // V16H):
            for e in T.vectorized(V16H):
                dst[kk, u * V16H + e] = pages[pg, c, h, off, d0h + u * V16H + e]
        for u in T.unroll(H2 // V16H):
            for e in T.vectorized(V16H):
                dst[kk, H2 + u * V16H + e] = pages[pg, c, h, off, HALF + d0h + u * V16H + e]

    def make_kernel(ROPE: bool):
        # Inline RoPE is compute-bound: fewer keys in flight, fewer registers.
        KPT = KPT_PLAIN if not ROPE else max(1, KPT_PLAIN // 2)
        TKB = NW * KPT  # keys per block step

        @T.macro
        def kernel(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                   rope_scale, rope_theta, sm_scale, S, ws_o, ws_l):
            for bx in T.thread_binding(T.max(B, 1), thread="blockIdx.x"):
                for h in T.thread_binding(HKV, thread="blockIdx.y"):
                    for zs in T.thread_binding(NZ * S, thread="blockIdx.z"):
                        for ty in T.thread_binding(NW, thread="threadIdx.y"):
                            for tx in T.thread_binding(L, thread="threadIdx.x"):
                                Qr = T.alloc_buffer((GC, VEC), "float32", scope="local")
                                Orr = T.alloc_buffer((GC, VEC), "float32", scope="local")
                                m = T.alloc_buffer((GC,), "float32", scope="local")
                                lsum = T.alloc_buffer((GC,), "float32", scope="local")
                                Kr = T.alloc_buffer((KPT, VEC), dtype, scope="local")
                                Vr = T.alloc_buffer((KPT, VEC), dtype, scope="local")
                                Kf = T.alloc_buffer((KPT, VEC) if ROPE else (1,), "float32", scope="local")
                                S_ = T.alloc_buffer((KPT, GC), "float32", scope="local")
                                invf = T.alloc_buffer((H2,), "float32", scope="local")
                                rcpf = T.alloc_buffer((H2,), "float32", scope="local")
                                st = T.alloc_buffer((4,), "float32", scope="local")
                                red_ml = T.alloc_buffer((NW, GC, 2), "float32", scope="shared")
                                red_o = T.alloc_buffer((NW, GC, D), "float32", scope="shared")
                                if bx < B:
                                    b: T.let[T.int32] = bx
                                    gz: T.let[T.int32] = T.truncdiv(zs, S)
                                    sp: T.let[T.int32] = T.truncmod(zs, S)
                                    kvlen: T.let[T.int32] = paged_kv_len(page_indptr, last_page_len, b, ps)
                                    # This split's keys: [k0, k1), chunks a multiple of the block step.
                                    chunk: T.let[T.int32] = T.truncdiv(T.truncdiv(var.decode_span_len(kvlen) + S - 1, S) + TKB - 1,
                                                                       TKB) * TKB
                                    k0: T.let[T.int32] = T.min(var.decode_key(kvlen, sp * chunk), kvlen)
                                    k1: T.let[T.int32] = T.min(k0 + chunk, kvlen)
                                    pbase: T.let[T.int32] = page_indptr[b]
                                    # Lane dims: plain, d0 + e (one 16-byte chunk); inline RoPE, d0h + e and
                                    # D/2 + d0h + e for e < VEC/2 (both elements of its rotation pairs, so
                                    # each angle is computed once). q.k and P@V do not depend on the order.
                                    d0: T.let[T.int32] = tx * VEC
                                    d0h: T.let[T.int32] = tx * H2
                                    if ROPE:
                                        for e in T.unroll(H2):
                                            invf[e] = rope_divisor(d0h + e, rope_theta, D)
                                            rcpf[e] = frcp_rn(invf[e])
                                    # q rows of this kv head, rotated and scaled by sm_scale * log2(e).
                                    for g in T.unroll(GC):
                                        for e in T.unroll(VEC):
                                            Qr[g, e] = T.float32(0)
                                            Orr[g, e] = T.float32(0)
                                        if tx < L0:
                                            if ROPE:
                                                for e in T.unroll(H2):
                                                    xlo: T.let[T.float32] = T.Cast("float32", q[b, h * G + gz * GC + g, d0h + e])
                                                    xhi: T.let[T.float32] = T.Cast("float32", q[b, h * G + gz * GC + g, HALF + d0h + e])
                                                    ang: T.let[T.float32] = rope_angle_rcp(q_pos[b], rope_scale, invf[e], rcpf[e])
                                                    Qr[g, e] = rotate(xlo, xhi, True, ang)
                                                    Qr[g, H2 + e] = rotate(xhi, xlo, False, ang)
                                            else:
                                                for e in T.unroll(VEC):
                                                    Qr[g, e] = T.Cast("float32", q[b, h * G + gz * GC + g, d0 + e])
                                            for e in T.unroll(VEC):
                                                Qr[g, e] = Qr[g, e] * (sm_scale * T.float32(LOG2E))
                                        m[g] = T.float32(EMPTY_LSE)
                                        lsum[g] = T.float32(0)
                                    for it in T.serial(T.truncdiv(k1 - k0 + TKB - 1, TKB)):
                                        # Issue every load of the step first (KPT keys, K and V); keys past the
                                        # split are clamped to its last key (valid memory) and masked below.
                                        for kk in T.unroll(KPT):
                                            jc: T.let[T.int32] = T.min(k0 + it * TKB + ty * KPT + kk, k1 - 1)
                                            pg: T.let[T.int32] = page_values[pbase + T.truncdiv(jc, ps)]
                                            if tx < L0:
                                                if ROPE:
                                                    load_halves(Kr, pages, pg, 0, h, T.truncmod(jc, ps), d0h, kk)
                                                    load_halves(Vr, pages, pg, 1, h, T.truncmod(jc, ps), d0h, kk)
                                                else:
                                                    load_chunk(Kr, pages, pg, 0, h, T.truncmod(jc, ps), d0, kk, 0)
                                                    load_chunk(Vr, pages, pg, 1, h, T.truncmod(jc, ps), d0, kk, 0)
                                            else:
                                                for e in T.unroll(VEC):
                                                    Kr[kk, e] = T.Cast(dtype, 0)
                                                for e in T.unroll(VEC):
                                                    Vr[kk, e] = T.Cast(dtype, 0)
                                        # Partial dot products (keys rotated at position k_pos_offset + j
                                        # when inline RoPE), folded over the L lanes of the group.
                                        if ROPE:
                                            for kk in T.unroll(KPT):
                                                for e in T.unroll(H2):
                                                    Kf[kk, e] = rotate(
                                                        Kr[kk, e], Kr[kk, H2 + e], True,
                                                        rope_angle_rcp(k_pos_offset[b] + k0 + it * TKB + ty * KPT + kk,
                                                                       rope_scale, invf[e], rcpf[e]))
                                                    Kf[kk, H2 + e] = rotate(
                                                        Kr[kk, H2 + e], Kr[kk, e], False,
                                                        rope_angle_rcp(k_pos_offset[b] + k0 + it * TKB + ty * KPT + kk,
                                                                       rope_scale, invf[e], rcpf[e]))
                                            for kk in T.unroll(KPT):
                                                for g in T.unroll(GC):
                                                    S_[kk, g] = T.float32(0)
                                                    for e in T.unroll(VEC):
                                                        S_[kk, g] = S_[kk, g] + Qr[g, e] * Kf[kk, e]
                                        else:
                                            for kk in T.unroll(KPT):
                                                for g in T.unroll(GC):
                                                    S_[kk, g] = T.float32(0)
                                                    for e in T.unroll(VEC):
                                                        S_[kk, g] = S_[kk, g] + Qr[g, e] * T.Cast("float32", Kr[kk, e])
                                        for sh in T.unroll(SHIFTS):
                                            for kk in T.unroll(KPT):
                                                for g in T.unroll(GC):
                                                    S_[kk, g] = S_[kk, g] + shfl_xor(S_[kk, g], T.shift_right(L, sh + 1))
                                        # Online softmax of this lane group (keys past the split are masked;
                                        # the soft cap, when on, comes first, as in the reference).
                                        for g in T.unroll(GC):
                                            st[0] = m[g]
                                            for kk in T.unroll(KPT):
                                                S_[kk, g] = var.logits(S_[kk, g], k0 + it * TKB + ty * KPT + kk < k1)
                                                st[0] = T.max(st[0], S_[kk, g])
                                            st[1] = T.exp2(m[g] - st[0])
                                            m[g] = st[0]
                                            lsum[g] = lsum[g] * st[1]
                                            for e in T.unroll(VEC):
                                                Orr[g, e] = Orr[g, e] * st[1]
                                            for kk in T.unroll(KPT):
                                                st[2] = T.exp2(S_[kk, g] - st[0])
                                                lsum[g] = lsum[g] + st[2]
                                                for e in T.unroll(VEC):
                                                    Orr[g, e] = Orr[g, e] + st[2] * T.Cast("float32", Vr[kk, e])
                                    # Merge the NW lane-group states through shared memory.
                                    for g in T.unroll(GC):
                                        if tx == 0:
                                            red_ml[ty, g, 0] = m[g]
                                            red_ml[ty, g, 1] = lsum[g]
                                        if tx < L0:
                                            if ROPE:
                                                for e in T.unroll(H2):
                                                    red_o[ty, g, d0h + e] = Orr[g, e]
                                                    red_o[ty, g, HALF + d0h + e] = Orr[g, H2 + e]
                                            else:
                                                for u in T.unroll(VEC // 4):
                                                    for e in T.vectorized(4):
                                                        red_o[ty, g, d0 + u * 4 + e] = Orr[g, u * 4 + e]
                                    T.tvm_storage_sync("shared")
                                    for idx in T.serial(ceildiv(GC * D, NT)):
                                        if idx * NT + ty * L + tx < GC * D:
                                            gg: T.let[T.int32] = T.truncdiv(idx * NT + ty * L + tx, D)
                                            dd: T.let[T.int32] = T.truncmod(idx * NT + ty * L + tx, D)
                                            hq: T.let[T.int32] = h * G + gz * GC + gg
                                            st[0] = T.float32(EMPTY_LSE)
                                            for w in T.unroll(NW):
                                                st[0] = T.max(st[0], red_ml[w, gg, 0])
                                            st[1] = T.float32(0)
                                            st[2] = T.float32(0)
                                            for w in T.unroll(NW):
                                                st[3] = T.exp2(red_ml[w, gg, 0] - st[0])
                                                st[1] = st[1] + red_ml[w, gg, 1] * st[3]
                                                st[2] = st[2] + red_o[w, gg, dd] * st[3]
                                            # l >= 1 once any key was seen (its max contributes 2^0); else 0.
                                            if S == 1:
                                                if st[1] > T.float32(0):
                                                    o[b, hq, dd] = T.Cast(dtype, st[2] / st[1])
                                                    if dd == 0:
                                                        lse[b, hq] = st[0] + T.log2(st[1])
                                                else:
                                                    o[b, hq, dd] = T.Cast(dtype, T.float32(0))
                                                    if dd == 0:
                                                        lse[b, hq] = T.float32(EMPTY_LSE)
                                            else:
                                                # Partial state of split sp (float32 workspace).
                                                if st[1] > T.float32(0):
                                                    ws_o[(b * HQ + hq) * S + sp, dd] = st[2] / st[1]
                                                    if dd == 0:
                                                        ws_l[(b * HQ + hq) * S + sp] = st[0] + T.log2(st[1])
                                                else:
                                                    ws_o[(b * HQ + hq) * S + sp, dd] = T.float32(0)
                                                    if dd == 0:
                                                        ws_l[(b * HQ + hq) * S + sp] = T.float32(EMPTY_LSE)

        return kernel

    merge_splits = make_merge_splits(HQ, D, MT, dtype)

    kernel_rope, kernel_plain = make_kernel(True), make_kernel(False)

    @T.macro
    def body(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, apply_rope,
             rope_scale, rope_theta, sm_scale, dims):
        B, _p, ps, nnz = dims
        S: T.let[T.int32] = _split_count(B, nnz, ps, HKV * NZ, var, splits)
        # Split partial states (float32); only touched when S > 1.
        ws_o = T.alloc_buffer((T.max(B, 1) * HQ * S, D), "float32")
        ws_l = T.alloc_buffer((T.max(B, 1) * HQ * S,), "float32")
        # Two kernels: inline RoPE costs registers that the plain kernel does not pay for.
        if apply_rope == 1:
            kernel_rope(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                        rope_scale, rope_theta, sm_scale, S, ws_o, ws_l)
        else:
            kernel_plain(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                         rope_scale, rope_theta, sm_scale, S, ws_o, ws_l)
        if S > 1:
            merge_splits(o, lse, B, S, ws_o, ws_l)

    return abi_prim_func(ATTN_DECODE_PAGED, shape_values(spec), dtype, body, scheduled=True)
