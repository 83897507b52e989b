"""RoPE cos / sin of ``p * w`` at float64-reference accuracy in float32 arithmetic, for the CUDA kernels.

The ABI angle is ``p * rope_scale / rope_theta ** (2i / D)``. Rounding it to float32 before taking cos / sin
(what ``_common_cuda.rope_angle`` does) costs half an ulp of the angle: 4e-3 rad at position 1e5, far more
than float32's tolerance. Here the angle is never rounded:

* ``w = rope_scale / theta ** (2i / D)`` is computed in float64 once per thread and kept as two floats,
  ``w_hi + w_lo`` (48 significant bits);
* for an integer position ``p`` (exact in float32 below 2^24), ``p * w_hi = hi + err`` exactly (``err`` from
  one FMA) and ``lo = p * w_lo + err``;
* ``hi`` is reduced by ``k * pi/2`` with a three-part ``pi/2`` (Cody-Waite with FMAs): the first step
  ``hi - k * P1`` is exact (both are multiples of ``2^-23`` or finer and the difference is below 1), the other
  two round once each at ``|r| < 1``; then ``r += lo``;
* ``sin r`` and ``cos r`` come from the Cephes minimax polynomials (``_math``), rotated by ``k pi/2``.

The result is within ~2e-7 of the float64 cos / sin for ``|p * w| < 2^21`` rad (positions up to 2M at
``rope_scale = 1``; measured with a float32 emulation of these steps); past that ``k`` no longer rounds to the
nearest multiple (1.5e-6 at 2^22, 2e-5 at 2^23). ``--use_fast_math`` does not touch it: every rounding step
that matters is an explicit ``__f*_rn``.

The decode kernel uses it on *relative* positions (``q_pos - key``, and small key offsets), which is where
the saving comes from; the identity ``<R(a) q, R(b) k> = <R(a - c) q, R(b - c) k>`` makes the result the
same as rotating q and k at their absolute positions.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from ._math import _COS, _SIN

#: pi/2 = P1 + P2 + P3 (each a float32; P1 = float32(pi/2), P2 and P3 the rounded remainders).
PIO2 = (1.5707963705062866, -4.371138828673793e-08, -1.7151245100058819e-15)
TWO_OVER_PI = 2.0 / math.pi


def fmaf(a, b, c):
    """``a * b + c`` rounded once (``__fmaf_rn``)."""
    return T.call_extern("float32", "__fmaf_rn", a, b, c)


def fmul_rn(a, b):
    """``a * b`` rounded to nearest and never contracted into an FMA (``__fmul_rn``)."""
    return T.call_extern("float32", "__fmul_rn", a, b)


def rope_freq64(i, rope_theta, rope_scale, head_dim: int):
    """``w_i = rope_scale / theta ** (2 i / D)`` in float64 (the reference's formula; ``--use_fast_math``
    approximates float32 ``powf`` only)."""
    expo = T.Cast("float64", 2 * i) / T.float64(head_dim)
    return T.Cast("float64", rope_scale) / T.pow(T.Cast("float64", rope_theta), expo)


def rope_freq64_exp2(i, rope_theta, rope_scale, head_dim: int):
    """``rope_freq64`` as ``scale * exp2(log2(theta) * -2i / D)`` in float64, inlined (the float64 ``pow`` of
    ``rope_freq64`` is a call whose ABI spills registers in the decode kernels); 1e-16 off: far below its
    float32 pair."""
    return T.Cast("float64", rope_scale) * T.exp2(
        T.log2(T.Cast("float64", rope_theta)) * (T.Cast("float64", -2 * i) / T.float64(head_dim)))


def rope_freq_split(w64):
    """(``w_hi``, ``w_lo``): the float64 frequency ``w64`` as a float32 pair (48 significant bits)."""
    return T.Cast("float32", w64), T.Cast("float32", w64 - T.Cast("float64", T.Cast("float32", w64)))


@T.macro
def rope_freq(w_hi, w_lo, idx, i, rope_theta, rope_scale, head_dim):
    """``w_hi[idx] + w_lo[idx]`` = frequency ``w_i`` (``rope_freq64``) as a float32 pair."""
    w64: T.let[T.float64] = rope_freq64(i, rope_theta, rope_scale, head_dim)
    w_hi[idx] = T.Cast("float32", w64)
    w_lo[idx] = T.Cast("float32", w64 - T.Cast("float64", T.Cast("float32", w64)))


@T.macro
def rope_sincos(cs, sn, idx, pos, w_hi, w_lo):
    """``cs[idx], sn[idx] = cos, sin(pos * (w_hi + w_lo))`` for an int32 ``pos`` (module docstring)."""
    pf: T.let[T.float32] = T.Cast("float32", pos)
    hi: T.let[T.float32] = fmul_rn(pf, w_hi)
    lo: T.let[T.float32] = fmaf(pf, w_lo, fmaf(pf, w_hi, -hi))
    kq: T.let[T.float32] = T.floor(hi * T.float32(TWO_OVER_PI) + T.float32(0.5))
    r1: T.let[T.float32] = fmaf(-kq, T.float32(PIO2[0]), hi)
    r: T.let[T.float32] = fmaf(-kq, T.float32(PIO2[2]), fmaf(-kq, T.float32(PIO2[1]), r1)) + lo
    z: T.let[T.float32] = r * r
    s_r: T.let[T.float32] = r + r * z * (T.float32(_SIN[0]) + z * (T.float32(_SIN[1]) + z * T.float32(_SIN[2])))
    c_r: T.let[T.float32] = (T.float32(1) - T.float32(0.5) * z
                             + z * z * (T.float32(_COS[0]) + z * (T.float32(_COS[1]) + z * T.float32(_COS[2]))))
    # cos / sin(r + q pi/2) for q = k mod 4 (two's complement: -1 & 3 == 3) as the rotation of (c_r, s_r) by
    # (A, B) = (cos, sin)(q pi/2) = (1, 0), (0, 1), (-1, 0), (0, -1): products with 0 / +-1 and sums with 0
    # are exact, and there is no select for nvcc to turn into branches.
    quad: T.let[T.int32] = T.bitwise_and(T.Cast("int32", kq), 3)
    qa: T.let[T.float32] = T.Cast("float32", (1 - T.bitwise_and(quad, 1)) * (1 - T.bitwise_and(quad, 2)))
    qb: T.let[T.float32] = T.Cast("float32", T.bitwise_and(quad, 1) * (1 - T.bitwise_and(quad, 2)))
    cs[idx] = c_r * qa - s_r * qb
    sn[idx] = s_r * qa + c_r * qb

__all__ = ["PIO2", "fmaf", "fmul_rn", "rope_freq", "rope_freq64", "rope_sincos"]
