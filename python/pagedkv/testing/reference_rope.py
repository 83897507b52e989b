"""The float64 reference of every RoPE variant (``pagedkv.rope_spec.RopeSpec``), written apart from the kernels'
host tables (``pagedkv.rope_spec.inv_freq``) so that the two check each other; ``tests/cpu/test_rope_variants.py``
checks this one against transformers' ``ROPE_INIT_FUNCTIONS`` and its models' rotary embeddings.

Definitions (transformers' ``modeling_rope_utils``), for rotated dims ``R`` and pair ``i < R/2``, base frequency
``b_i = theta ** (-2i / R)``:

* default: ``b_i``; linear: ``b_i / factor``;
* llama3: wavelength ``w = 2 pi / b_i``; ``b_i`` where ``w < omax / high_freq_factor``, ``b_i / factor`` where
  ``w > omax / low_freq_factor``, between them ``(1 - s) b_i / factor + s b_i`` with
  ``s = (omax / w - low) / (high - low)``;
* yarn: ``b_i (1 - r_i) + b_i / factor * r_i`` with the ramp ``r_i = clamp((i - lo) / (hi - lo), 0, 1)`` over the
  correction range of ``beta_fast`` / ``beta_slow`` rotations (floored / ceiled unless ``truncate`` is False);
  attention factor ``0.1 ln(factor) + 1`` (or the mscale ratio);
* longrope: ``b_i / ext_i`` with the short or long factors; attention factor ``sqrt(1 + ln f / ln omax)``.

Rotation at angle ``p * scale * inv_freq[i]`` with cos and sin times the attention factor; pairs ``(i, i + R/2)``
or ``(2i, 2i + 1)`` (interleaved); dims ``>= R`` unchanged.
"""

from __future__ import annotations

import math

import torch


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def ref_attention_factor(spec) -> float:
    """The variant's factor on cos and sin."""
    if spec.attention_factor is not None:
        return float(spec.attention_factor)
    if spec.rope_type == "yarn":
        if spec.mscale and spec.mscale_all_dim:
            return _mscale(spec.factor, spec.mscale) / _mscale(spec.factor, spec.mscale_all_dim)
        return _mscale(spec.factor)
    if spec.rope_type == "longrope":
        f = spec.factor
        return 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(spec.original_max_position_embeddings))
    return 1.0


def ref_inv_freq(spec, head_dim: int, theta: float, *, long: bool = False) -> torch.Tensor:
    """``inv_freq[R / 2]`` (float64) of ``spec`` (None: plain RoPE over ``head_dim``)."""
    r = (spec.rotary_dim or head_dim) if spec is not None else head_dim
    i = torch.arange(r // 2, dtype=torch.float64)
    base = float(theta) ** (-2.0 * i / r)
    kind = "default" if spec is None else spec.rope_type
    if kind == "linear":
        return base / spec.factor
    if kind == "llama3":
        omax, lo, hi = spec.original_max_position_embeddings, spec.low_freq_factor, spec.high_freq_factor
        wavelen = 2 * math.pi / base
        smooth = ((omax / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0 past the low bound, 1 past the high one
        return torch.where(wavelen < omax / hi, base,
                           torch.where(wavelen > omax / lo, base / spec.factor,
                                       (1 - smooth) * base / spec.factor + smooth * base))
    if kind == "yarn":
        return _ref_yarn(spec, base, r, float(theta))
    if kind == "longrope":
        ext = torch.tensor(spec.long_factor if long else spec.short_factor, dtype=torch.float64)
        return base / ext
    return base


def _ref_yarn(spec, base: torch.Tensor, r: int, theta: float) -> torch.Tensor:
    fast, slow = spec.beta_fast or 32.0, spec.beta_slow or 1.0
    omax = spec.original_max_position_embeddings
    lo, hi = (r * math.log(omax / (n * 2 * math.pi)) / (2 * math.log(theta)) for n in (fast, slow))
    if spec.truncate is not False:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, r - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(r // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    return base * (1 - ramp) + base / spec.factor * ramp


def rope_variant(x: torch.Tensor, positions, theta: float, scale: float, spec, *, long: bool = False
                 ) -> torch.Tensor:
    """``x[n, H, D]`` rotated by ``spec`` (a ``RopeSpec``; None = plain) at ``positions[n]``, in float64.

    ``long``: LongRoPE's long set (the cache takes it for a forward whose longest sequence exceeds
    ``original_max_position_embeddings``); ignored by the other variants.
    """
    x = x.to(torch.float64)
    n, _, d = x.shape
    r = (spec.rotary_dim or d) if spec is not None else d
    pos = torch.as_tensor(positions, dtype=torch.float64, device=x.device).reshape(n)
    freq = ref_inv_freq(spec, d, theta, long=long).to(x.device)
    af = ref_attention_factor(spec) if spec is not None else 1.0
    angle = pos[:, None] * float(scale) * freq[None, :]
    cos, sin = (torch.cos(angle) * af)[:, None, :], (torch.sin(angle) * af)[:, None, :]
    interleaved = spec is not None and spec.interleaved
    a = x[..., 0:r:2] if interleaved else x[..., : r // 2]
    b = x[..., 1:r:2] if interleaved else x[..., r // 2: r]
    out = x.clone()
    ra, rb = a * cos - b * sin, b * cos + a * sin
    if interleaved:
        out[..., 0:r:2], out[..., 1:r:2] = ra, rb
    else:
        out[..., : r // 2], out[..., r // 2: r] = ra, rb
    return out


__all__ = ["ref_attention_factor", "ref_inv_freq", "rope_variant"]
