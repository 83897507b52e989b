"""``merge_state``: merge two attention states (o, lse) in place into the first (CPU); ``merge_state_partial``:
the same on float32 states, also writing the merged o rounded to the storage dtype.

With base-2 lse, ``m = max(lse_a, lse_b)``, ``wa = 2^(lse_a - m)``, ``wb = 2^(lse_b - m)``:
``o_a <- (o_a wa + o_b wb) / (wa + wb)`` and ``lse_a <- m + log2(wa + wb)``. The empty state
(o = 0, lse = -1e30) is finite, so merging with it gives weight 0 and never ``inf - inf``; merging two
empty states keeps o = 0 and lse = -1e30 (-1e30 + 1 rounds back to -1e30 in float32). A NaN state (lse NaN: a NaN
in what its rows attend to, issue 44) merged with any state, the empty one included, is NaN: whichever lse the
max keeps, ``exp2`` of the NaN one's difference is NaN, in ``o`` and ``lse``; the merges need no test for it.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._abi import abi_prim_func
from ..ops import MERGE_STATE_PARTIAL, shape_values


def merge_state_cpu(spec):
    """``pagedkv_merge_state(o_a[n,H,dv], lse_a[n,H], o_b[n,H,dv], lse_b[n,H])``; parallel over rows.

    ``dv`` is symbolic: one kernel merges the self/cross states a model sees (``v_head_dim``) and the
    runtime's per-pass states (MLA: ``kv_lora_rank``).
    """
    H, dtype = spec.num_qo_heads, spec.dtype

    @T.macro
    def body(o_a, lse_a, o_b, lse_b, dims):
        n, dv = dims
        for s in T.parallel(n):
            for h in T.serial(H):
                mx: T.let[T.float32] = T.max(lse_a[s, h], lse_b[s, h])
                wa: T.let[T.float32] = T.exp2(lse_a[s, h] - mx)
                wb: T.let[T.float32] = T.exp2(lse_b[s, h] - mx)
                for d in T.serial(dv):  # symbolic extent; LLVM's loop vectorizer takes it
                    o_a[s, h, d] = T.Cast(dtype, (T.Cast("float32", o_a[s, h, d]) * wa
                                                  + T.Cast("float32", o_b[s, h, d]) * wb) / (wa + wb))
                lse_a[s, h] = mx + T.log2(wa + wb)

    return abi_prim_func("merge_state", shape_values(spec), dtype, body)


def merge_state_partial_cpu(spec):
    """``pagedkv_merge_state_partial(o_a[n,H,dv]:f32, lse_a[n,H], o_b[n,H,dv]:f32, lse_b[n,H], o[n,H,dv])``;
    parallel over rows.

    A multi-pass forward's passes write float32 states; each merge keeps the running state in float32
    (``o_a``, ``lse_a``: the next pass merges into it) and writes it rounded to the storage dtype into ``o``,
    so the last merge leaves the output rounded once (a storage-dtype merge rounds every pass's output and
    every merge). ``dv`` is symbolic, as in ``merge_state_cpu``.
    """
    H, dtype = spec.num_qo_heads, spec.dtype

    @T.macro
    def body(o_a, lse_a, o_b, lse_b, o, dims):
        n, dv = dims
        for s in T.parallel(n):
            for h in T.serial(H):
                mx: T.let[T.float32] = T.max(lse_a[s, h], lse_b[s, h])
                wa: T.let[T.float32] = T.exp2(lse_a[s, h] - mx)
                wb: T.let[T.float32] = T.exp2(lse_b[s, h] - mx)
                for d in T.serial(dv):
                    o_a[s, h, d] = (o_a[s, h, d] * wa + o_b[s, h, d] * wb) / (wa + wb)
                    o[s, h, d] = T.Cast(dtype, o_a[s, h, d])
                lse_a[s, h] = mx + T.log2(wa + wb)

    return abi_prim_func(MERGE_STATE_PARTIAL, shape_values(spec), dtype, body)
