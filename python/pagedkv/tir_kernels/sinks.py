"""The attention-sink ops (``pagedkv.ops.SINK_OPS``) on the CPU: ``apply_sinks`` merges each row's state in place
with its head's sink; ``merge_state_partial_sinks`` is ``merge_state_partial`` (``merge.py``) with the sink merged
in the same step, before ``o`` is rounded (the last merge of a multi-pass forward).

A sink is one more softmax logit per query head whose value is 0: ``sinks[h]`` in natural log, beside the scaled
scores (gpt-oss; FlashInfer's AttentionSink). In base 2 it is the state ``(o = 0, lse = sk)`` with
``sk = sinks[h] * log2(e)``, and merging it is a three-way (or two-way) merge of base-2 states: with
``m = max(lse_a, lse_b, sk)`` and ``w_x = 2^(lse_x - m)``, ``o <- (o_a w_a + o_b w_b) / (w_a + w_b + w_s)`` and
``lse <- m + log2(w_a + w_b + w_s)``. The empty state (``o = 0``, ``lse = -1e30``) gets weight 0, so a row
without keys becomes ``o = 0``, ``lse = sk``; a NaN in ``lse`` makes its weight NaN, so ``o`` and ``lse`` stay
NaN whatever ``max`` picks (NaN propagates, as through ``merge_state``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..ops import APPLY_SINKS, MERGE_STATE_PARTIAL_SINKS, shape_values
from ._abi import abi_prim_func
from ._common import LOG2E


def apply_sinks_cpu(spec):
    """``pagedkv_apply_sinks(o[n,H,dv], lse[n,H], sinks[H])``, in place; parallel over rows. ``dv`` is symbolic (an
    MLA cross attention's state is at ``kv_lora_rank``)."""
    H, dtype = spec.num_qo_heads, spec.dtype

    @T.macro
    def body(o, lse, sinks, dims):
        n, dv = dims
        for s in T.parallel(n):
            for h in T.serial(H):
                sk: T.let[T.float32] = sinks[h] * T.float32(LOG2E)
                mx: T.let[T.float32] = T.max(lse[s, h], sk)
                wa: T.let[T.float32] = T.exp2(lse[s, h] - mx)
                ws: T.let[T.float32] = T.exp2(sk - mx)
                for d in T.serial(dv):
                    o[s, h, d] = T.Cast(dtype, T.Cast("float32", o[s, h, d]) * wa / (wa + ws))
                lse[s, h] = mx + T.log2(wa + ws)

    return abi_prim_func(APPLY_SINKS, shape_values(spec), dtype, body)


def merge_state_partial_sinks_cpu(spec):
    """``pagedkv_merge_state_partial_sinks(o_a[n,H,dv]:f32, lse_a[n,H], o_b[n,H,dv]:f32, lse_b[n,H], sinks[H],
    o[n,H,dv])``: ``(o_a, lse_a)`` <- the merge of both states and the sink, in float32; ``o`` <- it rounded to
    the storage dtype. Parallel over rows."""
    H, dtype = spec.num_qo_heads, spec.dtype

    @T.macro
    def body(o_a, lse_a, o_b, lse_b, sinks, o, dims):
        n, dv = dims
        for s in T.parallel(n):
            for h in T.serial(H):
                sk: T.let[T.float32] = sinks[h] * T.float32(LOG2E)
                mx: T.let[T.float32] = T.max(T.max(lse_a[s, h], lse_b[s, h]), sk)
                wa: T.let[T.float32] = T.exp2(lse_a[s, h] - mx)
                wb: T.let[T.float32] = T.exp2(lse_b[s, h] - mx)
                total: T.let[T.float32] = wa + wb + T.exp2(sk - mx)
                for d in T.serial(dv):
                    o_a[s, h, d] = (o_a[s, h, d] * wa + o_b[s, h, d] * wb) / total
                    o[s, h, d] = T.Cast(dtype, o_a[s, h, d])
                lse_a[s, h] = mx + T.log2(total)

    return abi_prim_func(MERGE_STATE_PARTIAL_SINKS, shape_values(spec), dtype, body)
