"""RoPE variants in the kernels: a ``pagedkv.rope_spec.RopeTable`` (``KernelSpec.rope``) as TIR.

A variant's frequencies are compile-time constants (float64 on the host, ``rope_spec``); a kernel reads
frequency ``i`` as ``table_value(values, i)``, a balanced select tree over ``i``: in a ``T.unroll`` loop (the CPU
kernels fill their per-work-item frequency buffer so) ``i`` is a constant once unrolled and the tree folds to one
constant store; with a thread index (CUDA) it costs ``log2(R / 2)`` selects, once per thread and token. LongRoPE
picks its set by ``apply_rope`` (2: long). The angle is ``p * inv_freq[i]`` (``rope_scale`` is in the table; the
kernels' ``rope_scale`` / ``rope_theta`` arguments are unused), cos and sin are multiplied by the attention factor,
and rotation pair ``i`` is dims ``RopeTable.pair(i)``; dims ``>= rotary_dim`` pass through.

The kernels without a table (``KernelSpec.rope is None``) do not import this module's macros: their code is what
it was before the variants existed.
"""

from __future__ import annotations

import struct

from tvm.script import tirx as T

from ._math import cos_approx, sin_approx


def table_value(values, i, dtype: str = "float32"):
    """``values[i]`` for a TIR index ``i`` (``0 <= i < len(values)``) as a select tree of ``dtype`` constants."""

    def pick(lo, hi):
        if hi - lo == 1:
            return getattr(T, dtype)(float(values[lo]))
        mid = (lo + hi) // 2
        return T.Select(i < mid, pick(lo, mid), pick(mid, hi))

    return pick(0, len(values))


def freq_value(table, i, apply_rope, dtype: str = "float32"):
    """Frequency ``i`` of the set ``apply_rope`` selects (2: LongRoPE's long set; else the table's one)."""
    short = table_value(table.inv_freq, i, dtype)
    if not table.inv_freq_long:
        return short
    return T.Select(apply_rope == 2, table_value(table.inv_freq_long, i, dtype), short)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


class _Sets:
    """``freq_value``'s view of two derived sets (rounded parts, reciprocals)."""

    def __init__(self, short, long):
        self.inv_freq, self.inv_freq_long = short, long


def divisor_value(table, i, apply_rope):
    """``1 / inv_freq[i]`` of the selected set as a float32 constant: the SIMT prefill's divisor (its angle is
    ``pos * 1 / divisor``, one more rounding than ``pos * inv_freq``: about 6e-8 of the angle)."""
    return freq_value(_Sets([1 / f for f in table.inv_freq], [1 / f for f in table.inv_freq_long]), i, apply_rope)


def cuda_inline_serves(table, head_dim: int) -> bool:
    """``rope_spec.cuda_inline_serves`` of a table: the whole head in halves (the CUDA inline kernels' layouts)."""
    return table.rotary_dim == head_dim and not table.interleaved


def whole_head_scale(table, sm_scale):
    """``sm_scale`` times the attention factor squared: with every dim of q and k rotated (``cuda_inline_serves``),
    scaling cos and sin by ``a`` scales every score by ``a^2``, which the CUDA inline kernels fold into the scale."""
    a = table.attention_factor
    return sm_scale if a == 1.0 else sm_scale * T.float32(a * a)


def freq_parts(table, i, apply_rope):
    """(``hi``, ``lo``): frequency ``i`` as a float32 pair ``hi + lo`` (48 significant bits of the float64 value),
    for ``_sincos_cuda.rope_sincos``' exact angle."""

    def parts(values):
        hi = [_f32(v) for v in values]
        return hi, [_f32(v - h) for v, h in zip(values, hi)]

    (sh, sl), (lh, ll) = parts(table.inv_freq), parts(table.inv_freq_long)
    return freq_value(_Sets(sh, lh), i, apply_rope), freq_value(_Sets(sl, ll), i, apply_rope)


def rope_on(apply_rope):
    """Whether a table kernel rotates: ``apply_rope`` 1 (the set) or 2 (LongRoPE's long set)."""
    return apply_rope >= 1


def scaled(table, x):
    """``x`` times the attention factor (left as is when it is 1: the default variants' code has no multiply)."""
    return x if table.attention_factor == 1.0 else x * T.float32(table.attention_factor)


def make_cpu_rope_macros(table):
    """The CPU kernels' ``(init_inv_freq, rope_row)`` of ``table`` (``_common.make_rope_macros``' interface).

    * ``init_inv_freq(invf[>= R/2], apply_rope)``: ``invf[i]`` = frequency ``i`` (constant stores);
    * ``rope_row(buf[*, D], r, pos, rope_scale, invf)``: rotates the ``R / 2`` pairs of row ``r`` in place for
      position ``pos`` (``rope_scale`` unused: it is in the table), cos / sin times the attention factor.
    """
    half = table.half

    def ia(i):
        return table.pair(i)[0]

    def ib(i):
        return table.pair(i)[1]

    @T.macro
    def init_inv_freq(invf, apply_rope):
        for i in T.unroll(half):
            invf[i] = freq_value(table, i, apply_rope)

    @T.macro
    def rope_row(buf, r, pos, rope_scale, invf):
        for i in T.vectorized(half):
            x0: T.let[T.float32] = buf[r, ia(i)]
            x1: T.let[T.float32] = buf[r, ib(i)]
            angle: T.let[T.float32] = T.Cast("float32", pos) * invf[i]
            c: T.let[T.float32] = scaled(table, cos_approx(angle))
            s: T.let[T.float32] = scaled(table, sin_approx(angle))
            buf[r, ia(i)] = x0 * c - x1 * s
            buf[r, ib(i)] = x1 * c + x0 * s

    return init_inv_freq, rope_row


__all__ = ["cuda_inline_serves", "divisor_value", "freq_parts", "whole_head_scale", "freq_value", "make_cpu_rope_macros", "make_no_inline_rope", "rope_on", "scaled", "table_value"]


def make_no_inline_rope(op: str):
    """``refuse(apply_rope)``: the host-side check of a CUDA attention kernel built for a RoPE variant, which has no
    inline RoPE for it (the TIR backend refuses ``rope_mode="inline"`` then, with the reason): a call with
    ``apply_rope != 0`` raises instead of rotating with the plain formula."""
    msg = (f"pagedkv: the CUDA {op} kernel has no inline RoPE for this RoPE variant (KernelSpec.rope); "
           "use rope_mode 'normal' (split_rotary rotates q and k before the cache)")

    @T.macro
    def refuse(apply_rope):
        assert apply_rope == 0, msg

    return refuse
