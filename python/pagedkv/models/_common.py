"""Pieces shared by pagedkv's Relax models: float32-accumulating projections and the exported functions'
cache constructor and spec (``prefill`` / ``decode`` / ``create_paged_kv_cache``, whose five arguments are
TVM's and MLC-LLM's).

Projection weights have one of two layouts (``WEIGHT_LAYOUTS``): ``"nk"`` is HF's ``[out, in]`` (``nn.Linear``,
the parameter ``<name>.weight``), ``"kn"`` is ``[in, out]`` (``LinearKN``, the parameter ``<name>.weight_kn``).
CPU models use ``"kn"``: ``nn.Linear`` transposes its weight in every call, which TVM's CPU pipeline runs as a
kernel of its own (the whole model's weights copied once per step), and a matmul over ``[in, out]`` rows
vectorizes along the output without horizontal sums (``pagedkv.cpu_pipeline``). The parameter name says the
layout, so weight loaders (``llama_params.params_from_hf``) need no other record of it.
"""

from __future__ import annotations

from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..relax import PagedKVCache


#: Projection weight layouts: ``"nk"`` = ``[out, in]`` (HF, ``nn.Linear``), ``"kn"`` = ``[in, out]``.
WEIGHT_LAYOUTS = ("nk", "kn")


class LinearKN(nn.Module):
    """A bias-free projection whose weight is stored ``[in, out]`` (parameter ``weight_kn``): ``x @ weight_kn``."""

    def __init__(self, in_features: int, out_features: int, dtype: str, out_dtype: str = "float32"):
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.weight_kn = nn.Parameter((in_features, out_features), dtype)

    def forward(self, x: Tensor) -> Tensor:
        return op.matmul(x, self.weight_kn, out_dtype=self.out_dtype)


def layout_for(target) -> str:
    """The weight layout a model compiled for ``target`` uses: ``"kn"`` on the CPU (``llvm``), else ``"nk"``."""
    from ..target import kind

    return "kn" if kind(target) == "llvm" else "nk"


def linear(in_features: int, out_features: int, dtype: str, layout: str = "nk") -> nn.Module:
    """A bias-free projection that accumulates in float32 (TVM's default float16 matmul accumulates in
    float16, which moved SmolLM2's greedy tokens away from transformers' on the GPU), its weight in
    ``layout`` (``WEIGHT_LAYOUTS``)."""
    if layout == "kn":
        return LinearKN(in_features, out_features, dtype)
    if layout != "nk":
        raise ValueError(f"weight layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype, out_dtype="float32")


def cast(x: Tensor, dtype: str) -> Tensor:
    return x if x.dtype == dtype else op.astype(x, dtype)


def proj(layer: nn.Module, x: Tensor, dtype: str) -> Tensor:
    """``layer(x)`` (float32) cast back to the model dtype."""
    return cast(layer(x), dtype)


class GatedMLP(nn.Module):
    """Gated MLP with gate and up fused into one projection: ``down(act(gate) * up)``, ``act`` SiLU (Llama,
    DeepSeek's dense layers) or ``"gelu_tanh"`` (Gemma's ``gelu_pytorch_tanh``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: str, layout: str = "nk", *,
                 hidden_act: str = "silu"):
        if hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_tanh', got {hidden_act!r}")
        self.dtype, self.hidden_act = dtype, hidden_act
        self.gate_up_proj = linear(hidden_size, 2 * intermediate_size, dtype, layout)
        self.down_proj = linear(intermediate_size, hidden_size, dtype, layout)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(proj(self.gate_up_proj, x, self.dtype), 2, axis=-1)
        act = op.silu(gate) if self.hidden_act == "silu" else op.gelu(gate, approximate="tanh")
        return proj(self.down_proj, act * up, self.dtype)


class CausalLMExports:
    """``create_paged_kv_cache`` and ``get_default_spec`` of a causal LM ``nn.Module`` that has ``cfg`` (with
    ``kv_cache_config(dtype)``), ``dtype``, ``target``, ``backend`` and ``prefill`` / ``decode`` methods.

    A model with ``cuda_graph_batch > 0`` runs its decode step in CUDA graphs for batches of up to that many
    sequences: its cache config carries the bound (``KVCacheConfig.cuda_graph_batch``) and
    ``pagedkv.compile.build_library`` captures the functions of ``CUDA_GRAPH_FUNCTIONS``."""

    #: exported function -> name of its batch-size variable (``get_default_spec``): the functions whose
    #: steps are captured in CUDA graphs, once per batch size, when ``cuda_graph_batch > 0``
    CUDA_GRAPH_FUNCTIONS = {"decode": "b"}
    cuda_graph_batch: int = 0

    def embed(self, input_ids: Tensor, cache: PagedKVCache) -> Tensor:
        """``embed_tokens(input_ids)``, the ids checked against the vocabulary first: the gather is TVM's
        unchecked ``take``, which would crash the process on an id past the vocabulary and read another row
        for a negative one; the check raises ``ValueError`` naming the id (``PagedKVCache.check_indices``)."""
        ids = cache.check_indices(input_ids, "input_ids", self.cfg.vocab_size, "vocab_size")
        return self.embed_tokens(ids)

    @staticmethod
    def checked_rows(logit_positions: Tensor, input_ids: Tensor, cache: PagedKVCache) -> Tensor:
        """``logit_positions`` of ``prefill``, checked to pick rows of the ``n`` input tokens (the same
        unchecked ``take`` gathers them). Call it before the layers, so a bad row is reported before the
        forward's k/v are written."""
        return cache.check_indices(logit_positions, "logit_positions", input_ids.shape[1],
                                   "n (the number of input tokens)")

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                              support_sliding_window: tirx.Var | None = None) -> PagedKVCache:
        """The cache, its capacity given at run time; the call shape of TVM's and MLC-LLM's models (and engines:
        MLC's passes these five one-element shapes).

        ``support_sliding_window`` is accepted and not used: in TVM it lets an engine turn on a sliding window per
        sequence later; pagedkv's window is the config's ``sliding_window``, on for every sequence already (an
        engine's ``EnableSlidingWindowForSeq`` asking for it is a no-op, anything else is refused at run time).
        """
        del support_sliding_window
        values = {"max_batch_size": max_batch_size, "max_total_seq_len": max_total_seq_len,
                  "prefill_chunk_size": prefill_chunk_size, "page_size": page_size}
        config = self.cfg.kv_cache_config(self.dtype)
        if getattr(self, "kv_options", None):  # e.g. an FP8 cache: kv_dtype and its scales (KVCacheConfig fields)
            config = config.replace(**self.kv_options)
        if self.cuda_graph_batch:
            config = config.replace(cuda_graph_batch=self.cuda_graph_batch)
        return PagedKVCache(config, target=self.target, backend=self.backend, runtime_values=values)

    def get_default_spec(self):
        none = {"$": {"param_mode": "none", "effect_mode": "none"}}
        packed = {"$": {"param_mode": "packed", "effect_mode": "none"}}
        return nn.spec.ModuleSpec.from_raw({
            "prefill": {"input_ids": nn.spec.Tensor([1, "n"], "int32"),
                        "logit_positions": nn.spec.Tensor(["b"], "int32"),
                        "cache": nn.spec.Object(object_type=PagedKVCache), **packed},
            "decode": {"input_ids": nn.spec.Tensor(["b", 1], "int32"),
                       "cache": nn.spec.Object(object_type=PagedKVCache), **packed},
            "create_paged_kv_cache": {"max_batch_size": int, "max_total_seq_len": int,
                                      "prefill_chunk_size": int, "page_size": int, "support_sliding_window": int,
                                      **none},
        }, self)
