"""``merge_state`` for CUDA: merge two attention states (o, lse) in place into the first.

Same ABI and semantics as ``merge.py`` (CPU): with base-2 lse, ``m = max(lse_a, lse_b)``,
``wa = 2^(lse_a - m)``, ``wb = 2^(lse_b - m)``, ``o_a <- (o_a wa + o_b wb) / (wa + wb)``,
``lse_a <- m + log2(wa + wb)``; merging with the empty state (o = 0, lse = -1e30) gives it weight 0.

Blocks of 8 warps, one warp per (token, head) row: lane ``l`` handles elements ``l, l + 32, ...`` of the
row (coalesced). All lanes read both lse values, a block barrier follows, and only then lane 0 writes
``lse_a`` (so no lane reads an already-updated lse).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._common_cuda import WARP, ceildiv

#: Rows (warps) per block.
ROWS = 8


def merge_state_cuda(num_heads, dtype):
    """``pagedkv_merge_state(o_a[n,H,Dv], lse_a[n,H], o_b[n,H,Dv], lse_b[n,H])``; ``Dv`` is symbolic (see
    ``merge.py``)."""
    H = num_heads

    @T.prim_func
    def merge_state(o_a_h: T.handle, lse_a_h: T.handle, o_b_h: T.handle, lse_b_h: T.handle):
        T.func_attr({"global_symbol": "pagedkv_merge_state", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        n, DV = T.int32(), T.int32()
        o_a = T.match_buffer(o_a_h, (n, H, DV), dtype, elem_offset=T.int32())
        lse_a = T.match_buffer(lse_a_h, (n, H), "float32", elem_offset=T.int32())
        o_b = T.match_buffer(o_b_h, (n, H, DV), dtype, elem_offset=T.int32())
        lse_b = T.match_buffer(lse_b_h, (n, H), "float32", elem_offset=T.int32())
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

    return merge_state
