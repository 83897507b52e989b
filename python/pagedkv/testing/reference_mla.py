"""PyTorch reference of an MLA paged KV cache (DeepSeek multi-head latent attention, absorbed form).

An MLA cache stores one latent vector per token (``kv_lora_rank + qk_rope_head_dim`` elements). The
reference keeps it as a single-head K of shape ``[len, 1, DL]`` with V the first ``kv_lora_rank`` elements,
so the generic :class:`~pagedkv.testing.reference.ReferenceCache` machinery (page accounting, fork, popn,
cross attention with one kv head shared by every query head) applies unchanged. ``self_attention`` is the
plain ragged attention among the new tokens (``head_dim`` / ``v_head_dim`` over ``num_qo_heads`` heads).
"""

from __future__ import annotations

import torch

from .reference import ReferenceCache, ReferenceCacheError

__all__ = ["ReferenceMLACache", "reference_for"]


class ReferenceMLACache(ReferenceCache):
    """:class:`ReferenceCache` for a config with MLA layers (``config.is_mla``)."""

    def __init__(self, config) -> None:
        if not config.is_mla:
            raise ValueError("ReferenceMLACache needs an MLA config")
        super().__init__(config)
        self.latent_dim = int(config.latent_dim)
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.cross_dv = self.kv_lora_rank

    def _empty_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        z = torch.zeros((0, 1, self.latent_dim), dtype=torch.float64)
        zv = torch.zeros((0, 1, self.kv_lora_rank), dtype=torch.float64)
        return [z.clone() for _ in range(self.num_layers)], [zv.clone() for _ in range(self.num_layers)]

    def append_mla_kv(self, layer: int, kv: torch.Tensor) -> None:
        """Store the forward's latents ``kv[n, DL]`` for ``layer``."""
        fwd = self._fwd()
        self._check_layer(layer)
        if tuple(kv.shape) != (fwd.q_indptr[-1], self.latent_dim):
            raise ReferenceCacheError(f"kv must be [{fwd.q_indptr[-1]}, {self.latent_dim}], got {tuple(kv.shape)}")
        kv = kv.to(torch.float64)[:, None, :]
        self._append(layer, kv, kv[..., :self.kv_lora_rank])

    def attention_with_fused_qkv(self, layer, qkv, sm_scale, *, sinks=None):
        raise ReferenceCacheError("attention_with_fused_qkv is for mha layers; this cache's layers are mla")

    def debug_get_mla_kv(self, seq_id: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Latents of tokens ``[start, end)``: float64 ``[L, end - start, DL]``."""
        k, _ = self.debug_get_kv(seq_id, start, end)
        return k[:, :, 0, :]


def reference_for(config) -> ReferenceCache:
    """The reference cache of ``config``'s layer kind."""
    return ReferenceMLACache(config) if config.is_mla else ReferenceCache(config)
