"""Vectorizable float32 approximations of exp2, tanh, sin and cos, as PrimExpr builders.

``T.exp2`` / ``T.sin`` / ``T.cos`` in a vectorized loop lower to one scalar libm call per lane (LLVM
has no vector libm here), which would dominate the attention inner loops: a scalar ``exp2f`` costs more
than a key's whole score at D = 128, and inline RoPE needs a sin and a cos per key and dimension pair.
These forms stay in SIMD registers. Each returns a PrimExpr whose subexpressions are bound with
``Let`` so the argument is evaluated once.
"""

from __future__ import annotations

import math

from tvm import tirx

#: log2(e): converts natural-log scores to base 2 so the kernels can use exp2/log2 (here, below every kernel
#: module, so that the variants and the common helpers share it without importing each other).
LOG2E = math.log2(math.e)
# 2^f on f in [-0.5, 0.5]: Taylor coefficients (ln 2)^k / k!, degree 6 (relative error < 2e-7).
_EXP2 = (1.0, 0.6931471805599453, 0.2402265069591007, 0.05550410866482158,
         0.009618129107628477, 0.0013333558146428443, 0.00015403530393381606)
# tanh on |x| < 0.625: x + x^3 P(x^2), the Cephes tanhf minimax coefficients (relative error about 1e-7).
_TANH = (-3.33332819422e-1, 1.33314422036e-1, -5.37397155531e-2, 2.06390887954e-2, -5.70498872745e-3)
_TANH_SMALL = 0.625
# pi/2 split for Cody-Waite reduction: the first two parts have few significant bits, so k * part is
# exact in float32 for |k| < 2^15 (angles up to about 5e4 radians).
_PIO2 = (1.5703125, 4.837512969970703125e-4, 7.549789954891882e-8)
# Minimax polynomials on [-pi/4, pi/4] (the Cephes sinf / cosf coefficients), error about 1e-7.
_SIN = (-1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4)
_COS = (4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5)


def _f32(value):
    return tirx.const(value, "float32")


def exp2_approx(x):
    """``2 ** x`` for ``x <= 0``; inputs at or below -127 (masked scores, an empty running max) give
    exactly 0, NaN gives NaN.

    NaN must come through: a NaN score (a NaN in a query row or in an attended key) has to reach the row's
    sum and output, or the row comes out finite (issue 44). ``max(x, -127)`` dropped it (LLVM lowers ``max``
    to ``x > -127 ? x : -127``), so the clamp is a select that keeps NaN, and only the integer part, which
    must be finite for the int conversion, maps NaN to -127: its scale 0 times the NaN polynomial is NaN."""
    xv = tirx.Var("e2x", "float32")
    xi = tirx.Var("e2i", "float32")
    f = xv - xi
    poly = _f32(_EXP2[-1])
    for coeff in reversed(_EXP2[:-1]):
        poly = poly * f + _f32(coeff)
    # 2^xi from the exponent bits; xi = -127 gives biased exponent 0, i.e. the value 0.
    scale = tirx.call_intrin("float32", "tirx.reinterpret", tirx.shift_left(tirx.Cast("int32", xi) + 127, 23))
    body = tirx.Let(xi, tirx.floor(tirx.Select(xv >= _f32(-127.0), xv, _f32(-127.0)) + _f32(0.5)), poly * scale)
    return tirx.Let(xv, tirx.Select(x < _f32(-127.0), _f32(-127.0), x), body)


def tanh_approx(x):
    """``tanh(x)`` in float32 with a relative error of a few 1e-7 everywhere.

    TVM legalizes ``T.tanh`` on llvm with an exp formula (cancels near 0, and is one scalar libm call
    per lane in a vectorized loop). Here small ``|x|`` takes an odd polynomial, the rest
    ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|) <= exp(-1.25)`` (no cancellation), signed; large
    ``|x|`` gives ``e = 0``, i.e. exactly +-1.
    """
    xv = tirx.Var("th_x", "float32")
    av = tirx.Var("th_a", "float32")
    ev = tirx.Var("th_e", "float32")
    z = xv * xv
    poly = _f32(_TANH[-1])
    for coeff in reversed(_TANH[:-1]):
        poly = poly * z + _f32(coeff)
    small = xv + xv * z * poly
    big = (_f32(1.0) - ev) / (_f32(1.0) + ev)
    body = tirx.Select(av < _f32(_TANH_SMALL), small, tirx.Select(xv < _f32(0.0), -big, big))
    body = tirx.Let(ev, exp2_approx(av * _f32(-2.0 * LOG2E)), body)
    return tirx.Let(xv, x, tirx.Let(av, tirx.abs(xv), body))


def _sincos(angle, want_sin: bool):
    """sin or cos of ``angle``: reduce by k * pi/2 to r in [-pi/4, pi/4], evaluate the polynomial
    and pick sign / function by the quadrant k mod 4."""
    a = tirx.Var("sc_a", "float32")
    k = tirx.Var("sc_k", "float32")
    r = tirx.Var("sc_r", "float32")
    z = tirx.Var("sc_z", "float32")
    sin_r = r + r * z * (_f32(_SIN[0]) + z * (_f32(_SIN[1]) + z * _f32(_SIN[2])))
    cos_r = _f32(1.0) - _f32(0.5) * z + z * z * (_f32(_COS[0]) + z * (_f32(_COS[1]) + z * _f32(_COS[2])))
    quad = tirx.bitwise_and(tirx.Cast("int32", k), 3)  # two's complement: -1 & 3 == 3
    # sin(r + q pi/2) = s, c, -s, -c; cos(r + q pi/2) = c, -s, -c, s for q = 0, 1, 2, 3
    first, second = (sin_r, cos_r) if want_sin else (cos_r, -sin_r)
    value = tirx.Select(quad == 0, first,
                        tirx.Select(quad == 1, second, tirx.Select(quad == 2, -first, -second)))
    reduced = ((a - k * _f32(_PIO2[0])) - k * _f32(_PIO2[1])) - k * _f32(_PIO2[2])
    body = tirx.Let(r, reduced, tirx.Let(z, r * r, value))
    body = tirx.Let(k, tirx.floor(a * _f32(0.6366197723675814) + _f32(0.5)), body)
    return tirx.Let(a, angle, body)


def sin_approx(angle):
    """``sin(angle)`` (float32, absolute error about 1e-7 for |angle| < 5e4)."""
    return _sincos(angle, True)


def cos_approx(angle):
    """``cos(angle)`` (float32, absolute error about 1e-7 for |angle| < 5e4)."""
    return _sincos(angle, False)
