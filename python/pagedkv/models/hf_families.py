"""transformers configs and weights -> the shared decoder (``DecoderConfig``, ``params_from_hf``), free of the TVM
compiler.

``from_hf(hf_config)`` reads a transformers config of a supported family (``FAMILIES``: HF ``model_type`` names)
into a ``DecoderConfig`` and raises ``UnsupportedConfigError`` (a ``ValueError``) naming the field for what the
decoder or the cache cannot represent: biases the decoder has no slot for, another activation, other layer kinds.
Mixed sliding / full layers become layer groups (``DecoderConfig.layer_windows``); layer kinds with their own RoPE
(Gemma 3's local and global bases) a rotation in the model per layer (``DecoderConfig.layer_rope``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..rope_spec import hf_rope_fields
from .decoder_config import DecoderConfig, MoeSpec

#: HF ``model_type`` -> the options that family sets beyond reading the common fields.
FAMILIES = ("llama", "mistral", "qwen3", "phi3", "gemma2", "gemma3_text", "gpt_oss", "granite_swa")
#: HF activation names -> ``DecoderConfig.hidden_act``.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class UnsupportedConfigError(ValueError):
    """An HF config the shared decoder cannot represent; the message names the field and why."""


def _refuse(c, field: str, why: str):
    raise UnsupportedConfigError(f"{c.model_type}: {field}={getattr(c, field, None)!r} is not supported: {why}")


def _windows(c) -> dict[str, Any]:
    """``sliding_window`` (every layer's) or ``layer_windows`` (per layer, from a ``layer_types`` that mixes
    sliding and full layers)."""
    kinds = list(getattr(c, "layer_types", None) or [])
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown:
        _refuse(c, "layer_types", f"layer kind {sorted(unknown)[0]!r} (only full_attention / sliding_attention)")
    window = int(getattr(c, "sliding_window", None) or 0)
    if not kinds:
        return {"sliding_window": window}
    per_layer = tuple(window if k == "sliding_attention" else 0 for k in kinds)
    if len(set(per_layer)) == 1:
        return {"sliding_window": per_layer[0]}
    out: dict[str, Any] = {"layer_windows": per_layer}
    params = getattr(c, "rope_parameters", None) or {}
    if "full_attention" in params and params["full_attention"] != params.get("sliding_attention"):
        # Gemma 3: local and global bases; the cache has one rotation, so the model rotates per layer
        rope = {k: hf_rope_fields(_rope_config(c, k)) for k in set(kinds)}
        out["layer_rope"] = tuple((rope[k]["rope_theta"], rope[k]["rope"]) for k in kinds)
    return out


def _rope_config(c, kind: str | None = None):
    """An object ``hf_rope_fields`` reads: Gemma 3 keeps one ``rope_parameters`` per layer kind (``kind``, else
    the first layer's)."""
    params = getattr(c, "rope_parameters", None) or {}
    if "full_attention" in params or "sliding_attention" in params:
        kind = kind or (getattr(c, "layer_types", None) or ["full_attention"])[0]
        return SimpleNamespace(**{**c.to_dict(), "rope_parameters": params[kind], "rope_scaling": None,
                                  "head_dim": getattr(c, "head_dim", None)})
    return c


def _activation(c) -> str:
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")
    if act not in _ACTIVATIONS:
        _refuse(c, "hidden_act", f"the decoder's activations are {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[act]


def _family_options(c) -> dict[str, Any]:
    t = c.model_type
    bias = bool(getattr(c, "attention_bias", False))
    out: dict[str, Any] = {"qkv_bias": bias, "o_bias": bias}
    if getattr(c, "mlp_bias", False):
        _refuse(c, "mlp_bias", "the gated MLP has no biases")
    if t == "qwen3":
        out["qk_norm"] = True
    elif t in ("gemma2", "gemma3_text"):
        if getattr(c, "use_bidirectional_attention", None):
            _refuse(c, "use_bidirectional_attention", "the cache's attention is causal")
        out.update(norm_offset=True, sandwich_norms=True, qk_norm=t == "gemma3_text",
                   embedding_multiplier=float(np.float32(c.hidden_size ** 0.5)),
                   attn_logit_softcap=float(getattr(c, "attn_logit_softcapping", None) or 0.0),
                   final_logit_softcap=float(getattr(c, "final_logit_softcapping", None) or 0.0),
                   sm_scale=float(c.query_pre_attn_scalar) ** -0.5)
    elif t == "gpt_oss":
        out.update(attention_sinks=True, moe=MoeSpec(num_experts=c.num_local_experts, top_k=c.num_experts_per_tok,
                                                     swiglu_alpha=float(getattr(c, "swiglu_alpha", 1.702)),
                                                     swiglu_limit=float(c.swiglu_limit)))
    elif t == "granite_swa":
        out.update(attention_sinks=True, embedding_multiplier=float(c.embedding_multiplier),
                   residual_multiplier=float(c.residual_multiplier), logits_scaling=float(c.logits_scaling),
                   sm_scale=float(c.attention_multiplier))
    return out


def from_hf(hf_config) -> DecoderConfig:
    """The ``DecoderConfig`` of a transformers config of a family in ``FAMILIES``.

    Raises
    ------
    UnsupportedConfigError
        Another family, or a field the decoder cannot represent (the message names it).
    """
    c = hf_config
    t = getattr(c, "model_type", None)
    if t not in FAMILIES:
        raise UnsupportedConfigError(f"model_type {t!r} is not a family of the shared decoder {FAMILIES}")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return DecoderConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, family=t, rms_norm_eps=c.rms_norm_eps,
                         tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                         **_windows(c), hidden_act=_activation(c), **hf_rope_fields(_rope_config(c)),
                         **_family_options(c))


#: Fused parameters -> the HF parts concatenated (in output order), when the state dict has them separate.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def params_from_hf(state_dict: Mapping[str, Any] | Any, named_params, dtype: str) -> list[np.ndarray]:
    """Our parameters, in ``named_params`` order, from an HF model or its state dict (torch tensors or arrays).

    ``qkv_proj`` / ``gate_up_proj`` concatenate HF's separate projections (weights and biases) unless the state
    dict has them fused (Phi-3); ``<proj>.weight_kn`` is HF's ``<proj>.weight`` transposed (CPU layout); a tied
    ``lm_head.weight`` is the embedding."""
    if hasattr(state_dict, "state_dict"):
        state_dict = state_dict.state_dict()

    def get(key: str) -> np.ndarray:
        value = state_dict[key]
        if hasattr(value, "detach"):
            value = value.detach().float().cpu().numpy()
        return np.asarray(value, dtype=np.float32)

    out = []
    for name, _ in named_params:
        transpose = name.endswith(".weight_kn")
        name = name.removesuffix("_kn")
        key = name if name.startswith("lm_head") else "model." + name
        base, part, leaf = ([""] + key.rsplit(".", 2))[-3:]
        if key in state_dict:
            arr = get(key)
        elif part in _FUSED:
            arr = np.concatenate([get(f"{base}.{p}.{leaf}") for p in _FUSED[part]])
        elif key == "lm_head.weight":
            arr = get("model.embed_tokens.weight")  # tied embeddings
        else:
            raise KeyError(f"parameter {name!r}: no {key!r} in the HF state dict")
        out.append(np.ascontiguousarray((arr.T if transpose else arr).astype(dtype)))
    return out
