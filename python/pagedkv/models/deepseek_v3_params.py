"""DeepSeek-V3 (dense layers, MLA attention) dims, RoPE tables and weight mapping, free of the TVM compiler
(usable in a runtime-only process).

Numbers follow HF transformers' ``modeling_deepseek_v3.py`` / ``modeling_rope_utils.py``: RoPE ``"default"``
and ``"yarn"`` (inverse frequencies, the cos/sin ``attention_factor`` and the softmax scale's ``mscale``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import KVCacheConfig
from ._checks import check_fields

ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class DeepseekV3Config:
    """Model dims, named as in HF ``DeepseekV3Config``. Every layer has a dense MLP (MoE is not supported).

    ``q_lora_rank=None`` means a plain ``q_proj`` (as DeepSeek-V2-Lite); otherwise q goes through
    ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``. ``rope_parameters`` is HF's dict (``rope_type``
    ``"default"`` or ``"yarn"`` with its ``factor``, ``mscale``, ... keys); ``None`` means default RoPE with
    ``rope_theta``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_parameters: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    #: eps of ``q_a_layernorm`` / ``kv_a_layernorm``: HF builds them with the RMSNorm default, not
    #: ``rms_norm_eps``.
    LORA_NORM_EPS = 1e-6

    def __post_init__(self) -> None:
        check_fields(self, positive_ints=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
                                          "max_position_embeddings"),
                     nonnegative_ints=("qk_nope_head_dim",), positive_floats=("rms_norm_eps", "rope_theta"))
        if self.q_lora_rank is not None:
            check_fields(self, positive_ints=("q_lora_rank",), positive_floats=())
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")

    # -- from HF ------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_config) -> DeepseekV3Config:
        """From an HF ``DeepseekV3Config`` (or anything with its attributes). Raises ``ValueError`` for what
        this model does not implement: MoE layers, attention biases, an activation other than SiLU, a RoPE
        type other than default / YaRN."""
        c = hf_config
        layers = c.num_hidden_layers
        first_dense = getattr(c, "first_k_dense_replace", None)
        first_dense = layers if first_dense is None else first_dense
        if first_dense < layers and (getattr(c, "n_routed_experts", 0) or 0) > 0:
            raise ValueError(
                f"MoE layers are not supported: layers {first_dense}..{layers - 1} of {layers} are MoE "
                f"(first_k_dense_replace={first_dense} < num_hidden_layers={layers}); only all-dense "
                "DeepSeek-V3 configs (first_k_dense_replace >= num_hidden_layers) can be built")
        if getattr(c, "attention_bias", False):
            raise ValueError("attention_bias=True is not supported")
        act = getattr(c, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        # num_key_value_heads is not read: MLA expands every head's k / v from the one latent.
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None)
        rope = dict(rope) if rope else None
        theta = (rope or {}).get("rope_theta") or getattr(c, "rope_theta", None) or 10000.0
        if rope is not None:
            rope.setdefault("rope_type", rope.get("type", "default"))
            if rope["rope_type"] == "yarn":
                rope.setdefault("original_max_position_embeddings", c.max_position_embeddings)
        interleave = getattr(c, "rope_interleave", True)
        return cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                   num_hidden_layers=layers, num_attention_heads=c.num_attention_heads,
                   kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                   qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank,
                   rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta), rope_parameters=rope,
                   rope_interleave=True if interleave is None else bool(interleave),
                   max_position_embeddings=c.max_position_embeddings,
                   tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)))

    # -- derived ------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Elements per token in the cache: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def q_a_dim(self) -> int:
        """Width of the q part of the fused first projection: ``q_lora_rank``, or all q heads without it."""
        if self.q_lora_rank is not None:
            return self.q_lora_rank
        return self.num_attention_heads * self.qk_head_dim

    @property
    def rope_type(self) -> str:
        return (self.rope_parameters or {}).get("rope_type", "default")

    def _rope(self, key: str, default=None):
        return (self.rope_parameters or {}).get(key, default)

    @property
    def sm_scale(self) -> float:
        """Softmax scale of both the non-absorbed and the absorbed attention (their scores are equal):
        ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times ``mscale ** 2`` under YaRN with
        ``mscale_all_dim`` (HF ``yarn_apply_mscale``: ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_type != "default":
            mscale_all_dim = self._rope("mscale_all_dim", 0)
            if mscale_all_dim:
                mscale = _yarn_get_mscale(self._rope("factor"), mscale_all_dim)
                scale = scale * mscale * mscale
        return scale

    def rope_inv_freq(self) -> np.ndarray:
        """``float32[qk_rope_head_dim // 2]`` inverse frequencies (angle of pair i = pos * inv_freq[i])."""
        dim, base = self.qk_rope_head_dim, self.rope_theta
        exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
        pos_freqs = base ** exponents
        if self.rope_type == "default":
            return (1.0 / pos_freqs).astype(np.float32)
        # YaRN (HF ``_compute_yarn_parameters``)
        factor = self._rope("factor")
        orig_max = self._rope("original_max_position_embeddings", self.max_position_embeddings)
        if factor is None:
            factor = self.max_position_embeddings / orig_max
        beta_fast = self._rope("beta_fast") or 32
        beta_slow = self._rope("beta_slow") or 1

        def correction_dim(num_rotations):
            return (dim * math.log(orig_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self._rope("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor)
                    + (1.0 / pos_freqs) * extrapolation_factor)
        return inv_freq.astype(np.float32)

    def rope_attention_factor(self) -> float:
        """Multiplier of cos and sin (1 for default RoPE; YaRN's ``mscale / mscale_all_dim`` ratio)."""
        if self.rope_type == "default":
            return 1.0
        factor = self._rope("attention_factor")
        if factor is not None:
            return float(factor)
        scale = self._rope("factor")
        if scale is None:
            scale = self.max_position_embeddings / self._rope("original_max_position_embeddings",
                                                              self.max_position_embeddings)
        mscale, mscale_all_dim = self._rope("mscale"), self._rope("mscale_all_dim")
        if mscale and mscale_all_dim:
            return float(_yarn_get_mscale(scale, mscale) / _yarn_get_mscale(scale, mscale_all_dim))
        return float(_yarn_get_mscale(scale))

    def kv_cache_config(self, dtype: str, **capacity) -> KVCacheConfig:
        """The MLA cache config (``rope_mode="none"``: the model rotates the rope part itself)."""
        return KVCacheConfig.mla(num_layers=self.num_hidden_layers, num_heads=self.num_attention_heads,
                                 kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                                 qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
                                 dtype=dtype, **capacity)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def params_from_state_dict(cfg: DeepseekV3Config, state_dict: Mapping[str, Any], named_params,
                           dtype: str) -> list[np.ndarray]:
    """Our parameters, in ``named_params`` order, from an HF DeepseekV3 state dict (torch tensors or numpy
    arrays): ``fused_qkv_a_proj`` = [q_a_proj (or q_proj); kv_a_proj_with_mqa], ``gate_up_proj`` =
    [gate_proj; up_proj], and ``kv_b_proj`` split per head into ``w_uk[H, nope, kv_lora_rank]`` and
    ``w_uv[H, v_head_dim, kv_lora_rank]`` (HF's weight is ``[H * (nope + v), kv_lora_rank]``)."""

    def get(key: str) -> np.ndarray:
        value = state_dict[key]
        if hasattr(value, "detach"):
            value = value.detach().float().cpu().numpy()
        return np.asarray(value, dtype=np.float32)

    h, nope, v, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    out = []
    for name, _ in named_params:
        key = name if name.startswith("lm_head") else "model." + name
        base, part = key.rsplit(".", 2)[0], key.split(".")[-2]
        if part == "fused_qkv_a_proj":
            q = "q_a_proj" if cfg.q_lora_rank is not None else "q_proj"
            arr = np.concatenate([get(f"{base}.{q}.weight"), get(f"{base}.kv_a_proj_with_mqa.weight")])
        elif part == "gate_up_proj":
            arr = np.concatenate([get(f"{base}.gate_proj.weight"), get(f"{base}.up_proj.weight")])
        elif key.endswith((".w_uk", ".w_uv")):
            kv_b = get(key.rsplit(".", 1)[0] + ".kv_b_proj.weight").reshape(h, nope + v, r)
            arr = kv_b[:, :nope] if key.endswith(".w_uk") else kv_b[:, nope:]
        elif key == "lm_head.weight" and key not in state_dict:
            arr = get("model.embed_tokens.weight")  # tied embeddings
        else:
            arr = get(key)
        out.append(np.ascontiguousarray(arr.astype(_numpy_dtype(dtype))))
    return out


def _numpy_dtype(dtype: str):
    """numpy's dtype for a model dtype name; bfloat16 is ml_dtypes' (a dependency of apache-tvm)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def params_from_hf(hf_model, named_params, dtype: str) -> list[np.ndarray]:
    """Our parameters, in ``named_params`` order, from an HF ``DeepseekV3ForCausalLM``."""
    cfg = DeepseekV3Config.from_hf(hf_model.config)
    return params_from_state_dict(cfg, hf_model.state_dict(), named_params, dtype)
