"""The options of the shared decoder (``pagedkv.models.decoder``), free of the TVM compiler (usable in a
runtime-only process).

One frozen ``DecoderConfig`` describes every dense / MoE decoder family pagedkv builds: Llama (and Llama 3.1+ with
llama3 RoPE), Mistral, Qwen3, Phi-3, Gemma 2 / 3 and gpt-oss differ only in the options below, each a named field
whose default is Llama's. ``pagedkv.models.hf_families.from_hf`` reads them from a transformers config and refuses,
naming the field, what the decoder cannot represent.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import KVCacheConfig
from ..layer_groups import layer_groups_from_windows
from ..rope_spec import RopeSpec
from ._checks import check_fields

#: MLP activations: ``"silu"`` (Llama, Qwen, Phi-3), ``"gelu_tanh"`` (Gemma's ``gelu_pytorch_tanh``).
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class MoeSpec:
    """A gpt-oss mixture of experts: a biased router picks ``top_k`` of ``num_experts`` per token, their logits'
    softmax weighs the experts' outputs; an expert is ``down(((up + 1) * gate * sigmoid(alpha * gate)))`` with
    ``gate`` / ``up`` the even / odd columns of a biased ``gate_up`` projection, clamped to ``limit``
    (``gate`` from above only).

    Parameters
    ----------
    num_experts, top_k : int
        HF ``num_local_experts`` and ``num_experts_per_tok``.
    swiglu_alpha, swiglu_limit : float
        HF ``swiglu_alpha`` (1.702) and ``swiglu_limit`` (7.0).
    """

    num_experts: int
    top_k: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        check_fields(self, positive_ints=("num_experts", "top_k"), positive_floats=("swiglu_alpha", "swiglu_limit"))
        if self.top_k > self.num_experts:
            raise ValueError(f"MoeSpec.top_k={self.top_k} exceeds num_experts={self.num_experts}")


@dataclass(frozen=True)
class DecoderConfig:  # pylint: disable=too-many-instance-attributes
    """Dims (named as in HF configs) and the per-family options of the shared decoder.

    Parameters
    ----------
    family : str
        The family's HF ``model_type`` (messages and library names only).
    sliding_window : int
        Every layer's window (keys with ``q_pos - k_pos < sliding_window``); 0: full attention.
    layer_windows : tuple of int
        Per-layer windows (0: full attention) when layers differ (gpt-oss, Gemma 2, GraniteSWA alternate sliding
        and full layers): the cache gets one layer group per window (``KVCacheConfig.layer_groups``, schema 7);
        empty: every layer has ``sliding_window``.
    rope : RopeSpec
        The cache's rotation beyond ``rope_theta`` (llama3, YaRN, LongRoPE, partial ``rotary_dim``).
    layer_rope : tuple of (float, RopeSpec)
        Per-layer ``(rope_theta, rope)`` when layers rotate differently (Gemma 3's local and global bases): the model
        rotates q and k itself and the cache does not (``rope_mode="none"``); default / linear / llama3 / yarn types
        over halves pairs (LongRoPE's per-forward switch stays the cache's). Empty: the cache rotates every layer
        with ``rope_theta`` / ``rope``.
    norm_offset : bool
        Gemma's RMSNorm: ``x * (1 + w)`` instead of ``x * w`` (every norm of the model, q / k norms included).
    qk_norm : bool
        RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3): parameters ``self_attn.q_norm`` / ``k_norm``.
    qkv_bias, o_bias : bool
        Biases of the q / k / v and of the output projection (gpt-oss: both).
    hidden_act : str
        ``ACTIVATIONS``: the gated MLP's activation.
    sandwich_norms : bool
        Gemma 2 / 3: a norm after attention (``post_attention_layernorm``, before the residual add) and a pair
        around the MLP (``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``).
    embedding_multiplier : float
        Embeddings times this (Gemma: ``sqrt(hidden_size)``, Granite: ``embedding_multiplier``); 1: none.
    residual_multiplier : float
        Granite: each branch's output times this before its residual add; 1: none.
    logits_scaling : float
        Granite: the output logits divided by this; 1: none.
    attn_logit_softcap, final_logit_softcap : float
        Gemma 2's ``cap * tanh(x / cap)`` of the attention scores (the cache's ``logits_soft_cap``) and of the
        output logits; 0: off.
    sm_scale : float
        The attention's softmax scale; 0: ``head_dim ** -0.5`` (Gemma: ``query_pre_attn_scalar ** -0.5``, Granite:
        ``attention_multiplier``).
    attention_sinks : bool
        gpt-oss's and GraniteSWA's learnable sinks: a ``self_attn.sinks`` float32 ``[num_attention_heads]`` parameter per layer.
    moe : MoeSpec or None
        gpt-oss's mixture of experts in place of the dense gated MLP.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    family: str = "llama"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope: RopeSpec = RopeSpec()
    tie_word_embeddings: bool = False
    sliding_window: int = 0
    layer_windows: tuple[int, ...] = ()
    layer_rope: tuple[tuple[float, RopeSpec], ...] = ()
    norm_offset: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    sm_scale: float = 0.0
    attention_sinks: bool = False
    moe: MoeSpec | None = None

    def __post_init__(self) -> None:
        check_fields(self, positive_ints=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "head_dim"),
                     positive_floats=("rms_norm_eps", "rope_theta", "embedding_multiplier",
                                      "residual_multiplier", "logits_scaling"),
                     nonnegative_ints=("sliding_window",))
        name = type(self).__name__
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{name}.num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.layer_windows:
            ok = all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in self.layer_windows)
            if not ok or len(self.layer_windows) != self.num_hidden_layers:
                raise ValueError(f"{name}.layer_windows must hold one int >= 0 per layer "
                                 f"({self.num_hidden_layers}), got {self.layer_windows!r}")
            if self.sliding_window:
                raise ValueError(f"{name}.sliding_window must be 0 with layer_windows (they say every layer's)")
        if self.layer_rope:
            self._check_layer_rope(name)
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"{name}.hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        for field in ("attn_logit_softcap", "final_logit_softcap", "sm_scale"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name}.{field} must be a number >= 0 (0: off / default), got {value!r}")

    def _check_layer_rope(self, name: str) -> None:
        if len(self.layer_rope) != self.num_hidden_layers:
            raise ValueError(f"{name}.layer_rope must hold one (rope_theta, RopeSpec) per layer "
                             f"({self.num_hidden_layers}), got {len(self.layer_rope)}")
        for layer, (theta, spec) in enumerate(self.layer_rope):
            problems = spec.problems(self.head_dim) if isinstance(spec, RopeSpec) else ["not a RopeSpec"]
            if isinstance(spec, RopeSpec) and (spec.rope_type == "longrope" or spec.interleaved):
                problems.append("the model rotates default / linear / llama3 / yarn over halves pairs only")
            if not (isinstance(theta, (int, float)) and theta > 0):
                problems.append(f"rope_theta must be > 0, got {theta!r}")
            if problems:
                raise ValueError(f"{name}.layer_rope[{layer}]: " + "; ".join(problems))

    @property
    def attention_scale(self) -> float:
        """The softmax scale the attention calls pass (``sm_scale``, or ``head_dim ** -0.5``)."""
        return self.sm_scale or self.head_dim ** -0.5

    def kv_cache_config(self, dtype: str, **capacity) -> KVCacheConfig:
        """The cache: MHA layers, the cache rotating q and k (``rope_mode="normal"``) with ``rope``; one layer group
        per window when ``layer_windows`` differ (equal ones are the plain ``sliding_window``)."""
        window, groups = self.sliding_window, None
        if len(set(self.layer_windows)) == 1:
            window = self.layer_windows[0]
        elif self.layer_windows:
            groups = layer_groups_from_windows(self.layer_windows)
        return KVCacheConfig(num_layers=self.num_hidden_layers, num_qo_heads=self.num_attention_heads,
                             num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim, dtype=dtype,
                             rope_mode="none" if self.layer_rope else "normal", rope_theta=self.rope_theta,
                             sliding_window=window, layer_groups=groups,
                             logits_soft_cap=float(self.attn_logit_softcap), attention_sinks=self.attention_sinks,
                             rope=RopeSpec() if self.layer_rope else self.rope, **capacity)
