"""PyTorch reference of an FP8 (e4m3fn) KV cache: the reference caches of ``reference.py`` / ``reference_mla.py``
whose appended k / v (MLA: latents) are stored as the FP8 pages hold them, ``fp8(x / scale) * scale``.

The quantization is torch's own ``float8_e4m3fn`` (round to nearest even) after a float32 division and a clamp to
+-448 (the kernels saturate; torch's cast would give NaN), so the reference shares no code with the kernels'
integer codec (``pagedkv.tir_kernels._fp8``). Attention is then the float64 reference over the dequantized values:
tolerances stay the output dtype's. An MHA cache's ``self_attention`` quantizes its k / v too (its kernel reads
them as their pages will hold them); an MLA cache's does not (the model's up-projected k / v).
"""

from __future__ import annotations

import torch

from ..config import FP8_E4M3_MAX
from .reference import ReferenceCache
from .reference_mla import ReferenceMLACache

__all__ = ["dequantize", "fp8_codes", "fp8_reference_for", "quantize_dequantize"]


def fp8_codes(x: torch.Tensor, scale) -> torch.Tensor:
    """The e4m3fn codes (uint8) a page holds for ``x`` stored with ``scale`` (broadcast against ``x``)."""
    q = x.to(torch.float32) / torch.as_tensor(scale, dtype=torch.float32)
    return q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize(codes: torch.Tensor, scale) -> torch.Tensor:
    """float64 ``code * scale`` of uint8 e4m3fn ``codes``."""
    return codes.view(torch.float8_e4m3fn).to(torch.float64) * torch.as_tensor(scale, dtype=torch.float64)


def quantize_dequantize(x: torch.Tensor, scale, read_power: int = 1) -> torch.Tensor:
    """What a reader of an FP8 page gets for ``x`` stored with ``scale``: float64. ``read_power`` 0 or 2 is a reader
    that drops the scale or applies it twice (``code * scale ** read_power``): the bugs a test must catch."""
    return dequantize(fp8_codes(x, scale), torch.as_tensor(scale, dtype=torch.float64) ** read_power)


def _head_scales(config, name: str) -> torch.Tensor:
    """``[Hkv, 1]`` scales of MHA field ``name`` (broadcast over ``[n, Hkv, D]``)."""
    values = config.scales_of(name)
    return torch.tensor(values * (config.num_kv_heads if len(values) == 1 else 1), dtype=torch.float32)[:, None]


def latent_scales(config) -> torch.Tensor:
    """``[DL]`` scales of an MLA latent: ``ckv_scale`` for the first ``kv_lora_rank`` elements, ``kpe_scale`` after."""
    r, dl = config.kv_lora_rank, config.latent_dim
    return torch.tensor([config.ckv_scale] * r + [config.kpe_scale] * (dl - r), dtype=torch.float32)


class ReferenceFp8Cache(ReferenceCache):
    """:class:`ReferenceCache` of an FP8 MHA config: appended k / v quantized with ``k_scale`` / ``v_scale``."""

    read_power = 1

    def _qd(self, k, v):
        return (quantize_dequantize(k, _head_scales(self.config, "k_scale"), self.read_power),
                quantize_dequantize(v, _head_scales(self.config, "v_scale"), self.read_power))

    def _append(self, layer, k, v):
        super()._append(layer, *self._qd(k, v))

    def self_attention(self, layer, q, k, v, sm_scale):
        return super().self_attention(layer, q, *self._qd(k, v), sm_scale)


class ReferenceFp8MLACache(ReferenceMLACache):
    """:class:`ReferenceMLACache` of an FP8 MLA config: latents quantized with ``ckv_scale`` / ``kpe_scale``."""

    read_power = 1

    def _append(self, layer, k, v):
        k = quantize_dequantize(k, latent_scales(self.config), self.read_power)
        super()._append(layer, k, k[..., :self.kv_lora_rank])


def fp8_reference_for(config, *, read_power: int = 1) -> ReferenceCache:
    """The reference cache of an FP8 ``config`` (either layer kind); ``read_power`` as in ``quantize_dequantize``
    (0: a cache whose readers drop the scales, 2: apply them twice)."""
    if not config.fp8:
        raise ValueError(f"fp8_reference_for needs an FP8 config, got kv_dtype {config.page_dtype}")
    ref = ReferenceFp8MLACache(config) if config.is_mla else ReferenceFp8Cache(config)
    ref.read_power = read_power
    return ref
