"""The one decoder-only Relax ``nn`` model every dense / MoE family is built from (``DecoderConfig`` names the
per-family options), on ``pagedkv.relax.PagedKVCache``.

A layer is ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (Gemma's ``sandwich_norms`` add a norm after each
branch); attention projects q / k / v in one GEMM, optionally normalizes each q and k head (Qwen3, Gemma 3), and
hands the fused ``[q; k; v]`` heads to the cache, which rotates them (``DecoderConfig.rope``), applies the window,
soft cap and sinks, and attends. Parameter names are HF's (``self_attn.q_norm``, ``mlp.experts.gate_up_proj``, ...)
except the fused projections ``qkv_proj`` / ``gate_up_proj``, so ``hf_families.params_from_hf`` maps them by name.

Exported functions, as every pagedkv model's (``_common.CausalLMExports``):
- ``create_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
  support_sliding_window)``
- ``prefill(input_ids[1, n], logit_positions[b], cache) -> logits[1, b, vocab]``
- ``decode(input_ids[b, 1], cache) -> logits[b, 1, vocab]``
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..relax import PagedKVCache
from ._common import CausalLMExports, GatedMLP, cast, layout_for, linear, proj
from .decoder_config import DecoderConfig, MoeSpec
from .deepseek_v3 import _rope_tables


def _layer_rope_tables(cfg: DecoderConfig, positions: Tensor) -> list:
    """Per layer, ``(cos, sin)`` ``float32[T, R / 2]`` of its ``layer_rope`` (built once per distinct rotation),
    times the rotation's attention factor, from float32 inverse frequencies (HF's dtype)."""
    from .. import rope_spec

    tables: dict = {}
    for theta, spec in cfg.layer_rope:
        if (theta, spec) not in tables:
            freq = np.asarray(rope_spec.inv_freq(spec, cfg.head_dim, theta), dtype=np.float32)
            tables[(theta, spec)] = _rope_tables(positions, freq, rope_spec.attention_factor(spec))
    return [tables[key] for key in cfg.layer_rope]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, dtype: str) -> Tensor:
    """``x[b, s, H, D]`` rotated over its leading ``R = 2 * cos.shape[1]`` dims in halves pairs (``rotate_half``);
    the rest passes through."""
    b, s, h, d = x.shape
    half = cos.shape[1]
    x = op.reshape(cast(x, "float32"), (b * s, h, d))
    rot, rest = (x, None) if 2 * half == d else op.split(x, [2 * half], axis=-1)
    x1, x2 = op.split(rot, 2, axis=-1)
    c, sn = op.reshape(cos, (b * s, 1, half)), op.reshape(sin, (b * s, 1, half))
    parts = [x1 * c - x2 * sn, x2 * c + x1 * sn] + ([rest] if rest is not None else [])
    return cast(op.reshape(op.concat(parts, dim=-1), (b, s, h, d)), dtype)


def _const(value: float, dtype: str) -> Tensor:
    return Tensor.from_const(np.array(value, dtype=dtype))


def _softcap(x: Tensor, cap: float) -> Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's final logits)."""
    return op.multiply(op.tanh(op.divide(x, _const(cap, x.dtype))), _const(cap, x.dtype))


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, ``1 + weight`` formed in float32 as HF does."""

    def __init__(self, dim: int, eps: float, dtype: str):
        self.eps, self.dtype = eps, dtype
        self.weight = nn.Parameter((dim,), dtype)

    def forward(self, x: Tensor) -> Tensor:
        scale = op.add(cast(self.weight, "float32"), _const(1.0, "float32"))
        return cast(op.rms_norm(cast(x, "float32"), scale, axes=[-1], epsilon=self.eps), self.dtype)


def norm(cfg: DecoderConfig, dim: int, dtype: str) -> nn.Module:
    if cfg.norm_offset:
        return OffsetRMSNorm(dim, cfg.rms_norm_eps, dtype)
    return nn.RMSNorm(dim, -1, cfg.rms_norm_eps, bias=False, dtype=dtype)


class BiasedLinear(nn.Module):
    """A projection with a bias, accumulated in float32; the weight in ``layout`` (``_common.WEIGHT_LAYOUTS``:
    parameter ``weight`` ``[out, in]`` or ``weight_kn`` ``[in, out]``), the bias ``[out]``."""

    def __init__(self, in_features: int, out_features: int, dtype: str, layout: str):
        self.layout = layout
        if layout == "kn":
            self.weight_kn = nn.Parameter((in_features, out_features), dtype)
        else:
            self.weight = nn.Parameter((out_features, in_features), dtype)
        self.bias = nn.Parameter((out_features,), dtype)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight_kn if self.layout == "kn" else op.permute_dims(self.weight)
        return op.add(op.matmul(x, w, out_dtype="float32"), cast(self.bias, "float32"))


def projection(in_features: int, out_features: int, dtype: str, layout: str, *, bias: bool) -> nn.Module:
    return BiasedLinear(in_features, out_features, dtype, layout) if bias else linear(in_features, out_features,
                                                                                      dtype, layout)


class Attention(nn.Module):  # pylint: disable=too-many-instance-attributes
    """Fused-qkv attention on the cache: optional q / k head norms (before the cache's RoPE) and sinks."""

    def __init__(self, cfg: DecoderConfig, layer_id: int, dtype: str, layout: str):
        self.cfg, self.layer_id, self.dtype = cfg, layer_id, dtype
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = projection(cfg.hidden_size, (hq + 2 * hkv) * d, dtype, layout, bias=cfg.qkv_bias)
        self.o_proj = projection(hq * d, cfg.hidden_size, dtype, layout, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = norm(cfg, d, dtype), norm(cfg, d, dtype)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter((hq,), "float32")

    def forward(self, x: Tensor, cache: PagedKVCache, rope=None) -> Tensor:
        b, s, _ = x.shape
        c = self.cfg
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = op.reshape(proj(self.qkv_proj, x, self.dtype), (b, s, hq + 2 * hkv, d))
        if c.qk_norm or rope is not None:  # norms per head, before RoPE (the cache or the model rotates after)
            q, k, v = op.split(qkv, [hq, hq + hkv], axis=2)
            if c.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:  # this layer's own rotation (DecoderConfig.layer_rope)
                q, k = _rotate(q, *rope, self.dtype), _rotate(k, *rope, self.dtype)
            qkv = op.concat([q, k, v], dim=2)
        sinks = self.sinks if c.attention_sinks else None
        o = cache.attention_with_fused_qkv(self.layer_id, qkv, hq, c.attention_scale, sinks=sinks)
        return proj(self.o_proj, op.reshape(o, (b, s, hq * d)), self.dtype)


class Experts(nn.Module):
    """gpt-oss's experts, HF's parameters and layouts (``gate_up_proj[E, H, 2I]``, gate / up interleaved)."""

    def __init__(self, cfg: DecoderConfig, dtype: str):
        e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter((e, h, 2 * i), dtype)
        self.gate_up_proj_bias = nn.Parameter((e, 2 * i), dtype)
        self.down_proj = nn.Parameter((e, i, h), dtype)
        self.down_proj_bias = nn.Parameter((e, h), dtype)


class MoE(nn.Module):
    """gpt-oss's MLP (``MoeSpec``). Every expert runs on every token and the router's weights are zero outside
    each token's top k: the same sums as HF's gather / scatter, in a graph without data-dependent shapes (the
    test models are tiny; a production MoE would gather)."""

    def __init__(self, cfg: DecoderConfig, dtype: str, layout: str):
        self.spec, self.dtype, self.hidden = cfg.moe, dtype, cfg.hidden_size
        self.inter = cfg.intermediate_size
        self.router = BiasedLinear(cfg.hidden_size, cfg.moe.num_experts, dtype, layout)
        self.experts = Experts(cfg, dtype)

    def _weights(self, x: Tensor) -> Tensor:
        """``float32[t, E]``: softmax over each token's top-k router logits, 0 elsewhere."""
        logits = self.router(x)
        kth = op.min(op.topk(logits, self.spec.top_k, axis=-1, ret_type="values"), axis=-1, keepdims=True)
        top = op.exp(op.subtract(logits, op.max(logits, axis=-1, keepdims=True)))
        top = op.multiply(top, op.astype(op.greater_equal(logits, kth), "float32"))
        return op.divide(top, op.sum(top, axis=-1, keepdims=True))

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        spec, ex, e, i = self.spec, self.experts, self.spec.num_experts, self.inter
        flat = op.reshape(x, (1, b * s, h))
        gate_up = op.add(op.matmul(flat, ex.gate_up_proj, out_dtype="float32"),
                         op.reshape(cast(ex.gate_up_proj_bias, "float32"), (e, 1, 2 * i)))  # [E, t, 2I]
        gate, up = op.split(op.reshape(gate_up, (e, b * s, i, 2)), 2, axis=-1)
        gate = op.minimum(op.reshape(gate, (e, b * s, i)), _const(spec.swiglu_limit, "float32"))
        up = op.maximum(op.minimum(op.reshape(up, (e, b * s, i)), _const(spec.swiglu_limit, "float32")),
                        _const(-spec.swiglu_limit, "float32"))
        glu = op.multiply(gate, op.sigmoid(op.multiply(gate, _const(spec.swiglu_alpha, "float32"))))
        hidden = cast(op.multiply(op.add(up, _const(1.0, "float32")), glu), self.dtype)
        out = op.add(op.matmul(hidden, ex.down_proj, out_dtype="float32"),
                     op.reshape(cast(ex.down_proj_bias, "float32"), (e, 1, h)))  # [E, t, H]
        w = op.reshape(self._weights(op.reshape(x, (b * s, h))), (b * s, e, 1))
        out = op.sum(op.multiply(op.permute_dims(out, [1, 0, 2]), w), axis=1)
        return cast(op.reshape(out, (b, s, h)), self.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_id: int, dtype: str, layout: str):
        self.sandwich, self.residual = cfg.sandwich_norms, cfg.residual_multiplier
        self.input_layernorm = norm(cfg, cfg.hidden_size, dtype)
        self.self_attn = Attention(cfg, layer_id, dtype, layout)
        self.post_attention_layernorm = norm(cfg, cfg.hidden_size, dtype)
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm follows attention; these wrap the MLP
            self.pre_feedforward_layernorm = norm(cfg, cfg.hidden_size, dtype)
            self.post_feedforward_layernorm = norm(cfg, cfg.hidden_size, dtype)
        if cfg.moe is not None:
            self.mlp = MoE(cfg, dtype, layout)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, layout, hidden_act=cfg.hidden_act)

    def _branch(self, y: Tensor) -> Tensor:
        return y if self.residual == 1.0 else op.multiply(y, _const(self.residual, y.dtype))

    def forward(self, x: Tensor, cache: PagedKVCache, rope=None) -> Tensor:
        a = self.self_attn(self.input_layernorm(x), cache, rope)
        if self.sandwich:
            x = x + self._branch(self.post_attention_layernorm(a))
            return x + self._branch(self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))))
        x = x + self._branch(a)
        return x + self._branch(self.mlp(self.post_attention_layernorm(x)))


class DecoderForCausalLM(CausalLMExports, nn.Module):
    """The shared decoder with a pagedkv cache. ``cfg`` is a ``DecoderConfig`` or a family config with a
    ``decoder_config()`` method (``LlamaConfig``); ``backend`` and ``target`` choose the cache's kernels, ``target``
    also the projections' weight layout (``_common.layout_for``). ``cuda_graph_batch > 0`` (CUDA targets): decode
    steps of up to that many sequences run in CUDA graphs (``CausalLMExports``). ``kv_options``: ``KVCacheConfig``
    fields for the cache beyond the model's (e.g. an FP8 ``kv_dtype`` and its scales)."""

    def __init__(self, cfg: Any, *, dtype: str, target: Any, backend: Any = None, cuda_graph_batch: int = 0,
                 kv_options: dict | None = None):
        self.cfg, self.dtype, self.target, self.backend = cfg, dtype, target, backend
        self.cuda_graph_batch, self.kv_options = cuda_graph_batch, dict(kv_options or {})
        d = cfg if isinstance(cfg, DecoderConfig) else cfg.decoder_config()
        self.decoder_cfg = d
        layout = layout_for(target)
        self.embed_tokens = nn.Embedding(d.vocab_size, d.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList([DecoderLayer(d, i, dtype, layout) for i in range(d.num_hidden_layers)])
        self.norm = norm(d, d.hidden_size, dtype)
        self.lm_head = linear(d.hidden_size, d.vocab_size, dtype, layout)  # float32 logits

    def _body(self, input_ids: Tensor, cache: PagedKVCache) -> Tensor:
        h = self.embed(input_ids, cache)
        if self.decoder_cfg.embedding_multiplier != 1.0:
            # HF Gemma: the normalizer is a tensor of the model dtype (rounded there first)
            h = op.multiply(h, _const(self.decoder_cfg.embedding_multiplier, self.dtype))
        ropes = [None] * len(self.layers)
        if self.decoder_cfg.layer_rope:
            b, s = input_ids.shape
            ropes = _layer_rope_tables(self.decoder_cfg, cache.get_query_positions(b * s))
        for layer, rope in zip(self.layers, ropes):
            h = layer(h, cache, rope)
        return self.norm(h)

    def _logits(self, h: Tensor) -> Tensor:
        logits = self.lm_head(h)
        if self.decoder_cfg.logits_scaling != 1.0:
            logits = op.divide(logits, _const(self.decoder_cfg.logits_scaling, logits.dtype))
        cap = self.decoder_cfg.final_logit_softcap
        return _softcap(logits, cap) if cap else logits

    def prefill(self, input_ids: Tensor, logit_positions: Tensor, cache: PagedKVCache):
        rows = self.checked_rows(logit_positions, input_ids, cache)
        h = op.take(self._body(input_ids, cache), rows, axis=1)
        return self._logits(h), cache

    def decode(self, input_ids: Tensor, cache: PagedKVCache):
        return self._logits(self._body(input_ids, cache)), cache


__all__ = ["DecoderConfig", "DecoderForCausalLM", "MoeSpec"]
