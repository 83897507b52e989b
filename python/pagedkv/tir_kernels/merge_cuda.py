"""``merge_state`` for CUDA: merge two attention states (o, lse) in place into the first; ``merge_state_partial``:
the same on float32 states, also writing the merged o rounded to the storage dtype (``merge.py``).

Same ABI and semantics as ``merge.py`` (CPU): with base-2 lse, ``m = max(lse_a, lse_b)``,
``wa = 2^(lse_a - m)``, ``wb = 2^(lse_b - m)``, ``o_a <- (o_a wa + o_b wb) / (wa + wb)``,
``lse_a <- m + log2(wa + wb)``; merging with the empty state (o = 0, lse = -1e30) gives it weight 0.

Blocks of 8 warps, one warp per (token, head) row: lane ``l`` handles elements ``l, l + 32, ...`` of the
row (coalesced). All lanes read both lse values, a block barrier follows, and only then lane 0 writes
``lse_a`` (so no lane reads an already-updated lse).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..ops import MERGE_STATE, MERGE_STATE_PARTIAL, shape_values
from ._abi import abi_prim_func
from ._common_cuda import WARP, ceildiv

#: Rows (warps) per block.
ROWS = 8


def merge_state_cuda(spec):
    """``pagedkv_merge_state`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``; the
    value dim ``dv`` is symbolic (see ``merge.py``)."""
    H, dtype = spec.num_qo_heads, spec.dtype

    @T.macro
    def body(o_a, lse_a, o_b, lse_b, dims):
        n, DV = dims
        for bx in T.thread_binding(T.max(ceildiv(n * H, ROWS), 1), thread="blockIdx.x"):
            for ty in T.thread_binding(ROWS, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    st = T.alloc_buffer((3,), "float32", scope="local")
                    if bx * ROWS + ty < n * H:
                        la: T.let[T.float32] = lse_a[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H)]
                        lb: T.let[T.float32] = lse_b[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H)]
                        st[0] = T.max(la, lb)
                        st[1] = T.exp2(la - T.max(la, lb))
                        st[2] = T.exp2(lb - T.max(la, lb))
                        for c in T.serial(ceildiv(DV, WARP)):
                            if c * WARP + tx < DV:
                                o_a[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H), c * WARP + tx] = \
                                    T.Cast(dtype, (T.Cast("float32", o_a[T.truncdiv(bx * ROWS + ty, H),
                                                                         T.truncmod(bx * ROWS + ty, H), c * WARP + tx])
                                                   * st[1]
                                                   + T.Cast("float32", o_b[T.truncdiv(bx * ROWS + ty, H),
                                                                           T.truncmod(bx * ROWS + ty, H), c * WARP + tx])
                                                   * st[2]) / (st[1] + st[2]))
                    # Every lane has read lse_a before lane 0 overwrites it.
                    T.tvm_storage_sync("shared")
                    if bx * ROWS + ty < n * H and tx == 0:
                        lse_a[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H)] = \
                            st[0] + T.log2(st[1] + st[2])

    return abi_prim_func(MERGE_STATE, shape_values(spec), dtype, body, scheduled=True)


def merge_state_partial_cuda(spec):
    """``pagedkv_merge_state_partial`` for CUDA: ``merge_state_cuda``'s blocks on float32 states ``o_a`` / ``o_b``,
    the merged row kept in ``o_a`` (float32) and written rounded to the storage dtype into ``o`` (see
    ``merge.merge_state_partial_cpu``)."""
    H, dtype = spec.num_qo_heads, spec.dtype

    @T.macro
    def body(o_a, lse_a, o_b, lse_b, o, dims):
        n, DV = dims
        for bx in T.thread_binding(T.max(ceildiv(n * H, ROWS), 1), thread="blockIdx.x"):
            for ty in T.thread_binding(ROWS, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    st = T.alloc_buffer((4,), "float32", scope="local")
                    if bx * ROWS + ty < n * H:
                        tok: T.let[T.int32] = T.truncdiv(bx * ROWS + ty, H)
                        hd: T.let[T.int32] = T.truncmod(bx * ROWS + ty, H)
                        st[0] = T.max(lse_a[tok, hd], lse_b[tok, hd])
                        st[1] = T.exp2(lse_a[tok, hd] - st[0])
                        st[2] = T.exp2(lse_b[tok, hd] - st[0])
                        for c in T.serial(ceildiv(DV, WARP)):
                            if c * WARP + tx < DV:
                                st[3] = (o_a[tok, hd, c * WARP + tx] * st[1] + o_b[tok, hd, c * WARP + tx] * st[2]) \
                                    / (st[1] + st[2])
                                o_a[tok, hd, c * WARP + tx] = st[3]
                                o[tok, hd, c * WARP + tx] = T.Cast(dtype, st[3])
                    # Every lane has read lse_a before lane 0 overwrites it.
                    T.tvm_storage_sync("shared")
                    if bx * ROWS + ty < n * H and tx == 0:
                        lse_a[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H)] = \
                            st[0] + T.log2(st[1] + st[2])

    return abi_prim_func(MERGE_STATE_PARTIAL, shape_values(spec), dtype, body, scheduled=True)
