"""``empty_rows``: the empty attention state for library backends whose kernels write another one.

Not an op of the vocabulary: the FlashInfer backend puts it into its op-table entries (``src/flashinfer_adapter.cc``).
FlashInfer writes ``o = 0`` but ``lse = -inf`` for a row with no keys, where pagedkv's ABI wants the finite
``-1e30`` (so ``merge_state`` never computes ``inf - inf``).

``pagedkv_empty_rows(o[n, H, Dv], lse[n, H], fill: i32)``, ``n``, ``H`` and ``Dv`` symbolic:

* ``fill != 0``: every row gets the empty state, ``o = 0`` and ``lse = -1e30`` (a call whose entries all have
  no keys; the library kernel is not called at all);
* ``fill == 0``: ``lse = -1e30`` where ``lse < -1e30`` (``-inf`` included), every other value (NaN included)
  unchanged; ``o`` is not touched (after a library call in which some entries have no keys).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._common import EMPTY_LSE
from ._common_cuda import WARP, ceildiv

#: Rows (warps) per block of the CUDA kernel.
ROWS = 8


def empty_rows_cpu(dtype):
    @T.prim_func
    def empty_rows(o_h: T.handle, lse_h: T.handle, fill: T.int32):
        T.func_attr({"global_symbol": "pagedkv_empty_rows", "tirx.noalias": True})
        n, H, DV = T.int32(), T.int32(), T.int32()
        o = T.match_buffer(o_h, (n, H, DV), dtype, elem_offset=T.int32())
        lse = T.match_buffer(lse_h, (n, H), "float32", elem_offset=T.int32())
        for s in T.parallel(n):
            for h in T.serial(H):
                if fill != 0:
                    for d in T.serial(DV):
                        o[s, h, d] = T.Cast(dtype, 0)
                    lse[s, h] = T.float32(EMPTY_LSE)
                elif lse[s, h] < T.float32(EMPTY_LSE):
                    lse[s, h] = T.float32(EMPTY_LSE)

    return empty_rows


def empty_rows_cuda(dtype):
    """One warp per (token, head) row; lane ``l`` writes elements ``l, l + 32, ...`` of ``o``."""

    @T.prim_func
    def empty_rows(o_h: T.handle, lse_h: T.handle, fill: T.int32):
        T.func_attr({"global_symbol": "pagedkv_empty_rows", "tirx.noalias": True, "tirx.is_scheduled": True})
        n, H, DV = T.int32(), T.int32(), T.int32()
        o = T.match_buffer(o_h, (n, H, DV), dtype, elem_offset=T.int32())
        lse = T.match_buffer(lse_h, (n, H), "float32", elem_offset=T.int32())
        for bx in T.thread_binding(T.max(ceildiv(n * H, ROWS), 1), thread="blockIdx.x"):
            for ty in T.thread_binding(ROWS, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    if bx * ROWS + ty < n * H:
                        if fill != 0:
                            for c in T.serial(ceildiv(DV, WARP)):
                                if c * WARP + tx < DV:
                                    o[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H),
                                      c * WARP + tx] = T.Cast(dtype, 0)
                            if tx == 0:
                                lse[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H)] = \
                                    T.float32(EMPTY_LSE)
                        elif tx == 0:
                            if lse[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H)] < \
                                    T.float32(EMPTY_LSE):
                                lse[T.truncdiv(bx * ROWS + ty, H), T.truncmod(bx * ROWS + ty, H)] = \
                                    T.float32(EMPTY_LSE)

    return empty_rows
