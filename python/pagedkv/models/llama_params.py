"""Llama dims and weight mapping, free of the TVM compiler (usable in a runtime-only process)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import KVCacheConfig
from ..rope_spec import RopeSpec
from ._checks import check_fields


@dataclass(frozen=True)
class LlamaConfig:
    """Model dims, named as in HF ``LlamaConfig``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    #: Mistral's sliding window (HF ``MistralConfig.sliding_window``); 0: full attention (Llama).
    sliding_window: int = 0
    #: The RoPE variant the cache rotates with (Llama 3.1+: llama3; ``pagedkv.rope_spec.hf_rope_fields``).
    rope: RopeSpec = RopeSpec()

    def __post_init__(self) -> None:
        check_fields(self, positive_ints=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "head_dim"),
                     positive_floats=("rms_norm_eps", "rope_theta"), nonnegative_ints=("sliding_window",))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"LlamaConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    def decoder_config(self):
        """The shared decoder's options (``pagedkv.models.decoder_config.DecoderConfig``) of this model."""
        from .decoder_config import DecoderConfig

        return DecoderConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                             intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                             num_attention_heads=self.num_attention_heads,
                             num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                             family="mistral" if self.sliding_window else "llama", rms_norm_eps=self.rms_norm_eps,
                             rope_theta=self.rope_theta, rope=self.rope,
                             tie_word_embeddings=self.tie_word_embeddings, sliding_window=self.sliding_window)

    def kv_cache_config(self, dtype: str, **capacity) -> KVCacheConfig:
        return KVCacheConfig(num_layers=self.num_hidden_layers, num_qo_heads=self.num_attention_heads,
                             num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim, dtype=dtype,
                             rope_mode="normal", rope_theta=self.rope_theta, sliding_window=self.sliding_window,
                             rope=self.rope, **capacity)


def params_from_hf(hf_model, named_params, dtype: str) -> list[np.ndarray]:
    """Our parameters, in ``named_params`` order, from an HF Llama state dict (fusing qkv and gate/up).

    A parameter named ``<proj>.weight_kn`` is the projection's weight stored ``[in, out]`` (CPU models,
    ``_common.LinearKN``): HF's ``<proj>.weight``, transposed."""
    sd = {k: v.detach().float().cpu().numpy() for k, v in hf_model.state_dict().items()}
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out = []
    for name, _ in named_params:
        transpose = name.endswith(".weight_kn")
        name = name.removesuffix("_kn")
        key = name if name.startswith("lm_head") else "model." + name
        part = key.split(".")[-2]
        if part in fused:
            base = key.rsplit(".", 2)[0]
            arr = np.concatenate([sd[f"{base}.{p}.weight"] for p in fused[part]])
        elif key == "lm_head.weight" and key not in sd:
            arr = sd["model.embed_tokens.weight"]  # tied embeddings
        else:
            arr = sd[key]
        out.append(np.ascontiguousarray((arr.T if transpose else arr).astype(dtype)))
    return out
