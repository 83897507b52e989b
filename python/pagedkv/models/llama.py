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

from .decoder import DecoderForCausalLM
from .llama_params import LlamaConfig, params_from_hf  # noqa: F401 (re-exported)


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama decoder with a pagedkv cache: the shared decoder (``pagedkv.models.decoder``) with Llama's options
    (``LlamaConfig.decoder_config``); ``backend`` and ``target`` choose the cache's kernels, ``target`` also the
    projections' weight layout (``_common.layout_for``: ``[in, out]`` on the CPU). ``cuda_graph_batch > 0``
    (CUDA targets): decode steps of up to that many sequences run in CUDA graphs (``CausalLMExports``).
    ``kv_options``: ``KVCacheConfig`` fields for the cache beyond the model's (e.g. ``{"kv_dtype": "float8_e4m3fn",
    "k_scale": ...}``: an FP8 cache)."""

    def __init__(self, cfg: LlamaConfig, *, dtype: str, target: Any, backend: Any = None,
                 cuda_graph_batch: int = 0, kv_options: dict | None = None):
        super().__init__(cfg, dtype=dtype, target=target, backend=backend, cuda_graph_batch=cuda_graph_batch,
                         kv_options=kv_options)
