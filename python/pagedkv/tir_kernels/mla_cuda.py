"""CUDA MLA kernels (DeepSeek multi-head latent attention, weight-absorbed form) over paged latents.

An MLA page holds one latent vector of ``DL = kv_lora_rank + qk_rope_head_dim`` elements per token
(``pages[P, 1, 1, ps, DL]``). Every query head attends to the same latent sequence: the key of a token is
its whole latent, its value the first ``DV = kv_lora_rank`` elements of the same row. That is grouped
attention with one kv head and a group of all ``H`` query heads.

Semantics are those of the MHA kernels (``attention_cuda.py``): float32 accumulation, scores in log2 units
(``sm_scale * log2(e)`` folded into q when it is loaded), base-2 ``lse``, bottom-right causal, a row that
sees no key writes ``o = 0`` and ``lse = -1e30``. Keys at or past an entry's length are never read.

Attention: one block of 128 threads per *row tile* (and key split)
------------------------------------------------------------------
The row tile's stages, one macro factory each: ``_mla_simt_stages.py``; the grids below call its ``row_tile``.

* A row tile is ``R = 16`` rows of one entry (8 for latents past 576 elements); entry row ``r`` is query
  token ``r // H``, head ``r % H``, so the heads of a token (and, for small ``H``, of consecutive tokens)
  share every latent row the block loads. A decode with ``H < 16`` leaves rows idle.
* Threads are 8 x 16 (``ty``, ``tx``): thread (ty, tx) owns rows ``RI*ty ..`` (``RI = R / 8``) and, per
  key tile of ``TK = 16`` keys, key ``tx`` for the scores and output dims ``tx + 16 i`` of every 64-dim
  chunk for P@V (``RI * 4 * ceil(DV / 64)`` float32 accumulators, 64 for DeepSeek).
* Shared memory (float32): ``Qs[R, QW + 4]`` (``QW = 64 * ceil(DL / 64)``; q scaled by
  ``sm_scale * log2(e)``, zero past ``DL``; +4 spreads the rows over the banks), two chunk buffers ``Cb0``,
  ``Cb1`` of ``[TK, 64 + 4]`` (64 dims of ``TK`` latent rows; stride 68 makes the per-lane float4 row reads
  conflict-free), the tile's probabilities ``Ps[R, TK]`` and a few block-uniform ints (``blk``, re-read
  after barriers instead of held in registers across the key loop).
* A key tile is ``NS = NKC + NVC`` *steps* (statically unrolled): ``NKC = ceil(DL / 64)`` score chunks
  (partial q.k over 64 dims; after the last one, the online softmax, which publishes P to ``Ps``), then
  ``NVC = ceil(DV / 64)`` value chunks (``O += P @ V`` on 64 dims; V is re-read from L1/L2, which costs
  less than keeping a 16 x 576 float32 tile in shared memory). The steps form a software pipeline: step
  ``j + 1`` is loaded from global memory into registers while step ``j`` computes, then stored into the
  other chunk buffer, so one barrier per step suffices (plus one per tile when ``NS`` is odd).
* Keys at or past the tile's last visible key (``kend``) are loaded from the last visible key instead
  (valid memory, never past the entry) and replaced by zeros with a select; scores of keys a row must not
  see become ``MASKED`` (``T.if_then_else``) before the softmax, whose ``exp2`` then gives exactly 0.
* Shared memory: at most ``smem_bytes(R, DL)`` (ptxas: 47,076 bytes for DeepSeek's 576), static, under the
  48 KB limit (TVM 0.27 fails to merge ``shared.dyn`` buffers here). Registers: 128 per thread for
  DeepSeek (ptxas, sm_90a), so 4 blocks (16 warps) per SM, which is also the shared-memory limit.
* Prefill grid: ``blockIdx.x`` = virtual tile ``v`` in ``[0, n * H // R + B)``; entry ``b`` owns
  ``[q_indptr[b] * H // R + b, q_indptr[b+1] * H // R + b + 1)`` (at least ``ceil(qlen * H / R)``), found
  by binary search; surplus tiles idle. Within an entry the last row tile (most keys when causal) runs first.
* Decode grid: (entry, row tile, key split). ``S`` splits per entry when ``B * ceil(H / R)`` blocks cannot
  fill the GPU and entries are long (``_split_count``, on the host from the shapes); with ``S > 1`` the
  blocks write normalized partial states (o, lse) to a float32 workspace and a second kernel merges them
  (``cuda_decode_splits`` in ``KernelSpec.paths`` forces ``S`` for tests).

TVM pitfalls met here: a vectorized cast from a register array (``half4 v_ = *(half4*)(Xr)``) is bound
once by the CUDA codegen and reused after the array changed (so fp16 is converted element-wise); shared
loads may not appear in ``if`` conditions or loop extents (``T.let`` them first).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel_table import choose
from ..ops import MLA_APPEND_KV, MLA_ATTN_DECODE_PAGED, MLA_ATTN_PREFILL_PAGED, MLA_GATHER_KV, shape_values
from ._abi import abi_prim_func, spec_op
from ._common_cuda import (ceildiv, decode_splits, find_tile_entry, make_merge_splits, opaque_i32, paged_kv_len,
                           split_count, vec16)
# The row tile's block layout (TY x TX threads, TK keys a tile, DC dims a step) and its stages.
from ._mla_simt_stages import CS, DC, NT, TK, TY, RowTilePlan, make_row_tile

#: Static shared memory limit of a block.
SMEM_LIMIT = 48 * 1024
#: Output accumulators per thread at most (``RI * NVC * 4``) before registers spill.
MAX_ACC = 64
#: Split-KV policy of the decode kernel: about two blocks per SM of an H100/H200, splits of at least
#: ``MIN_SPLIT_KEYS`` keys of an average entry, at most ``MAX_SPLITS``.
TARGET_BLOCKS = 264
MIN_SPLIT_KEYS = 128
MAX_SPLITS = 64
#: Bytes of shared memory beyond the float32 arrays: the block-uniform ints and 64-byte alignment.
SMEM_SLACK = 256
#: Threads per block of the page kernels and of the split merge.
PAGE_NT = 256
MERGE_NT = 128


def check_mla_dims(op: str, kv_lora_rank: int, qk_rope_head_dim: int):
    """Both parts of the latent must be positive multiples of 16 (16-byte page vectors that never
    straddle the value / rope boundary)."""
    for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim)):
        if value <= 0 or value % 16:
            raise NotImplementedError(f"pagedkv.tir_kernels: the CUDA {op!r} kernel needs {name} to be a "
                                      f"positive multiple of 16, got {name}={value}")


def smem_bytes(rows: int, latent_dim: int) -> int:
    """Static shared memory of an attention block of ``rows`` rows, an upper bound (``Qs``, two chunk
    buffers, ``Ps``, ``blk``)."""
    return 4 * (rows * (ceildiv(latent_dim, DC) * DC + 4) + 2 * TK * CS + rows * TK) + SMEM_SLACK


#: Largest latent of a block of 8 rows within SMEM_LIMIT (16 rows: 576).
MAX_LATENT = max(d for d in range(DC, 64 * DC, DC) if smem_bytes(TY, d) <= SMEM_LIMIT)


def rows_per_thread(op: str, kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """``RI`` (the block has ``8 * RI`` rows): 2, or 1 when 16 rows do not fit the shared memory or the
    accumulator budget. Decodes of fewer than 16 heads use 16 rows too: with 8, ptxas squeezed the small
    kernels for occupancy and spilled the softmax state."""
    check_mla_dims(op, kv_lora_rank, qk_rope_head_dim)
    dl, nvc = kv_lora_rank + qk_rope_head_dim, ceildiv(kv_lora_rank, DC)
    for ri in (2, 1):
        if smem_bytes(TY * ri, dl) <= SMEM_LIMIT and ri * nvc * 4 <= MAX_ACC:
            return ri
    raise NotImplementedError(f"pagedkv.tir_kernels: the CUDA {op!r} kernel supports kv_lora_rank up to "
                              f"{MAX_ACC // 4 * DC} and kv_lora_rank + qk_rope_head_dim up to {MAX_LATENT}, got "
                              f"kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={qk_rope_head_dim}")


def _split_count(B, nnz, ps, blocks_per_split, forced: int = 0):
    """Key splits per decode entry (``split_count`` with the MLA constants; see ``TARGET_BLOCKS``;
    ``forced > 0``: that many, clamped to ``[1, nnz * ps]``)."""
    return split_count(B, nnz, ps, blocks_per_split, target_blocks=TARGET_BLOCKS, min_split_keys=MIN_SPLIT_KEYS,
                       max_splits=MAX_SPLITS, forced=forced)


# ---------------------------------------------------------------------------------------------------
# page movement
# ---------------------------------------------------------------------------------------------------
def mla_append_kv_cuda(spec):
    """``pagedkv_mla_append_kv`` (arguments: ``pagedkv.ops.OP_SPECS``) for a ``KernelSpec``: token ``s`` goes to page
    ``slot[s] // ps``, offset ``slot[s] % ps``; a negative slot skips the token.

    A thread moves one 16-byte chunk (``VEC`` elements) of one token: element reads of the view, one vector
    store to the page (consecutive threads own consecutive chunks, so a warp covers contiguous memory).
    """
    DL, dtype = shape_values(spec)["DL"], spec.dtype
    VEC = _page_vec(DL, dtype)
    C = DL // VEC

    @T.macro
    def body(pages, kv, slot, dims):
        _p, ps, n = dims
        for bx in T.thread_binding(T.max(ceildiv(n * C, PAGE_NT), 1), thread="blockIdx.x"):
            for tx in T.thread_binding(PAGE_NT, thread="threadIdx.x"):
                xr = T.alloc_buffer((VEC,), dtype, scope="local")
                if bx * PAGE_NT + tx < n * C:
                    s: T.let[T.int32] = T.truncdiv(bx * PAGE_NT + tx, C)
                    c: T.let[T.int32] = T.truncmod(bx * PAGE_NT + tx, C)
                    sl: T.let[T.int32] = slot[s]
                    if sl >= 0:
                        for e in T.serial(VEC):
                            xr[e] = kv[s, c * VEC + e]
                        for e in T.vectorized(VEC):
                            pages[T.truncdiv(sl, ps), 0, 0, T.truncmod(sl, ps), c * VEC + e] = xr[e]

    return abi_prim_func(MLA_APPEND_KV, shape_values(spec), dtype, body, scheduled=True)


def mla_gather_kv_cuda(spec):
    """``pagedkv_mla_gather_kv`` (arguments: ``pagedkv.ops.OP_SPECS``) for a ``KernelSpec``: ``kv[s]`` = the latent at
    ``slot[s]``; a negative slot leaves ``kv[s]`` unchanged (it would address no page)."""
    DL, dtype = shape_values(spec)["DL"], spec.dtype
    VEC = _page_vec(DL, dtype)
    C = DL // VEC

    @T.macro
    def body(pages, slot, kv, dims):
        _p, ps, n = dims
        for bx in T.thread_binding(T.max(ceildiv(n * C, PAGE_NT), 1), thread="blockIdx.x"):
            for tx in T.thread_binding(PAGE_NT, thread="threadIdx.x"):
                xr = T.alloc_buffer((VEC,), dtype, scope="local")
                if bx * PAGE_NT + tx < n * C:
                    s: T.let[T.int32] = T.truncdiv(bx * PAGE_NT + tx, C)
                    c: T.let[T.int32] = T.truncmod(bx * PAGE_NT + tx, C)
                    sl: T.let[T.int32] = slot[s]
                    if sl >= 0:
                        for e in T.vectorized(VEC):
                            xr[e] = pages[T.truncdiv(sl, ps), 0, 0, T.truncmod(sl, ps), c * VEC + e]
                        for e in T.serial(VEC):
                            kv[s, c * VEC + e] = xr[e]

    return abi_prim_func(MLA_GATHER_KV, shape_values(spec), dtype, body, scheduled=True)


def _page_vec(latent_dim: int, dtype: str) -> int:
    """Largest chunk (<= 16 bytes) that divides the latent."""
    v = vec16(dtype)
    while latent_dim % v:
        v //= 2
    return v


# ---------------------------------------------------------------------------------------------------
# attention entry points
# ---------------------------------------------------------------------------------------------------
#: The path switch of the paged MLA prefill's kernel (``pagedkv.kernel_spec.SWITCHES``).
PREFILL_SWITCH = "cuda_mla_prefill_kernel"


def prefill_kernel(spec) -> str:
    """The kernel of ``mla_attn_prefill_paged`` of ``spec``: the selection table's choice
    (``pagedkv.kernel_table.choose``: the forced ``PREFILL_SWITCH`` value, else the MLA decodes' order: wgq on
    sm_90a from 16 heads, tc where it serves, SIMT)."""
    return choose(MLA_ATTN_PREFILL_PAGED, spec).name


def mla_attn_prefill_paged_cuda(spec):
    """``pagedkv_mla_attn_prefill_paged`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``: a
    tensor-core kernel (``prefill_kernel``; its block once per query token and head group, ``_mla_frame_cuda``),
    or the SIMT one: one block per virtual row tile (``R`` = 16 rows, tokens x heads of one entry), over all its
    keys.
    """
    from . import mla_cuda_tc, mla_cuda_wgq  # pylint: disable=import-outside-toplevel

    kernel = prefill_kernel(spec)
    tensor_core = {"tc": mla_cuda_tc.mla_attn_paged_tc, "wgq": mla_cuda_wgq.mla_attn_paged_wgq}
    if kernel in tensor_core:  # each raises with its reasons where it does not serve the spec
        return tensor_core[kernel](spec, MLA_ATTN_PREFILL_PAGED)
    H, DV, DL, dtype = spec.num_qo_heads, spec.kv_lora_rank, spec.latent_dim, spec.dtype
    RI = rows_per_thread(MLA_ATTN_PREFILL_PAGED, spec.kv_lora_rank, spec.qk_rope_head_dim)
    R = TY * RI
    row_tile = make_row_tile(RowTilePlan(H, DL, DV, RI, dtype))

    def tiles_before(q_indptr, b):
        """Virtual tiles of the entries before ``b`` but their spare ones (``find_tile_entry``)."""
        return T.truncdiv(q_indptr[b] * H, R)

    @T.macro
    def body(q, q_indptr, pages, page_indptr, page_values, last_page_len, o, lse, causal, sm_scale, dims):
        n, B, _p, ps, _nnz = dims
        for vt in T.thread_binding(T.max(T.truncdiv(n * H, R) + B, 1), thread="blockIdx.x"):
            for tid in T.thread_binding(NT, thread="threadIdx.x"):
                srch = T.alloc_buffer((2,), "int32", scope="local")
                # Entry b: the last one whose first virtual tile q_indptr[b] * H // R + b is <= vt.
                find_tile_entry(srch, q_indptr, B, vt, tiles_before)
                b: T.let[T.int32] = srch[0]
                qlen: T.let[T.int32] = T.if_then_else(B > 0, q_indptr[T.min(b + 1, B)] - q_indptr[b], 0)
                tin: T.let[T.int32] = vt - (tiles_before(q_indptr, b) + b)
                ntiles: T.let[T.int32] = T.truncdiv(qlen * H + R - 1, R)
                active: T.let[T.bool] = tin >= 0 and tin < ntiles
                # Last row tile first (it sees the most keys under causal).
                row0: T.let[T.int32] = (ntiles - 1 - tin) * R
                kvlen: T.let[T.int32] = T.if_then_else(active, paged_kv_len(page_indptr, last_page_len, b, ps), 0)
                row_tile(q, o, lse, None, None, pages, page_values, page_indptr[b], ps, q_indptr[b], row0,
                         T.if_then_else(active, T.min(R, qlen * H - row0), 0), qlen, kvlen, causal, 0, kvlen,
                         1, 0, sm_scale, tid)

    return abi_prim_func(spec_op(MLA_ATTN_PREFILL_PAGED, spec), shape_values(spec), dtype, body, scheduled=True)


def mla_attn_decode_paged_cuda(spec):
    """``pagedkv_mla_attn_decode_paged`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``.

    One block per (entry, row tile of ``R`` heads, key split); with ``S > 1`` splits a second kernel merges
    the partial states. The path switch ``cuda_decode_splits = N > 0`` (``decode_splits``) forces ``S``
    (clamped to ``[1, nnz * ps]``); automatic: the kernel from before the switch. The path switch
    ``cuda_mla_decode_kernel`` and the selection table (``pagedkv.kernel_table``) choose the kernel: the wgmma
    one with Q in shared memory (``mla_cuda_wgq``; its PrimFunc runs ``mla_cuda_wg``'s kernel where TMA cannot
    read the pages) on sm_90a from 16 heads, the mma.sync one (``mla_cuda_tc``) where it serves, else this SIMT
    kernel.
    """
    from . import mla_cuda_tc, mla_cuda_wgq  # pylint: disable=import-outside-toplevel

    kernel = choose(MLA_ATTN_DECODE_PAGED, spec).name  # the selection table (raises where a forced one cannot)
    if kernel == "wgq":
        return mla_cuda_wgq.mla_attn_paged_wgq(spec)
    if kernel == "tc":
        return mla_cuda_tc.mla_attn_paged_tc(spec)
    H, DV, DL, dtype = spec.num_qo_heads, spec.kv_lora_rank, spec.latent_dim, spec.dtype
    splits = decode_splits(spec)
    RI = rows_per_thread(MLA_ATTN_DECODE_PAGED, spec.kv_lora_rank, spec.qk_rope_head_dim)
    R = TY * RI
    NRT = ceildiv(H, R)
    row_tile = make_row_tile(RowTilePlan(H, DL, DV, RI, dtype))

    merge_splits = make_merge_splits(H, DV, MERGE_NT, dtype)

    @T.macro
    def body(q, pages, page_indptr, page_values, last_page_len, o, lse, sm_scale, dims):
        B, _p, ps, nnz = dims
        S: T.let[T.int32] = _split_count(B, nnz, ps, NRT, splits)
        # Split partial states (float32); only touched when S > 1.
        ws_o = T.alloc_buffer((T.max(B, 1) * H * S, DV), "float32")
        ws_l = T.alloc_buffer((T.max(B, 1) * H * S,), "float32")
        for bx in T.thread_binding(T.max(B, 1), thread="blockIdx.x"):
            for ry in T.thread_binding(NRT, thread="blockIdx.y"):
                for sp in T.thread_binding(S, thread="blockIdx.z"):
                    for tid in T.thread_binding(NT, thread="threadIdx.x"):
                        # B == 0 launches one idle block (nrows = 0; it reads page_indptr[0] only).
                        kvlen: T.let[T.int32] = T.if_then_else(
                            bx < B, paged_kv_len(page_indptr, last_page_len, bx, ps), 0)
                        # This split's keys: [k0, k1), chunks a multiple of the key tile.
                        Sk: T.let[T.int32] = opaque_i32(S)  # the split count, opaque in the kernel
                        chunk: T.let[T.int32] = T.truncdiv(T.truncdiv(kvlen + Sk - 1, Sk) + TK - 1, TK) * TK
                        k0: T.let[T.int32] = T.min(sp * chunk, kvlen)
                        row_tile(q, o, lse, ws_o, ws_l, pages, page_values, page_indptr[bx], ps, bx, ry * R,
                                 T.if_then_else(bx < B, T.min(R, H - ry * R), 0), 1, kvlen, 0, k0,
                                 T.min(k0 + chunk, kvlen), Sk, sp, sm_scale, tid)
        if S > 1:
            merge_splits(o, lse, B, S, ws_o, ws_l)

    return abi_prim_func(spec_op(MLA_ATTN_DECODE_PAGED, spec), shape_values(spec), dtype, body, scheduled=True)
