"""``KVCacheConfig``: the named, versioned configuration of a paged KV cache.

The config travels into compiled libraries as JSON (``to_json``) with a ``schema_version``. The runtime
reads it by field name, so adding a field never breaks a library compiled earlier (see the versioning rule
in ``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import config_schema, kv_scales
from .config_schema import (  # noqa: F401 (the config's vocabulary: schema versions and field names by schema)
    ATTENTION_OPTION_FIELDS, FP8_FIELDS, FP8_SCHEMA, MLA_FIELDS, RUNTIME_FIELDS, SCHEMA_VERSION, SINK_FIELDS)
from .kv_scales import FP8_E4M3_MAX, FP8_KV_DTYPES  # noqa: F401 (the config's vocabulary)
from .layer_groups import LayerGroup, as_groups, cover_problems, group_problems
from .rope_spec import RopeSpec

DTYPES = ("float16", "float32", "bfloat16")
ROPE_MODES = ("none", "normal", "inline")
LAYER_KINDS = ("mha", "mla")

#: Token slots a cache may hold: slot indices (page * page_size + offset) are int32 in the kernel ABI.
MAX_SLOTS = 2**31 - 1


def _positive_finite(value) -> bool:
    """Whether ``value`` is a real number (numpy scalars too; not a bool), finite and > 0."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def check_sm_scale(sm_scale, where: str) -> float:
    """``sm_scale`` as a float, after checking it is a finite number > 0.

    The attention kernels take any float: NaN or inf gives NaN or meaningless weights, zero uniform ones, a
    negative value inverts the softmax, all without an error. The Python cache methods and the Relax
    constructor call this before anything runs; the runtime checks again (``src/attention.cc``).

    Parameters
    ----------
    sm_scale :
        The softmax scale (usually ``head_dim ** -0.5``): a number, or anything ``float()`` converts but a
        bool or a string (numpy scalars, one-element tensors).
    where :
        The method, named in the error.

    Raises
    ------
    TypeError
        ``sm_scale`` is not a number.
    ValueError
        ``sm_scale`` is NaN, infinite, zero or negative.
    """
    if isinstance(sm_scale, (bool, str, bytes)) or not hasattr(sm_scale, "__float__"):
        raise TypeError(f"{where}: sm_scale must be a float (the softmax scale, usually head_dim ** -0.5), "
                        f"got {type(sm_scale).__name__} {sm_scale!r}")
    value = float(sm_scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: sm_scale must be a finite number > 0 (the softmax scale, usually "
                         f"head_dim ** -0.5), got {sm_scale!r}")
    return value


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape and policy of one paged KV cache.

    Parameters
    ----------
    num_layers, num_qo_heads, num_kv_heads, head_dim :
        Model dims. ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (GQA group size).
    v_head_dim :
        Head dim of V; ``None`` means ``head_dim``.
    dtype :
        Storage dtype of pages and of q/k/v/o tensors.
    rope_mode :
        ``"none"``: no rotary embedding; ``"normal"``: q and k are rotated when qkv is split (k is stored
        rotated); ``"inline"``: k is stored unrotated and the attention kernels rotate q and k.
    rope_theta, rope_scale :
        RoPE base and position multiplier (angle = pos * rope_scale / rope_theta ** (2i / head_dim)); both
        finite and > 0.
    rope :
        The RoPE variant (``pagedkv.rope_spec.RopeSpec``: llama3, yarn, longrope, linear scaling, a partial
        ``rotary_dim``, interleaved pairs); the default ``RopeSpec()`` is plain RoPE over the whole head. A
        mapping is read with ``RopeSpec.from_dict``; ``hf_rope_fields`` builds it from a transformers config.
        Checked whatever the ``rope_mode``, as ``rope_theta`` is.
    page_size :
        Tokens per page (>= 1; 16 is the usual choice).
    max_batch_size, max_total_seq_len, prefill_chunk_size :
        Capacity: sequences per forward, tokens the pool holds (rounded up to pages per sequence), tokens
        appended in one forward.
    layer_kinds :
        One kind per layer; ``None`` means every layer is ``"mha"``. A cache holds one kind: ``"mha"``
        layers, or ``"mla"`` layers (DeepSeek multi-head latent attention; build those configs with
        :meth:`mla`).
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim :
        MLA dims (0 for MHA). An MLA page holds one latent vector of ``kv_lora_rank + qk_rope_head_dim``
        elements per token; the absorbed attention (``cross_attention``) uses it as the key and its first
        ``kv_lora_rank`` elements as the value. ``head_dim`` (= nope + rope) and ``v_head_dim`` are the dims
        of the non-absorbed attention among new tokens (``self_attention``), over ``num_kv_heads`` =
        ``num_qo_heads`` heads.
    sliding_window :
        0: off. Else every query attends only to the ``sliding_window`` most recent positions up to its
        own (keys with ``q_pos - k_pos < sliding_window``; HF's and Mistral's definition), in every layer.
        A windowed cache attends each sequence's whole chain in one pass (no shared-prefix passes; see
        ``docs/ARCHITECTURE.md``, "Attention options"); pages outside the window are kept here (a sliding
        layer group gives them back). Per-layer windows
        (with window-sized memory) are ``layer_groups``.
    logits_soft_cap :
        0: off. Else attention scores ``s = sm_scale * q.k`` become ``cap * tanh(s / cap)`` before the
        softmax (Gemma-2's definition).
    cuda_graph_batch :
        0: off. Else the model library runs its decode step in CUDA graphs for batches of up to this many
        sequences (``pagedkv.compile.build_library`` of a model built with ``cuda_graph_batch``): every decode
        forward keeps its index arrays at fixed device addresses, attends each sequence's chain in one pass,
        and plans FlashInfer with ``enable_cuda_graph``; ``max_batch_size`` may not exceed it. MHA only.
    attention_sinks :
        False: off. True: the attention calls may take learnable sinks (gpt-oss): ``sinks[num_qo_heads]``
        (float32), one more softmax logit per query head whose value is 0, in natural log and beside the scaled
        scores ``sm_scale * q.k``. The op table then holds the sink ops (``pagedkv.ops.SINK_OPS``), which merge
        the sink once into each call's final state (``docs/ARCHITECTURE.md``, "Attention sinks"). MHA and MLA.
    sink_size :
        0: off. StreamingLLM sink tokens: with a ``sliding_window`` (``sink_size <= sliding_window``), every query
        also sees the first ``sink_size`` tokens of its sequence (a fork's are its parent's). Read by extra passes
        of the window kernels over each sequence's first pages (the kernels do not change). With ``layer_groups``:
        every sliding group's layers (``sink_size <=`` the smallest group window), whose page pools keep those
        pages. Not with ``cuda_graph_batch``.
    layer_groups :
        ``None``: every layer alike (the config's ``sliding_window``). Else the layers in groups
        (``pagedkv.layer_groups.LayerGroup``: full attention or a sliding window of its own; build them from a
        per-layer window list with ``layer_groups_from_windows``): each layer runs with its group's window, and a
        sliding group keeps window-sized memory in a page pool of its own (``docs/ARCHITECTURE.md``, "Layer
        groups"). The top-level ``sliding_window`` is then 0; not with ``cuda_graph_batch`` or MLA.
        A list, or mappings of ``LayerGroup`` fields, are converted.
    kv_dtype :
        The page storage dtype: ``None`` (the default, also what ``kv_dtype=dtype`` is stored as) is ``dtype``; ``"float8_e4m3fn"`` stores K and V (MLA: the
        latent) as e4m3 bytes, half the memory of fp16, with ``dtype`` (fp16 / bf16 / fp32) for q, k, v and o.
        Appends store ``e4m3(clamp(x / scale, -448, 448))`` (round to nearest even); the kernels read
        ``code * scale``. Served by the TIR CPU kernels (``pagedkv backends`` says who refuses it and why).
    k_scale, v_scale :
        MHA FP8 scales: one float (per tensor) or a tuple of ``num_kv_heads`` floats (per kv head), finite and
        > 0, the same in every layer. The kernels fold ``k_scale`` into the scores and ``v_scale`` into ``o``.
        1.0 and only 1.0 without an FP8 ``kv_dtype``. From a checkpoint: :meth:`with_kv_scales`.
    ckv_scale, kpe_scale :
        MLA FP8 scales (per tensor, FlashInfer's names): ``ckv_scale`` of the latent's first ``kv_lora_rank``
        elements (key and value of the absorbed attention), ``kpe_scale`` of its rope part (key only).
    schema_version :
        ``None``: the lowest schema that holds this config (1 for MHA, 2 for MLA, 3 with an attention
        option, 4 with ``cuda_graph_batch``, 5 with ``attention_sinks`` or ``sink_size``, 6 with a ``rope``
        variant, 7 with ``layer_groups``, ``FP8_SCHEMA`` with an FP8 ``kv_dtype``).
    """

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    v_head_dim: int | None = None
    rope_mode: str = "normal"
    rope_theta: float = 10000.0
    rope_scale: float = 1.0
    page_size: int = 16
    max_batch_size: int = 1
    max_total_seq_len: int = 4096
    prefill_chunk_size: int = 2048
    layer_kinds: tuple[str, ...] | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    sliding_window: int = 0
    logits_soft_cap: float = 0.0
    cuda_graph_batch: int = 0
    attention_sinks: bool = False
    sink_size: int = 0
    rope: RopeSpec = RopeSpec()
    kv_dtype: str | None = None
    k_scale: float | tuple[float, ...] = 1.0
    v_scale: float | tuple[float, ...] = 1.0
    ckv_scale: float = 1.0
    kpe_scale: float = 1.0
    layer_groups: tuple[LayerGroup, ...] | None = None
    schema_version: int | None = field(default=None)

    def __post_init__(self) -> None:
        if self.kv_dtype == self.dtype:  # the default, said explicitly: kept as None so replace(dtype=) follows
            object.__setattr__(self, "kv_dtype", None)
        for name in ("k_scale", "v_scale"):
            object.__setattr__(self, name, kv_scales.as_scale(getattr(self, name)))
        if self.rope is None:
            object.__setattr__(self, "rope", RopeSpec())
        elif isinstance(self.rope, Mapping):
            object.__setattr__(self, "rope", RopeSpec.from_dict(self.rope))
        if isinstance(self.rope, RopeSpec) and self.rope.rotary_dim and self.rope.rotary_dim == self.head_dim:
            # the whole head, said explicitly: stored as 0 so that the config keeps its lowest schema
            object.__setattr__(self, "rope", dataclasses.replace(self.rope, rotary_dim=0))
        object.__setattr__(self, "layer_groups", as_groups(self.layer_groups))
        if self.schema_version is None:
            object.__setattr__(self, "schema_version", self.min_schema)
        problems = self.problems()
        if problems:
            raise ValueError("invalid KVCacheConfig: " + "; ".join(problems))

    # -- validation -----------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every reason this config is invalid (empty when valid)."""
        out = []
        for name in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "max_batch_size",
                     "max_total_seq_len", "prefill_chunk_size", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                out.append(f"{name} must be a positive int, got {value!r}")
        if not out and self.num_qo_heads % self.num_kv_heads:
            out.append(f"num_qo_heads ({self.num_qo_heads}) is not a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")
        if not out:
            pages = self.num_pages
            if pages * self.page_size > MAX_SLOTS:
                out.append(f"max_total_seq_len={self.max_total_seq_len} with page_size={self.page_size} and "
                           f"max_batch_size={self.max_batch_size} needs {pages} pages = {pages * self.page_size} "
                           f"token slots; slot indices are int32 in the kernel ABI (at most {MAX_SLOTS})")
        if self.dtype not in DTYPES:
            out.append(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.rope_mode not in ROPE_MODES:
            out.append(f"rope_mode {self.rope_mode!r} not in {ROPE_MODES}")
        if self.v_head_dim is not None and self.v_head_dim != self.head_dim and not self.is_mla:
            out.append("v_head_dim != head_dim needs MLA layers")
        if (isinstance(self.head_dim, int) and self.rope_mode != "none" and self.head_dim % 2
                and not getattr(self.rope, "rotary_dim", 0)):
            out.append(f"RoPE (rope_mode {self.rope_mode!r}) rotates the two halves of a head and needs an even "
                       f"head_dim, got {self.head_dim}; an odd head_dim takes rope_mode 'none'")
        if self.layer_kinds is not None:
            if len(self.layer_kinds) != self.num_layers:
                out.append(f"layer_kinds has {len(self.layer_kinds)} entries for {self.num_layers} layers")
            bad = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
            if bad:
                out.append(f"unknown layer kinds {bad}; known: {LAYER_KINDS}")
            elif len(set(self.layer_kinds)) > 1:
                out.append("a cache holds one layer kind; got 'mha' at layers "
                           f"{[i for i, k in enumerate(self.layer_kinds) if k == 'mha']} and 'mla' at "
                           f"{[i for i, k in enumerate(self.layer_kinds) if k == 'mla']} (use two caches)")
        out += self._rope_problems()
        out += self._fp8_problems()
        out += self._mla_problems()
        out += self._option_problems()
        out += self._group_problems()
        need = self.min_schema
        if not isinstance(self.schema_version, int) or not need <= self.schema_version <= SCHEMA_VERSION:
            out.append(f"schema_version {self.schema_version} is outside [{need}, {SCHEMA_VERSION}] "
                       f"(this config needs schema {need}; this package writes up to {SCHEMA_VERSION})")
        return out

    def _rope_problems(self) -> list[str]:
        # Both enter every rotation angle (pos * rope_scale / rope_theta ** (2i / head_dim)): NaN, inf, zero or a
        # negative value gives NaN or meaningless angles without an error. Checked whatever the rope_mode, as
        # the runtime does (src/config.cc).
        out = [f"{name} must be a finite number > 0, got {value!r}"
               for name, value in (("rope_theta", self.rope_theta), ("rope_scale", self.rope_scale))
               if not _positive_finite(value)]
        if not isinstance(self.rope, RopeSpec):
            return out + [f"rope must be a pagedkv.rope_spec.RopeSpec, got {type(self.rope).__name__}"]
        out += [f"rope: {p}" for p in self.rope.problems(self.head_dim)]
        if self.rope.rope_type == "longrope" and self.cuda_graph_batch:
            out.append("rope_type 'longrope' with cuda_graph_batch is not supported: its short / long switch is a "
                       "per-forward kernel argument, which a captured CUDA graph would freeze")
        return out

    def _fp8_problems(self) -> list[str]:
        return kv_scales.problems(self)

    def scales_of(self, name: str) -> tuple[float, ...]:
        """Scale field ``name`` as a tuple: one value (per tensor) or one per kv head."""
        value = getattr(self, name)
        return tuple(float(v) for v in value) if isinstance(value, tuple) else (float(value),)

    @property
    def page_dtype(self) -> str:
        """What the pages hold: ``kv_dtype``, or ``dtype`` when that is ``None``."""
        return self.kv_dtype or self.dtype

    @property
    def fp8(self) -> bool:
        """Whether the pages hold FP8 bytes (``kv_dtype`` is one of ``FP8_KV_DTYPES``)."""
        return self.page_dtype in FP8_KV_DTYPES

    def with_kv_scales(self, **scales) -> "KVCacheConfig":
        """A copy with a checkpoint's FP8 scales by name (``k_scale`` / ``v_scale``, or MLA's ``ckv_scale`` /
        ``kpe_scale``): numbers or arrays of shape ``()``, ``[1]``, ``[num_kv_heads]``, or per layer with every
        layer equal (``pagedkv.kv_scales.from_checkpoint``, which says what it refuses and raises)."""
        return self.replace(**kv_scales.from_checkpoint(self, scales))

    def _mla_problems(self) -> list[str]:
        dims = {name: getattr(self, name) for name in MLA_FIELDS}
        if not self.is_mla:
            given = [name for name, value in dims.items() if value != 0]
            return [f"{', '.join(given)} need MLA layers (layer_kinds 'mla')"] if given else []
        out = [f"MLA needs {name} >= 1, got {value!r}" for name, value in dims.items()
               if not isinstance(value, int) or value < 1]
        if self.rope_mode != "none":
            out.append(f"MLA needs rope_mode 'none', got {self.rope_mode!r}: the model rotates the rope "
                       "part of q and of the latent itself before append_mla_kv")
        if out:
            return out
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            out.append(f"MLA head_dim ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
                       f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim})")
        if self.num_kv_heads != self.num_qo_heads:
            out.append(f"MLA num_kv_heads ({self.num_kv_heads}) must equal num_qo_heads "
                       f"({self.num_qo_heads}): the non-absorbed self_attention is plain multi-head")
        return out

    def _option_problems(self) -> list[str]:
        out = []
        w, cap = self.sliding_window, self.logits_soft_cap
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            out.append(f"sliding_window must be an int >= 0 (0: off), got {w!r}")
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap < 0:
            out.append(f"logits_soft_cap must be a finite number >= 0 (0: off), got {cap!r}")
        if self.is_mla and (w or cap):
            out.append("MLA caches take no sliding_window or logits_soft_cap (no MLA model uses them and no "
                       "MLA kernel implements them)")
        g = self.cuda_graph_batch
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            out.append(f"cuda_graph_batch must be an int >= 0 (0: off), got {g!r}")
        elif g and self.is_mla:
            out.append("cuda_graph_batch is not supported for MLA caches yet (CUDA-graph decode is implemented "
                       "for MHA layers only)")
        elif g and isinstance(self.max_batch_size, int) and self.max_batch_size > g:
            out.append(f"max_batch_size={self.max_batch_size} is larger than cuda_graph_batch={g} (the most "
                       "sequences the CUDA-graph decode step is compiled for)")
        if not isinstance(self.attention_sinks, bool):
            out.append(f"attention_sinks must be a bool, got {self.attention_sinks!r}")
        return out + self._sink_token_problems()

    def _sink_token_problems(self) -> list[str]:
        # The sink tokens are read by the window kernels in passes of their own, each entry of which must lie in
        # one window (src/forward_plan.h): so a window, and sink_size <= sliding_window.
        s, w = self.sink_size, self.sliding_window
        if self.layer_groups is not None and not w:  # every sliding group keeps them: the smallest window bounds them
            w = min(self.group_windows, default=0) if not cover_problems(self.layer_groups, self.num_layers) else 0
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            return [f"sink_size must be an int >= 0 (0: off), got {s!r}"]
        if not s:
            return []
        if not w:
            return [f"sink_size {s} needs a sliding_window (sink tokens stay visible beside the window; without one "
                    "every token is)"]
        out = [f"sink_size {s} must be <= sliding_window {w}"] if isinstance(w, int) and s > w else []
        if self.cuda_graph_batch:
            out.append("sink_size with cuda_graph_batch is not implemented (a CUDA-graph decode's fixed layout holds "
                       "one pass; sink tokens add one)")
        return out

    def _group_problems(self) -> list[str]:
        return group_problems(self)

    # -- derived ----------------------------------------------------------------------------------------
    def layer_window(self, layer: int) -> int:
        """The sliding window of ``layer`` (0: full attention): its group's, or the config's."""
        if self.layer_groups is None:
            return self.sliding_window
        return next(g.sliding_window for g in self.layer_groups if layer in g.layers)

    @property
    def group_windows(self) -> tuple[int, ...]:
        """The distinct sliding windows > 0 of the layer groups, ascending (each has its kernels and page pool)."""
        return tuple(sorted({g.sliding_window for g in self.layer_groups or () if g.sliding_window}))

    def window_config(self, window: int) -> "KVCacheConfig":
        """The config whose kernels serve the layers of ``window`` (0: full attention): this one without groups,
        with ``sliding_window = window`` (so groups of equal windows share kernels with plain windowed caches)."""
        return self.replace(layer_groups=None, sliding_window=window, sink_size=self.sink_size if window else 0)

    @property
    def min_schema(self) -> int:
        """The lowest schema that holds this config."""
        if self.kv_dtype is not None:
            return FP8_SCHEMA
        if self.layer_groups is not None:
            return 7
        if isinstance(self.rope, RopeSpec) and not self.rope.is_default:
            return 6
        if self.attention_sinks or self.sink_size:
            return 5
        if self.cuda_graph_batch:
            return 4
        if self.sliding_window or self.logits_soft_cap:
            return 3
        return 2 if self.is_mla else 1

    @property
    def windowed(self) -> bool:
        return bool(self.sliding_window)

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def num_pages(self) -> int:
        """KV pages the runtime allocates (``src/paged_kv_cache.cc``): ``ceil(max_total_seq_len / page_size)`` plus
        one a sequence (each sequence's last page may be partly filled)."""
        return -(-self.max_total_seq_len // self.page_size) + self.max_batch_size

    @property
    def is_mla(self) -> bool:
        """Whether the layers are MLA (a cache holds one kind)."""
        return self.layer_kinds is not None and "mla" in self.layer_kinds

    @property
    def latent_dim(self) -> int:
        """Elements per token of an MLA page: ``kv_lora_rank + qk_rope_head_dim`` (0 for MHA)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else 0

    @classmethod
    def mla(cls, *, num_layers: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
            qk_rope_head_dim: int, v_head_dim: int, **kwargs) -> "KVCacheConfig":
        """An MLA cache (DeepSeek-V2/V3): every layer ``"mla"``, ``rope_mode="none"``.

        ``kwargs`` are the other fields (dtype, page_size, capacity...).
        """
        return cls(num_layers=num_layers, num_qo_heads=num_heads, num_kv_heads=num_heads,
                   head_dim=qk_nope_head_dim + qk_rope_head_dim, v_head_dim=v_head_dim,
                   rope_mode=kwargs.pop("rope_mode", "none"), layer_kinds=("mla",) * num_layers,
                   kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                   qk_rope_head_dim=qk_rope_head_dim, **kwargs)

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.layer_kinds if self.layer_kinds is not None else ("mha",) * self.num_layers

    def replace(self, **changes) -> "KVCacheConfig":
        """A copy with ``changes``; a config at its lowest schema stays at the lowest schema of the copy."""
        if "schema_version" not in changes and self.schema_version == self.min_schema:
            changes["schema_version"] = None
        return dataclasses.replace(self, **changes)

    # -- serialization ----------------------------------------------------------------------------------
    def to_dict(self, *, runtime_fields: tuple[str, ...] = ()) -> dict:
        """Fields by name, as the runtime reads them; ``runtime_fields`` are left out and listed instead."""
        for name in runtime_fields:
            if name not in RUNTIME_FIELDS:
                raise ValueError(f"{name!r} cannot be a runtime field; allowed: {RUNTIME_FIELDS}")
        out = {
            "schema_version": self.schema_version,
            "num_layers": self.num_layers,
            "num_qo_heads": self.num_qo_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self.v_dim,
            "dtype": self.dtype,
            "rope_mode": self.rope_mode,
            "rope_theta": float(self.rope_theta),
            "rope_scale": float(self.rope_scale),
            "page_size": self.page_size,
            "max_batch_size": self.max_batch_size,
            "max_total_seq_len": self.max_total_seq_len,
            "prefill_chunk_size": self.prefill_chunk_size,
            "layer_kinds": list(self.kinds),
            "runtime_fields": list(runtime_fields),
        }
        if self.schema_version >= 2:
            out.update({name: getattr(self, name) for name in MLA_FIELDS})
        if self.schema_version >= 3:
            out["sliding_window"] = self.sliding_window
            out["logits_soft_cap"] = float(self.logits_soft_cap)
        if self.schema_version >= 4:
            out["cuda_graph_batch"] = self.cuda_graph_batch
        if self.schema_version >= 5:
            out["attention_sinks"] = self.attention_sinks
            out["sink_size"] = self.sink_size
        if self.schema_version >= 6:
            out["rope"] = self.rope.to_dict()
        if self.schema_version >= FP8_SCHEMA:
            out.update(kv_scales.json_fields(self))
        if self.schema_version >= 7:
            out["layer_groups"] = [g.to_dict() for g in self.layer_groups or ()]
        for name in runtime_fields:
            del out[name]
        return out

    def to_json(self, *, runtime_fields: tuple[str, ...] = ()) -> str:
        return json.dumps(self.to_dict(runtime_fields=runtime_fields), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, runtime_values: Mapping[str, int] | None = None
                  ) -> "KVCacheConfig":
        """The config ``to_dict`` wrote (the inverse: ``from_dict(c.to_dict()).to_dict() == c.to_dict()``).

        Parameters
        ----------
        data :
            Fields by name, as ``to_dict`` writes them. Fields it leaves at their defaults may be left out;
            ``schema_version`` absent means the lowest schema that holds the config.
        runtime_values :
            Values of the fields ``data["runtime_fields"]`` leaves to run time.

        Raises
        ------
        TypeError
            ``data`` is not a mapping, or a field has the wrong type.
        ValueError
            A key no schema up to ``data["schema_version"]`` has, a schema newer than this package reads,
            runtime fields without their values, or an invalid config (``problems``).
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"KVCacheConfig.from_dict takes a mapping, got {type(data).__name__}")
        fields = dict(data)
        schema = fields.get("schema_version")
        if isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA_VERSION:
            raise ValueError(f"config schema_version {schema} is newer than this pagedkv reads (up to "
                             f"{SCHEMA_VERSION}): upgrade pagedkv to read it")
        config_schema.check_keys(fields, schema if isinstance(schema, int) else SCHEMA_VERSION)
        fields.update(config_schema.runtime_values(fields.pop("runtime_fields", []), runtime_values))
        config_schema.check_types(fields)
        if fields.get("layer_groups") == []:  # written by a schema-7 config without groups
            fields["layer_groups"] = None
        kinds = tuple(fields.pop("layer_kinds", ()))
        # to_dict writes the derived v_head_dim and layer_kinds out; an MHA config keeps None for both, as
        # built, so that a round trip compares equal (anything else goes to the constructor to be judged).
        plain_mha = set(kinds) <= {"mha"} and len(kinds) in (0, fields.get("num_layers"))
        if plain_mha and fields.get("v_head_dim") == fields.get("head_dim"):
            fields.pop("v_head_dim", None)
        return cls(**fields, layer_kinds=None if plain_mha else kinds)

    @classmethod
    def from_json(cls, text: str | bytes, *, runtime_values: Mapping[str, int] | None = None) -> "KVCacheConfig":
        """The config ``to_json`` wrote; see ``from_dict`` for what is checked."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise TypeError(f"KVCacheConfig.from_json takes a JSON string, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"KVCacheConfig.from_json: not JSON ({err})") from None
        return cls.from_dict(data, runtime_values=runtime_values)

