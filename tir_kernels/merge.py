"""``merge_state``: merge two attention states (o, lse) in place into the first (CPU).

With base-2 lse, ``m = max(lse_a, lse_b)``, ``wa = 2^(lse_a - m)``, ``wb = 2^(lse_b - m)``:
``o_a <- (o_a wa + o_b wb) / (wa + wb)`` and ``lse_a <- m + log2(wa + wb)``. The empty state
(o = 0, lse = -1e30) is finite, so merging with it gives weight 0 and never ``inf - inf``; merging two
empty states keeps o = 0 and lse = -1e30 (-1e30 + 1 rounds back to -1e30 in float32).
"""

from __future__ import annotations

from tvm.script import tirx as T


def merge_state_cpu(num_heads, dtype):
    """``pagedkv_merge_state(o_a[n,H,Dv], lse_a[n,H], o_b[n,H,Dv], lse_b[n,H])``; parallel over rows.

    ``Dv`` is symbolic: one kernel merges the self/cross states a model sees (``v_head_dim``) and the
    runtime's per-pass states (MLA: ``kv_lora_rank``).
    """
    H = num_heads

    @T.prim_func
    def merge_state(o_a_h: T.handle, lse_a_h: T.handle, o_b_h: T.handle, lse_b_h: T.handle):
        T.func_attr({"global_symbol": "pagedkv_merge_state", "tirx.noalias": True})
        n, DV = T.int32(), T.int32()
        o_a = T.match_buffer(o_a_h, (n, H, DV), dtype, elem_offset=T.int32())
        lse_a = T.match_buffer(lse_a_h, (n, H), "float32", elem_offset=T.int32())
        o_b = T.match_buffer(o_b_h, (n, H, DV), dtype, elem_offset=T.int32())
        lse_b = T.match_buffer(lse_b_h, (n, H), "float32", elem_offset=T.int32())
        for s in T.parallel(n):
            for h in T.serial(H):
                mx: T.let[T.float32] = T.max(lse_a[s, h], lse_b[s, h])
                wa: T.let[T.float32] = T.exp2(lse_a[s, h] - mx)
                wb: T.let[T.float32] = T.exp2(lse_b[s, h] - mx)
                for d in T.serial(DV):  # symbolic extent; LLVM's loop vectorizer takes it
                    o_a[s, h, d] = T.Cast(dtype, (T.Cast("float32", o_a[s, h, d]) * wa
                                                  + T.Cast("float32", o_b[s, h, d]) * wb) / (wa + wb))
                lse_a[s, h] = mx + T.log2(wa + wb)

    return merge_state
