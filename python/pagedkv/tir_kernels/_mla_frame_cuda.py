"""The grids of the tensor-core CUDA MLA kernels (``mla_cuda_tc``, ``mla_cuda_wg``, ``mla_cuda_wgq``): the decode's one
block per (head group, entry, key split), the paged prefill's one per (head group, query token, key split), the
split count, the float32 workspace of partial states and the merge of the splits. The kernels' block code is one
macro for both ops: a block is the heads of one query token over a key range.

Split policy (``_common_cuda.wave_split_count``): one block an SM resident (shared memory), an H200's 132 SMs,
splits of at least 256 keys, at most 64; the runtime's ``max_kv_len`` bounds it. Head groups are innermost
(``blockIdx.x``): the groups of an entry run side by side and share its latent rows through L2 (one DRAM read
instead of one per group at 128 heads). Split ``sp`` of an entry of ``kvlen`` keys reads keys ``[k0, k1)``,
tile-aligned chunks of ``ceil(kvlen / S)``; ``S > 1`` writes partial states that the merge kernel combines.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..ops import MLA_ATTN_DECODE_PAGED, MLA_ATTN_PREFILL_PAGED, shape_values
from ._abi import abi_prim_func, spec_op
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


def make_prefill_frame(*, heads: int, dv: int, groups: int, threads: int, tk: int, dtype: str, splits: int, block):
    """The body macro of an ``mla_attn_prefill_paged`` PrimFunc around ``block`` (``make_split_frame``'s, called
    the same way with ``at`` = (query token, head group, split, thread) and ``n`` = (tokens, S)): each query token
    of an entry is a decode row set over the entry's pages, bottom-right causal when ``causal != 0`` (token ``i``
    of ``qlen`` sees keys ``[0, kvlen - qlen + i + 1)``).

    Why one token a block: the kernels' rows are the heads that share each latent row they load (16 .. 128), which
    already fill the tensor cores' m dimension; the tokens of an entry run in neighbouring blocks and share its
    latents through L2. Tokens are launched last first (under ``causal`` they see the most keys). Splits: as the
    decode's rule with the tokens as entries and an entry's average keys (no ``max_kv_len``: the runtime passes
    it to decodes only); the workspace is one element where ``S = 1`` (a prefill of many tokens)."""
    merge_splits = make_merge_splits(heads, dv, MERGE_NT, dtype)

    @T.macro
    def body(q, q_indptr, pages, page_indptr, page_values, last_page_len, o, lse, causal, sm_scale, dims):
        # Entries nb (not B: the blocks bind the token count to that name, and two vars of one name confuse
        # readers of the host code).
        n, nb, _p, ps, nnz = dims
        S: T.let[T.int32] = wave_split_count(n, nnz, ps, groups, resident_blocks=RESIDENT_BLOCKS,
                                             min_split_keys=MIN_SPLIT_KEYS, max_splits=MAX_SPLITS, forced=splits,
                                             entries=nb)
        wsn: T.let[T.int32] = T.if_then_else(S > 1, n * heads * S, 1)
        ws_o = T.alloc_buffer((wsn, dv), "float32")
        ws_l = T.alloc_buffer((wsn,), "float32")
        for ty in T.thread_binding(T.max(n, 1), thread="blockIdx.y"):
            for g in T.thread_binding(groups, thread="blockIdx.x"):
                for sp in T.thread_binding(S, thread="blockIdx.z"):
                    for tid in T.thread_binding(threads, thread="threadIdx.x"):
                        # n == 0: one idle block (t == n: no keys, no stores; reads q_indptr[0], page_indptr[0]).
                        t: T.let[T.int32] = T.max(n, 1) - 1 - ty
                        # The token's entry: the last b < nb with q_indptr[b] <= t (a binary search every
                        # thread runs: a few global loads of nb + 1 offsets).
                        lo = T.alloc_buffer((2,), "int32", scope="local")
                        lo[0] = 0
                        lo[1] = T.max(nb, 1)
                        while lo[1] - lo[0] > 1:
                            if q_indptr[T.truncdiv(lo[0] + lo[1], 2)] <= t:
                                lo[0] = T.truncdiv(lo[0] + lo[1], 2)
                            else:
                                lo[1] = T.truncdiv(lo[0] + lo[1], 2)
                        b: T.let[T.int32] = lo[0]
                        kvlen: T.let[T.int32] = T.if_then_else(t < n, paged_kv_len(page_indptr, last_page_len, b, ps),
                                                               0)
                        # Token i of the entry's qlen sees kvlen - qlen + i + 1 keys under causal (none below 0).
                        seen: T.let[T.int32] = T.if_then_else(causal != 0, T.min(T.max(
                            kvlen - (q_indptr[T.min(b + 1, nb)] - t) + 1, 0), kvlen), kvlen)
                        Sk: T.let[T.int32] = opaque_i32(S)  # the split count, opaque in the kernel
                        chunk: T.let[T.int32] = T.truncdiv(T.truncdiv(seen + Sk - 1, Sk) + tk - 1, tk) * tk
                        k0: T.let[T.int32] = T.min(sp * chunk, seen)
                        block(q, pages, page_values, o, lse, (ws_o, ws_l), sm_scale, ps, (t, g, sp, tid),
                              (n, Sk), (k0, T.min(k0 + chunk, seen), page_indptr[b]))
        if S > 1:
            merge_splits(o, lse, n, S, ws_o, ws_l)

    return body


#: The path switch that picks the kernel of each MLA attention op (``pagedkv.kernel_spec.SWITCHES``).
SWITCHES = {MLA_ATTN_DECODE_PAGED: "cuda_mla_decode_kernel", MLA_ATTN_PREFILL_PAGED: "cuda_mla_prefill_kernel"}


def make_frame(op: str, spec, block, *, groups: int, threads: int, tk: int, splits: int):
    """The body macro of MLA attention op ``op`` of ``spec`` (decode: ``make_split_frame``, paged prefill:
    ``make_prefill_frame``) around ``block``."""
    if op not in (MLA_ATTN_DECODE_PAGED, MLA_ATTN_PREFILL_PAGED):
        raise ValueError(f"not an MLA attention op: {op!r}")
    make = make_split_frame if op == MLA_ATTN_DECODE_PAGED else make_prefill_frame
    return make(heads=spec.num_qo_heads, dv=spec.kv_lora_rank, groups=groups, threads=threads, tk=tk,
                dtype=spec.dtype, splits=splits, block=block)


def mla_prim_func(op: str, spec, body, *, any_align: tuple[str, ...] = ()):
    """The PrimFunc of MLA attention op ``op`` whose body macro is ``body`` (``make_frame``'s, or host code around
    frames, e.g. ``mla_cuda_wg.make_tma_body``'s); the decode takes the runtime's ``max_kv_len``."""
    return abi_prim_func(spec_op(op, spec), shape_values(spec), spec.dtype, body, scheduled=True,
                         adapter="direct_max_kv_len" if op == MLA_ATTN_DECODE_PAGED else "direct",
                         any_align=any_align)


__all__ = ["MAX_SPLITS", "MERGE_NT", "MIN_SPLIT_KEYS", "RESIDENT_BLOCKS", "SWITCHES", "make_frame", "make_prefill_frame", "make_split_frame",
           "mla_prim_func"]
