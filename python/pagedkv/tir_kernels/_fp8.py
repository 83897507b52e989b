"""FP8 (e4m3fn) pages for the TIR kernels: the bit codec and the scales of a ``KernelSpec``.

Pages of an FP8 cache are ``uint8`` tensors holding OCP e4m3fn codes (sign, 4 exponent bits of bias 7, 3 mantissa
bits; no infinities, ``0x7F`` / ``0xFF`` NaN, largest finite 448). The kernels encode and decode the bits with
integer operations, never through TVM's FP8 dtypes: apache-tvm 0.27's LLVM legalization decodes ``0x00`` as
0.0078125 (and ``0x80`` as its negative), decodes subnormals wrong and flushes them on encode, and zeros fill a KV
cache. Both directions are exact: ``decode`` gives the code's value (every one of the 256 is tested against
torch.float8_e4m3fn), ``encode`` rounds to nearest even, saturates at +-448 (``inf`` included: satfinite) and keeps
NaN (``0x7F`` with the sign).

Scales (``Fp8Scales``): the page holds ``x / scale``; a reader would multiply by ``scale``. Where the algebra allows,
the kernels fold it instead: the K scale of kv head ``h`` multiplies the q rows of its group (scores are linear in
k), the V scale multiplies ``o`` when a pass stores it (``o`` is linear in v, and every merge of pass states is a
convex combination of ``o``s, so scaling each pass's ``o`` is exact for every pass structure; an empty state's or a
sink's ``o = 0`` stays 0). MLA latents have two per-tensor scales: ``ckv`` for the first ``kv_lora_rank`` elements
(key and value), ``kpe`` for the rope part (key only), folded into the two parts of q.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

#: float32 bit patterns: 448 (the largest e4m3fn value), 2**-6 (its smallest normal), +inf, a quiet NaN.
_MAX_BITS, _MIN_NORMAL_BITS, _INF_BITS, _NAN_BITS = 0x43E00000, 0x3C800000, 0x7F800000, 0x7FC00000


def decode_e4m3(code):
    """The float32 value of e4m3fn code ``code`` (a uint8 expression): exact, zeros and subnormals included."""
    c = T.Cast("int32", code)
    mag = c & 0x7F
    # Subnormal (exponent field 0): mantissa * 2**-9, exact in float32. Normal: the 7 bits shifted into a float32's
    # exponent and mantissa fields, the exponent re-biased from 7 to 127 (+120).
    sub = T.reinterpret("int32", T.Cast("float32", mag) * T.float32(2.0**-9))
    bits = T.Select(mag < 8, sub, (mag << 20) + (120 << 23))
    bits = T.Select(mag == 0x7F, T.int32(_NAN_BITS), bits)
    return T.reinterpret("float32", bits | ((c & 0x80) << 24))


def encode_e4m3(x):
    """The e4m3fn code (uint8) of float32 ``x``: round to nearest even, saturated at +-448, NaN kept."""
    xb = T.reinterpret("int32", x)
    ab = T.min(xb & 0x7FFFFFFF, _MAX_BITS)  # |x| as bits, saturated (inf too); integer ops: NaN is tested below
    # Normal range: round the float32 mantissa to 3 bits (ties to even); a carry moves into the exponent.
    norm = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range (|x| < 2**-6): code = round(|x| * 2**9), from the 24-bit significand shifted right by 141 - e.
    eb = T.max(ab >> 23, 1)
    mant = (ab & 0x7FFFFF) | T.Select(ab >= 0x800000, 0x800000, 0)
    sh = T.min(141 - eb, 31)
    q = mant >> sh
    r = mant - (q << sh)
    half = 1 << (sh - 1)
    sub = q + T.Select(T.Or(r > half, T.And(r == half, (q & 1) == 1)), 1, 0)
    code = T.Select((xb & 0x7FFFFFFF) > _INF_BITS, 0x7F, T.Select(ab < _MIN_NORMAL_BITS, sub, norm))
    return T.Cast("uint8", code | ((xb >> 24) & 0x80))


def quantize(x, scale):
    """The code of float32 ``x`` stored with ``scale`` (``x / scale``, a division as the reference does)."""
    return encode_e4m3(x / scale)


def head_const(values: tuple[float, ...], h):
    """``values[h]`` as a float32 expression (a constant when every value is the same)."""
    if len(set(values)) == 1:
        return T.float32(values[0])
    out = T.float32(values[-1])
    for i in range(len(values) - 2, -1, -1):
        out = T.Select(h == i, T.float32(values[i]), out)
    return out


@dataclass(frozen=True)
class Fp8Scales:
    """The scales an FP8 kernel applies (``fp8_scales(spec)``).

    Attributes
    ----------
    k, v : tuple of float
        MHA: per kv head (``num_kv_heads`` values). MLA: ``k == v == (ckv,)``.
    split : int
        MLA: ``kv_lora_rank`` (latent elements before it take ``ckv``, after it ``kpe``); 0 for MHA.
    kpe : float
        MLA: the rope part's scale.
    """

    k: tuple[float, ...]
    v: tuple[float, ...]
    split: int = 0
    kpe: float = 1.0

    def k_of(self, h, dd=None):
        """The key scale of kv head ``h`` (MHA) or of latent element ``dd`` (MLA)."""
        if not self.split:
            return head_const(self.k, h)
        if self.k[0] == self.kpe:
            return T.float32(self.kpe)
        return T.Select(dd < self.split, T.float32(self.k[0]), T.float32(self.kpe))

    def v_of(self, h):
        """The value scale of kv head ``h`` (MLA: ``ckv``)."""
        return head_const(self.v, h)


def fp8_scales(spec) -> Fp8Scales | None:
    """The scales of a ``KernelSpec`` with FP8 pages; None when its pages hold its dtype."""
    if not spec.kv_dtype:
        return None
    if spec.is_mla:
        return Fp8Scales(k=(spec.ckv_scale,), v=(spec.ckv_scale,), split=spec.kv_lora_rank, kpe=spec.kpe_scale)
    return Fp8Scales(k=tuple(spec.k_scale), v=tuple(spec.v_scale))


__all__ = ["Fp8Scales", "decode_e4m3", "encode_e4m3", "fp8_scales", "head_const", "quantize"]
