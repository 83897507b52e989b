"""A DeepSeek-V3 Relax ``nn`` model (MLA attention, dense MLPs) on ``pagedkv.relax.PagedKVCache``.

The cache holds one latent vector per token and layer: ``concat(kv_a_layernorm(compressed_kv), rope(k_pe))``
(``kv_lora_rank + qk_rope_head_dim`` elements). Attention, per layer:

- prefill: ``append_mla_kv`` writes the new latents; ``self_attention`` is plain causal multi-head
  attention among the forward's new tokens, with k / v expanded from the latents by ``kv_b_proj`` (here the
  ``w_uk`` / ``w_uv`` halves of it); ``cross_attention`` is the absorbed attention of
  ``[q_nope @ W_UK, q_pe]`` over the latents cached before this forward, its output projected by ``W_UV``;
  the two attention states are merged.
- decode (every sequence appends one token): ``append_mla_kv``, then ``cross_attention`` over the whole
  cache (the new token included), projected by ``W_UV``.

Exported functions (all take and return the cache object), as ``pagedkv.models.llama``'s:
- ``create_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
  support_sliding_window)``: one-element shapes, as TVM's and MLC-LLM's engines pass them (the last unused:
  ``CausalLMExports.create_paged_kv_cache``); ``pagedkv.engine.create_cache`` calls it (and a library
  compiled before the fifth argument)
- ``prefill(input_ids[1, n], logit_positions[b], cache) -> logits[1, b, vocab]``
- ``decode(input_ids[b, 1], cache) -> logits[b, 1, vocab]``

Either function is correct for any forward: in a forward where every sequence appends one token (a decode
forward) ``cross_attention`` already covers the new tokens and ``self_attention`` returns the empty state,
so ``prefill``'s merge equals ``decode``'s cross-only path; ``decode`` skips the extra work.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.script import tirx as T

from ..relax import PagedKVCache
from ._common import CausalLMExports, GatedMLP, cast, linear, proj
from .deepseek_v3_params import DeepseekV3Config, params_from_hf, params_from_state_dict  # noqa: F401


def _expand(latent: Tensor, w: Tensor, dtype: str) -> Tensor:
    """``latent[t, r]`` times every head's ``w[h, d, r]`` -> ``[t, h * d]`` (a linear layer with the weight
    viewed as ``[h * d, r]``), accumulated in float32."""
    h, d, r = w.shape
    return cast(op.matmul(latent, op.permute_dims(op.reshape(w, (h * d, r))), out_dtype="float32"), dtype)


def _rope_tables_func(half: int, attention_factor: float) -> tirx.PrimFunc:
    """``cos`` / ``sin`` of ``pos[t] * inv_freq[i]`` (``float32[n, half]``), times the YaRN attention
    factor, as HF computes them (a float32 angle; cos/sin scaled after). ``pos`` comes from the cache's
    ``get_query_positions``, a view into the cache's index buffer; it is matched with a symbolic
    ``elem_offset`` so that no layout of that buffer can break the model."""
    scale = float(attention_factor)

    @T.prim_func(private=True, s_tir=True)
    def mla_rope_tables(var_pos: T.handle, freq: T.Buffer((half,), "float32"), var_cos: T.handle,
                        var_sin: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        pos = T.match_buffer(var_pos, (n,), "int32", elem_offset=T.int64())
        cos = T.match_buffer(var_cos, (n, half), "float32")
        sin = T.match_buffer(var_sin, (n, half), "float32")
        for t, i in T.grid(n, half):
            with T.sblock("rope_tables"):
                v_t, v_i = T.axis.remap("SS", [t, i])
                T.reads(pos[v_t], freq[v_i])
                T.writes(cos[v_t, v_i], sin[v_t, v_i])
                cos[v_t, v_i] = T.cos(T.Cast("float32", pos[v_t]) * freq[v_i]) * T.float32(scale)
                sin[v_t, v_i] = T.sin(T.Cast("float32", pos[v_t]) * freq[v_i]) * T.float32(scale)

    return mla_rope_tables


def _rope_tables(positions: Tensor, inv_freq: np.ndarray, attention_factor: float) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, ``float32[T, rope // 2]``, for the forward's query positions."""
    half = int(inv_freq.shape[0])
    freq = Tensor.from_const(np.ascontiguousarray(inv_freq, dtype=np.float32))
    (t,) = positions.shape
    out = [Tensor.placeholder((t, half), "float32", name="rope_cos"),
           Tensor.placeholder((t, half), "float32", name="rope_sin")]
    cos, sin = op.tensor_ir_op(_rope_tables_func(half, attention_factor), "mla_rope_tables",
                               args=[positions, freq], out=out)
    return cos, sin


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool, dtype: str) -> Tensor:
    """Rotate ``x[T, H, rope]`` by the tables ``[T, rope // 2]``, exactly as HF DeepseekV3: with
    ``rope_interleave`` the pairs are ``(x[2i], x[2i+1])`` and the result is laid out de-interleaved
    (``[rotated evens, rotated odds]``, HF ``apply_rotary_pos_emb_interleave``); without it the pairs are
    ``(x[i], x[i + rope/2])`` (``rotate_half``). q and k go through the same map, so their dot products are
    those of the paper's RoPE."""
    t, h, d = x.shape
    half = d // 2
    x = cast(x, "float32")
    if interleave:
        x1, x2 = op.split(op.reshape(x, (t, h, half, 2)), 2, axis=-1)
        x1, x2 = op.reshape(x1, (t, h, half)), op.reshape(x2, (t, h, half))
    else:
        x1, x2 = op.split(x, 2, axis=-1)
    c, s = op.reshape(cos, (t, 1, half)), op.reshape(sin, (t, 1, half))
    out = op.concat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return cast(out, dtype)


class DeepseekV3Attention(nn.Module):  # pylint: disable=too-many-instance-attributes
    """Multi-head latent attention on the paged latent cache."""

    def __init__(self, cfg: DeepseekV3Config, layer_id: int, dtype: str):
        self.cfg, self.layer_id, self.dtype = cfg, layer_id, dtype
        h = cfg.num_attention_heads
        # q_a_proj (or the whole q_proj) and kv_a_proj_with_mqa both read the layer input: one GEMM.
        self.fused_qkv_a_proj = linear(cfg.hidden_size, cfg.q_a_dim + cfg.latent_dim, dtype)
        if cfg.q_lora_rank is not None:
            self.q_a_layernorm = nn.RMSNorm(cfg.q_lora_rank, -1, cfg.LORA_NORM_EPS, bias=False, dtype=dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, h * cfg.qk_head_dim, dtype)
        self.kv_a_layernorm = nn.RMSNorm(cfg.kv_lora_rank, -1, cfg.LORA_NORM_EPS, bias=False, dtype=dtype)
        # HF kv_b_proj.weight [H * (nope + v), kv_lora_rank] viewed per head as [H, nope + v, kv_lora_rank]:
        # its nope rows are W_UK (latent -> k_nope), its v rows W_UV (latent -> v).
        self.w_uk = nn.Parameter((h, cfg.qk_nope_head_dim, cfg.kv_lora_rank), dtype=dtype)
        self.w_uv = nn.Parameter((h, cfg.v_head_dim, cfg.kv_lora_rank), dtype=dtype)
        self.o_proj = linear(h * cfg.v_head_dim, cfg.hidden_size, dtype)

    def forward(self, x: Tensor, cache: PagedKVCache, rope: tuple[Tensor, Tensor],
                mode: str) -> tuple[Tensor, PagedKVCache]:
        c, dtype = self.cfg, self.dtype
        b, s, _ = x.shape
        t = b * s
        h, nope, rope_dim, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        # softmax scale of both attentions: the absorbed score [q_nope W_UK, q_pe] . [latent, k_pe] equals the
        # non-absorbed q_nope . k_nope + q_pe . k_pe, so both use HF's scaling: 1/sqrt(nope + rope), times
        # mscale^2 under YaRN (DeepseekV3Config.sm_scale).
        sm_scale = c.sm_scale

        qa, kv_a = op.split(proj(self.fused_qkv_a_proj, x, dtype), [c.q_a_dim], axis=-1)
        q = proj(self.q_b_proj, self.q_a_layernorm(qa), dtype) if c.q_lora_rank is not None else qa
        q = op.reshape(q, (t, h, c.qk_head_dim))
        q_nope, q_pe = op.split(q, [nope], axis=-1)
        compressed, k_pe = op.split(op.reshape(kv_a, (t, c.latent_dim)), [r], axis=-1)
        compressed = self.kv_a_layernorm(compressed)

        cos, sin = rope
        q_pe = _apply_rope(q_pe, cos, sin, c.rope_interleave, dtype)  # [t, h, rope]
        k_pe = _apply_rope(op.reshape(k_pe, (t, 1, rope_dim)), cos, sin, c.rope_interleave, dtype)
        k_pe = op.reshape(k_pe, (t, rope_dim))

        latent = op.concat([compressed, k_pe], dim=-1)  # [t, kv_lora_rank + rope]
        cache = cache.append_mla_kv(self.layer_id, op.reshape(latent, (b, s, c.latent_dim)))

        # Absorbed query: q_nope [t, h, nope] -> per head @ W_UK[h] [nope, r] -> [t, h, r], then [.., q_pe].
        q_abs = op.matmul(op.permute_dims(q_nope, [1, 0, 2]), self.w_uk, out_dtype="float32")  # [h, t, r]
        q_abs = cast(op.permute_dims(q_abs, [1, 0, 2]), dtype)
        q_cross = op.reshape(op.concat([q_abs, q_pe], dim=-1), (b, s, h, r + rope_dim))
        o_lat, lse_cross = cache.cross_attention(self.layer_id, q_cross, r, sm_scale)  # o_lat [b, s, h, r]
        # Output of the absorbed attention is a latent per head: project by W_UV[h]^T [r, v].
        o_lat = op.permute_dims(op.reshape(o_lat, (t, h, r)), [1, 0, 2])  # [h, t, r]
        o_cross = op.matmul(o_lat, op.permute_dims(self.w_uv, [0, 2, 1]), out_dtype="float32")  # [h, t, v]
        o_cross = op.reshape(cast(op.permute_dims(o_cross, [1, 0, 2]), dtype), (b, s, h, c.v_head_dim))

        if mode == "prefill":
            # Non-absorbed attention among this forward's tokens: k_nope / v from the latent by kv_b_proj.
            k_nope = op.reshape(_expand(compressed, self.w_uk, dtype), (t, h, nope))
            v = _expand(compressed, self.w_uv, dtype)
            k = op.concat([k_nope, op.broadcast_to(op.reshape(k_pe, (t, 1, rope_dim)), (t, h, rope_dim))],
                          dim=-1)
            q_self = op.reshape(op.concat([q_nope, q_pe], dim=-1), (b, s, h, c.qk_head_dim))
            k = op.reshape(k, (b, s, h, c.qk_head_dim))
            o_self, lse_self = cache.self_attention(self.layer_id, q_self, k,
                                                    op.reshape(v, (b, s, h, c.v_head_dim)), sm_scale)
            o, _ = cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)
        else:
            o = o_cross
        out = proj(self.o_proj, op.reshape(o, (b, s, h * c.v_head_dim)), dtype)
        return out, cache


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, layer_id: int, dtype: str):
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False, dtype=dtype)
        self.self_attn = DeepseekV3Attention(cfg, layer_id, dtype)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False,
                                                   dtype=dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype)

    def forward(self, x: Tensor, cache: PagedKVCache, rope, mode: str) -> tuple[Tensor, PagedKVCache]:
        a, cache = self.self_attn(self.input_layernorm(x), cache, rope, mode)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class DeepseekV3ForCausalLM(CausalLMExports, nn.Module):
    """DeepSeek-V3 decoder (dense MLPs) with a pagedkv MLA cache; ``backend`` and ``target`` choose the
    cache's kernels."""

    def __init__(self, cfg: DeepseekV3Config, *, dtype: str, target: Any, backend: Any = None):
        self.cfg, self.dtype, self.target, self.backend = cfg, dtype, target, backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList([DeepseekV3DecoderLayer(cfg, i, dtype)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False, dtype=dtype)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, dtype)  # float32 logits

    def _body(self, input_ids: Tensor, cache: PagedKVCache, mode: str) -> tuple[Tensor, PagedKVCache]:
        b, s = input_ids.shape
        positions = cache.get_query_positions(b * s)
        rope = _rope_tables(positions, self.cfg.rope_inv_freq(), self.cfg.rope_attention_factor())
        h = self.embed(input_ids, cache)
        for layer in self.layers:
            h, cache = layer(h, cache, rope, mode)
        return self.norm(h), cache

    def prefill(self, input_ids: Tensor, logit_positions: Tensor, cache: PagedKVCache):
        rows = self.checked_rows(logit_positions, input_ids, cache)
        h, cache = self._body(input_ids, cache, "prefill")
        h = op.take(h, rows, axis=1)
        return self.lm_head(h), cache

    def decode(self, input_ids: Tensor, cache: PagedKVCache):
        h, cache = self._body(input_ids, cache, "decode")
        return self.lm_head(h), cache
