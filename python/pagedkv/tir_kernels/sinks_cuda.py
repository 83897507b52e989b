"""The attention-sink ops (``pagedkv.ops.SINK_OPS``) for CUDA: same ABI and math as ``sinks.py`` (CPU), on the
blocks of ``merge_cuda.py``: 8 warps a block, one warp per (token, head) row, lane ``l`` on elements
``l, l + 32, ...`` of the row (coalesced). Every lane reads the row's lse values and the sink, a block barrier
follows, and only then lane 0 writes the row's new lse (no lane reads an updated one).

Per layer this is the one elementwise kernel a forward with sinks adds (``apply_sinks`` after a single state),
or none (``merge_state_partial_sinks`` replaces the last ``merge_state_partial`` of a multi-pass forward).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..ops import APPLY_SINKS, MERGE_STATE_PARTIAL_SINKS, shape_values
from ._abi import abi_prim_func
from ._common import LOG2E
from ._common_cuda import WARP, ceildiv

#: Rows (warps) per block.
ROWS = 8


def apply_sinks_cuda(spec):
    """``pagedkv_apply_sinks`` for CUDA (``sinks.apply_sinks_cpu``); ``dv`` symbolic."""
    H, dtype = spec.num_qo_heads, spec.dtype

    @T.macro
    def body(o, lse, sinks, dims):
        n, DV = dims
        for bx in T.thread_binding(T.max(ceildiv(n * H, ROWS), 1), thread="blockIdx.x"):
            for ty in T.thread_binding(ROWS, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    st = T.alloc_buffer((3,), "float32", scope="local")  # max, state weight, sink weight
                    if bx * ROWS + ty < n * H:
                        tok: T.let[T.int32] = T.truncdiv(bx * ROWS + ty, H)
                        hd: T.let[T.int32] = T.truncmod(bx * ROWS + ty, H)
                        st[0] = T.max(lse[tok, hd], sinks[hd] * T.float32(LOG2E))
                        st[1] = T.exp2(lse[tok, hd] - st[0])
                        st[2] = T.exp2(sinks[hd] * T.float32(LOG2E) - st[0])
                        for c in T.serial(ceildiv(DV, WARP)):
                            if c * WARP + tx < DV:
                                o[tok, hd, c * WARP + tx] = T.Cast(
                                    dtype, T.Cast("float32", o[tok, hd, c * WARP + tx]) * st[1] / (st[1] + st[2]))
                    # Every lane has read lse before lane 0 overwrites it.
                    T.tvm_storage_sync("shared")
                    if bx * ROWS + ty < n * H and tx == 0:
                        lse[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H)] = st[0] + T.log2(st[1] + st[2])

    return abi_prim_func(APPLY_SINKS, shape_values(spec), dtype, body, scheduled=True)


def merge_state_partial_sinks_cuda(spec):
    """``pagedkv_merge_state_partial_sinks`` for CUDA (``sinks.merge_state_partial_sinks_cpu``): the merged row
    with the sink kept in ``o_a`` (float32) and written rounded to the storage dtype into ``o``."""
    H, dtype = spec.num_qo_heads, spec.dtype

    @T.macro
    def body(o_a, lse_a, o_b, lse_b, sinks, o, dims):
        n, DV = dims
        for bx in T.thread_binding(T.max(ceildiv(n * H, ROWS), 1), thread="blockIdx.x"):
            for ty in T.thread_binding(ROWS, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    st = T.alloc_buffer((5,), "float32", scope="local")  # max, weights a / b, total, element
                    if bx * ROWS + ty < n * H:
                        tok: T.let[T.int32] = T.truncdiv(bx * ROWS + ty, H)
                        hd: T.let[T.int32] = T.truncmod(bx * ROWS + ty, H)
                        st[0] = T.max(T.max(lse_a[tok, hd], lse_b[tok, hd]), sinks[hd] * T.float32(LOG2E))
                        st[1] = T.exp2(lse_a[tok, hd] - st[0])
                        st[2] = T.exp2(lse_b[tok, hd] - st[0])
                        st[3] = st[1] + st[2] + T.exp2(sinks[hd] * T.float32(LOG2E) - st[0])
                        for c in T.serial(ceildiv(DV, WARP)):
                            if c * WARP + tx < DV:
                                st[4] = (o_a[tok, hd, c * WARP + tx] * st[1] + o_b[tok, hd, c * WARP + tx] * st[2]) \
                                    / st[3]
                                o_a[tok, hd, c * WARP + tx] = st[4]
                                o[tok, hd, c * WARP + tx] = T.Cast(dtype, st[4])
                    # Every lane has read lse_a before lane 0 overwrites it.
                    T.tvm_storage_sync("shared")
                    if bx * ROWS + ty < n * H and tx == 0:
                        lse_a[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H)] = st[0] + T.log2(st[3])

    return abi_prim_func(MERGE_STATE_PARTIAL_SINKS, shape_values(spec), dtype, body, scheduled=True)
