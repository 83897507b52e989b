"""The grid of the tensor-core CUDA MLA decodes (``mla_cuda_tc``, ``mla_cuda_wg``): one block per (head group,
entry, key split), the split count, the float32 workspace of partial states and the merge of the splits.

Split policy (``_common_cuda.wave_split_count``): one block an SM resident (shared memory), an H200's 132 SMs,
splits of at least 256 keys, at most 64; the runtime's ``max_kv_len`` bounds it. Head groups are innermost
(``blockIdx.x``): the groups of an entry run side by side and share its latent rows through L2 (one DRAM read
instead of one per group at 128 heads). Split ``sp`` of an entry of ``kvlen`` keys reads keys ``[k0, k1)``,
tile-aligned chunks of ``ceil(kvlen / S)``; ``S > 1`` writes partial states that the merge kernel combines.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._common_cuda import make_merge_splits, opaque_i32, paged_kv_len, wave_split_count

#: Split policy: blocks resident at once (one an SM of an H200), keys a split at least, splits at most.
RESIDENT_BLOCKS = 132
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 64
#: Threads a block of the merge kernel.
MERGE_NT = 128


def make_split_frame(*, heads: int, dv: int, groups: int, threads: int, tk: int, dtype: str, splits: int, block):
    """The body macro of an MLA decode PrimFunc (``abi_prim_func``'s arguments) around ``block``, the kernel's
    per-thread code, called as ``block(q, pages, page_values, o, lse, ws, sm_scale, ps, at, n, keys)`` with
    ``ws`` = (ws_o ``[B H S, dv]``, ws_l ``[B H S]``), ``at`` = (entry, head group, split, thread), ``n`` = (B,
    S), ``keys`` = (k0, k1, the entry's first page slot); an idle block (B = 0, or past an entry's keys) gets
    ``k0 == k1``. ``tk``: keys a tile (the splits' granularity); ``splits``: forced count (0 = automatic)."""
    merge_splits = make_merge_splits(heads, dv, MERGE_NT, dtype)

    @T.macro
    def body(q, pages, page_indptr, page_values, last_page_len, o, lse, sm_scale, max_kv_len, dims):
        B, _p, ps, nnz = dims
        S: T.let[T.int32] = wave_split_count(B, nnz, ps, groups, resident_blocks=RESIDENT_BLOCKS,
                                             min_split_keys=MIN_SPLIT_KEYS, max_splits=MAX_SPLITS, forced=splits,
                                             max_keys=max_kv_len)
        ws_o = T.alloc_buffer((T.max(B, 1) * heads * S, dv), "float32")
        ws_l = T.alloc_buffer((T.max(B, 1) * heads * S,), "float32")
        for bx in T.thread_binding(T.max(B, 1), thread="blockIdx.y"):
            for g in T.thread_binding(groups, thread="blockIdx.x"):
                for sp in T.thread_binding(S, thread="blockIdx.z"):
                    for tid in T.thread_binding(threads, thread="threadIdx.x"):
                        kvlen: T.let[T.int32] = T.if_then_else(bx < B, paged_kv_len(page_indptr, last_page_len, bx,
                                                                                      ps), 0)
                        Sk: T.let[T.int32] = opaque_i32(S)  # the split count, opaque in the kernel
                        chunk: T.let[T.int32] = T.truncdiv(T.truncdiv(kvlen + Sk - 1, Sk) + tk - 1, tk) * tk
                        k0: T.let[T.int32] = T.min(sp * chunk, kvlen)
                        k1: T.let[T.int32] = T.min(k0 + chunk, kvlen)
                        pbase: T.let[T.int32] = page_indptr[T.min(bx, T.max(B - 1, 0))]
                        block(q, pages, page_values, o, lse, (ws_o, ws_l), sm_scale, ps, (bx, g, sp, tid), (B, Sk),
                              (k0, k1, pbase))
        if S > 1:
            merge_splits(o, lse, B, S, ws_o, ws_l)

    return body


__all__ = ["MAX_SPLITS", "MERGE_NT", "MIN_SPLIT_KEYS", "RESIDENT_BLOCKS", "make_split_frame"]
