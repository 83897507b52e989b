"""A Llama-architecture Relax ``nn`` model on ``pagedkv.relax.PagedKVCache``.

Exported functions (all take and return the cache object):
- ``create_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
  support_sliding_window)``: one-element shapes, as TVM's and MLC-LLM's engines pass them (the last unused:
  ``CausalLMExports.create_paged_kv_cache``); ``pagedkv.engine.create_cache`` calls it (and a library
  compiled before the fifth argument)
- ``prefill(input_ids[1, n], logit_positions[b], cache) -> logits[1, b, vocab]``: every sequence of the
  batch flattened into one row (the cache's ``begin_forward`` says how many tokens each one has);
  ``logit_positions`` picks the rows whose logits are returned (usually each sequence's last token).
- ``decode(input_ids[b, 1], cache) -> logits[b, 1, vocab]``.

Both check their indices before anything runs: an input id outside ``[0, vocab_size)`` or a logit position
outside ``[0, n)`` raises ``ValueError`` (``CausalLMExports.embed`` / ``checked_rows``), and the caller's
open forward can be taken back with ``pagedkv.abort_forward``.
"""

from __future__ import annotations

from typing import Any

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..relax import PagedKVCache
from ._common import CausalLMExports, GatedMLP, layout_for, linear, proj
from .llama_params import LlamaConfig, params_from_hf  # noqa: F401 (re-exported)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, dtype: str, layout: str):
        self.cfg, self.layer_id = cfg, layer_id
        heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
        self.dtype = dtype
        self.qkv_proj = linear(cfg.hidden_size, heads * cfg.head_dim, dtype, layout)
        self.o_proj = linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, dtype, layout)

    def forward(self, x: Tensor, cache: PagedKVCache) -> Tensor:
        b, s, _ = x.shape
        c = self.cfg
        qkv = op.reshape(proj(self.qkv_proj, x, self.dtype),
                         (b, s, c.num_attention_heads + 2 * c.num_key_value_heads, c.head_dim))
        o = cache.attention_with_fused_qkv(self.layer_id, qkv, c.num_attention_heads, c.head_dim ** -0.5)
        return proj(self.o_proj, op.reshape(o, (b, s, c.num_attention_heads * c.head_dim)), self.dtype)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, dtype: str, layout: str):
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, layer_id, dtype, layout)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False,
                                                   dtype=dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, layout)

    def forward(self, x: Tensor, cache: PagedKVCache) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLMExports, nn.Module):
    """Llama decoder with a pagedkv cache; ``backend`` and ``target`` choose the cache's kernels, ``target``
    also the projections' weight layout (``_common.layout_for``: ``[in, out]`` on the CPU).
    ``cuda_graph_batch > 0`` (CUDA targets): decode steps of up to that many sequences run in CUDA graphs
    (``CausalLMExports``). ``kv_options``: ``KVCacheConfig`` fields for the cache beyond the model's (e.g.
    ``{"kv_dtype": "float8_e4m3fn", "k_scale": ...}``: an FP8 cache)."""

    def __init__(self, cfg: LlamaConfig, *, dtype: str, target: Any, backend: Any = None,
                 cuda_graph_batch: int = 0, kv_options: dict | None = None):
        self.cfg, self.dtype, self.target, self.backend = cfg, dtype, target, backend
        self.cuda_graph_batch, self.kv_options = cuda_graph_batch, dict(kv_options or {})
        layout = layout_for(target)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i, dtype, layout)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False, dtype=dtype)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, dtype, layout)  # float32 logits

    def _body(self, input_ids: Tensor, cache: PagedKVCache) -> Tensor:
        h = self.embed(input_ids, cache)
        for layer in self.layers:
            h = layer(h, cache)
        return self.norm(h)

    def prefill(self, input_ids: Tensor, logit_positions: Tensor, cache: PagedKVCache):
        rows = self.checked_rows(logit_positions, input_ids, cache)
        h = self._body(input_ids, cache)
        h = op.take(h, rows, axis=1)
        return self.lm_head(h), cache

    def decode(self, input_ids: Tensor, cache: PagedKVCache):
        h = self._body(input_ids, cache)
        return self.lm_head(h), cache
