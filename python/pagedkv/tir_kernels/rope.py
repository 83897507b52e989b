"""``split_rotary``: split fused qkv into q, k, v and optionally apply RoPE to q and k (CPU).

RoPE is the Llama / GPT-NeoX "rotate half" form over the whole head dim, computed in float32:
``angle = pos * rope_scale / rope_theta ** (2 i / D)``, ``x'[i] = x[i] cos - x[i + D/2] sin``,
``x'[i + D/2] = x[i + D/2] cos + x[i] sin``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._abi import abi_prim_func
from ._common import rope_angle
from ._math import cos_approx, sin_approx
from ._rope_table import freq_value, rope_on, scaled
from ..ops import shape_values


def split_rotary_cpu(spec):
    """``pagedkv_split_rotary`` of ``spec`` for the CPU; arguments from the op table.

    Signature (``docs/ARCHITECTURE.md``)::

        (qkv[n, Hq+2Hkv, D], q_pos[n], q[n,Hq,D], k[n,Hkv,D], v[n,Hkv,D],
         apply_rope:i32, rope_scale:f32, rope_theta:f32)

    One token per parallel iteration; its cos/sin table (D/2 entries, vectorized ``_math`` sin/cos, the
    same as the attention kernels' inline RoPE) is computed once and shared by all ``Hq + Hkv`` rotated
    heads. A RoPE variant (``spec.rope``) is ``_split_rotary_table``.
    """
    if spec.rope is not None:
        return _split_rotary_table(spec)
    HQ, HKV, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    HALF = D // 2

    @T.macro
    def rotate_head(dst, qkv, s, hd, hs, cs, sn):
        """``dst[s, hd] = rope(qkv[s, hs])`` with the token's cos/sin table."""
        for i in T.vectorized(HALF):
            dst[s, hd, i] = T.Cast(dtype, T.Cast("float32", qkv[s, hs, i]) * cs[i]
                                   - T.Cast("float32", qkv[s, hs, i + HALF]) * sn[i])
            dst[s, hd, i + HALF] = T.Cast(dtype, T.Cast("float32", qkv[s, hs, i + HALF]) * cs[i]
                                          + T.Cast("float32", qkv[s, hs, i]) * sn[i])

    @T.macro
    def body(qkv, q_pos, q, k, v, apply_rope, rope_scale, rope_theta, dims):
        (n,) = dims
        for s in T.parallel(n):
            cs = T.alloc_buffer((HALF,), "float32")
            sn = T.alloc_buffer((HALF,), "float32")
            if apply_rope == 1:
                for i in T.serial(HALF):
                    cs[i] = T.pow(rope_theta, T.Cast("float32", 2 * i) / T.float32(D))
                for i in T.vectorized(HALF):
                    angle: T.let[T.float32] = rope_angle(q_pos[s], rope_scale, cs[i])
                    sn[i] = sin_approx(angle)
                    cs[i] = cos_approx(angle)
                for h in T.serial(HQ):
                    rotate_head(q, qkv, s, h, h, cs, sn)
                for h in T.serial(HKV):
                    rotate_head(k, qkv, s, h, HQ + h, cs, sn)
            else:
                for h, d in T.grid(HQ, D):
                    q[s, h, d] = qkv[s, h, d]
                for h, d in T.grid(HKV, D):
                    k[s, h, d] = qkv[s, HQ + h, d]
            for h, d in T.grid(HKV, D):
                v[s, h, d] = qkv[s, HQ + HKV + h, d]

    return abi_prim_func("split_rotary", shape_values(spec), dtype, body)


def _split_rotary_table(spec):
    """``split_rotary_cpu`` for a RoPE variant (``spec.rope``, ``_rope_table``): the frequencies are constants,
    ``apply_rope`` 1 or 2 picks the set (2: LongRoPE's long factors), cos / sin carry the attention factor, pair
    ``i`` is ``tab.pair(i)`` and dims ``>= rotary_dim`` are copied."""
    HQ, HKV, D, dtype, tab = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.rope
    HALF, R = tab.half, tab.rotary_dim

    def ia(i):
        return tab.pair(i)[0]

    def ib(i):
        return tab.pair(i)[1]

    @T.macro
    def rotate_head(dst, qkv, s, hd, hs, cs, sn):
        """``dst[s, hd] = rope(qkv[s, hs])`` with the token's cos/sin table."""
        for i in T.vectorized(HALF):
            dst[s, hd, ia(i)] = T.Cast(dtype, T.Cast("float32", qkv[s, hs, ia(i)]) * cs[i]
                                       - T.Cast("float32", qkv[s, hs, ib(i)]) * sn[i])
            dst[s, hd, ib(i)] = T.Cast(dtype, T.Cast("float32", qkv[s, hs, ib(i)]) * cs[i]
                                       + T.Cast("float32", qkv[s, hs, ia(i)]) * sn[i])
        if R < D:  # static: the dims past rotary_dim pass through
            for d in T.vectorized(D - R):
                dst[s, hd, R + d] = qkv[s, hs, R + d]

    @T.macro
    def body(qkv, q_pos, q, k, v, apply_rope, rope_scale, rope_theta, dims):
        (n,) = dims
        for s in T.parallel(n):
            cs = T.alloc_buffer((HALF,), "float32")
            sn = T.alloc_buffer((HALF,), "float32")
            if rope_on(apply_rope):
                for i in T.unroll(HALF):
                    cs[i] = freq_value(tab, i, apply_rope)
                for i in T.vectorized(HALF):
                    angle: T.let[T.float32] = T.Cast("float32", q_pos[s]) * cs[i]
                    sn[i] = scaled(tab, sin_approx(angle))
                    cs[i] = scaled(tab, cos_approx(angle))
                for h in T.serial(HQ):
                    rotate_head(q, qkv, s, h, h, cs, sn)
                for h in T.serial(HKV):
                    rotate_head(k, qkv, s, h, HQ + h, cs, sn)
            else:
                for h, d in T.grid(HQ, D):
                    q[s, h, d] = qkv[s, h, d]
                for h, d in T.grid(HKV, D):
                    k[s, h, d] = qkv[s, HQ + h, d]
            for h, d in T.grid(HKV, D):
                v[s, h, d] = qkv[s, HQ + HKV + h, d]

    return abi_prim_func("split_rotary", shape_values(spec), dtype, body)
