"""The kernel spec: the compile-time shape of a layer's kernels (``KernelSpec``) and the forced run-time
code paths (``SWITCHES``), in one pure-Python module (a runtime-only process keys prebuilt libraries with it
without importing the kernels).

Forcing a path: several kernels choose between code paths at run time from a work estimate, a split count or
a size threshold (the CPU attention kernels run their work items on the calling thread or on the thread
pool; the CUDA decode kernels pick a split-KV count). Left alone ("auto") each kernel chooses as it always
has, and the generated TIR is unchanged. A forced path is compile-time: ``KernelSpec.paths`` holds
``(switch, value)`` pairs, a kernel reads its switch with ``forced(spec.paths, switch)``, and the kernel
library key includes the pairs, so a forced library never stands in for an automatic one. Tests force paths
with ``pagedkv.backends.tir.forced_paths``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable, Mapping

from .rope_spec import RopeTable, rope_table

#: Storage dtypes of the TIR kernels (accumulation is float32 for every one).
DTYPES = ("float16", "float32", "bfloat16")
#: Page formats besides ``dtype`` (``KernelSpec.kv_dtype``), and the fields that describe them.
FP8_KV_DTYPES = ("float8_e4m3fn",)
_FP8_FIELDS = ("kv_dtype", "k_scale", "v_scale", "ckv_scale", "kpe_scale")

#: switch -> (what reads it, allowed values; "auto" = the kernel's own run-time choice).
SWITCHES: dict[str, tuple[str, tuple[str, ...]]] = {
    "cpu_threads": ("CPU attention kernels (MHA and MLA): work items on the calling thread or the pool",
                    ("auto", "serial", "parallel")),
    "cuda_decode_splits": ("CUDA decode kernels (MHA attn_decode_paged, MLA mla_attn_decode_paged): the split-KV "
                           "count S (auto: from the shapes); a forced S is clamped to 1 .. the batch's key slots "
                           "(nnz * page size), and with S > 1 the partial states go through the merge kernel",
                           ("auto", "1", "2", "3", "8")),
    "cuda_decode_split_ranges": ("CUDA MHA decode (attn_decode_paged), plain and inline RoPE: how a split-KV decode "
                                 "cuts an entry's keys (tir_kernels._common_cuda.chunk_split): entry = each entry's "
                                 "keys in S equal ranges; chunk = ranges of one length C for every entry (C: an "
                                 "average entry's range at the split count), as many as each entry needs, where "
                                 "the runtime passes the longest entry (max_kv_len; not under CUDA graphs), else "
                                 "entry; auto: chunk for a skewed batch (longest entry over 5/4 of the average) "
                                 "with S > 1, else entry", ("auto", "entry", "chunk")),
    # The kernel switches: their values are the rows of the selection table (pagedkv.kernel_table, which says what
    # each variant serves, the order auto tries them in and their fallbacks; a test keeps the two equal).
    "cuda_prefill_kernel": ("CUDA MHA prefill (attn_prefill_ragged, attn_prefill_paged), apply_rope = 0: the SIMT "
                            "FP32 kernel or a tensor-core tile (tir_kernels._prefill_tc_tiles.TC_TILES); inline "
                            "RoPE always runs the SIMT kernel; auto and the limits: pagedkv.kernel_table",
                            ("auto", "simt", "tc2", "tc3", "tcq", "wg2t", "wg1t")),
    "cuda_decode_kernel": ("CUDA MHA decode (attn_decode_paged), plain and inline RoPE: the tensor-core kernel, the "
                           "shared-memory staged kernel or the lane-group kernel, for both variants; auto (per "
                           "variant) and the limits: pagedkv.kernel_table", ("auto", "lanes", "staged", "tc")),
    "cuda_mla_decode_kernel": ("CUDA MLA decode (mla_attn_decode_paged): the SIMT FP32 kernel, the mma.sync kernel "
                               "(tc) or the wgmma kernel with Q in shared memory (wgq); auto and the limits: "
                               "pagedkv.kernel_table", ("auto", "simt", "tc", "wgq")),
    "cuda_mla_prefill_kernel": ("CUDA paged MLA prefill (mla_attn_prefill_paged): the SIMT FP32 kernel, or the MLA "
                                "decodes' tc / wgq blocks run once per query token "
                                "(tir_kernels._mla_frame_cuda.make_prefill_frame); auto and the limits: "
                                "pagedkv.kernel_table", ("auto", "simt", "tc", "wgq")),
}


#: The tensor-core MHA decode's limits (``tir_kernels._decode_tc_cuda``), as data: here, TVM-free, so that a
#: runtime-only process (the GPU benchmark) asks them too. The group's rows fill at most one m16 tile.
TCD_DTYPES = ("float16", "bfloat16")
TCD_HEAD_DIMS = (64, 128)
TCD_MAX_GROUP = 16


def tc_decode_limits(g: int, d: int, dtype: str) -> list[str]:
    """Why the tensor-core decode kernel does not take GQA group ``g``, head dim ``d``, ``dtype`` (empty: it
    does)."""
    out = []
    if dtype not in TCD_DTYPES:
        out.append(f"dtype {dtype} (the tensor-core decode takes {', '.join(TCD_DTYPES)})")
    if d not in TCD_HEAD_DIMS:
        out.append(f"head_dim {d} (the tensor-core decode takes {', '.join(map(str, TCD_HEAD_DIMS))})")
    if g > TCD_MAX_GROUP:
        out.append(f"GQA group {g} (the tensor-core decode takes groups up to {TCD_MAX_GROUP}: one m16 tile)")
    return out


#: What the wgmma prefill tiles (``WG_PREFILL_TILES``) serve beyond the tensor-core prefill's limits: the head dim
#: of the H200 runs of the first wgmma tile that matched the reference. At head dim 64 its outputs were wrong
#: (relative error 0.07-0.37 at GQA groups 3, 4 and 7; head dim 128 at groups 1, 3, 4 and 8 right; H200,
#: 2026-12-04). Not the operand layouts (``tools/wgmma_probe.cu`` checked them at these strides); cause not found.
#: Refused, not run.
WG_PREFILL_HEAD_DIMS = (128,)
#: qk and v head dims of the mma.sync prefill tiles (``tir_kernels._prefill_tc_tiles``; the selection table reads
#: them too): tc2 / tc3, whose Q fragments and O accumulators take 255 registers at head dim 256, and tcq for 256.
TC_PREFILL_HEAD_DIMS = (64, 96, 128)
TCQ_PREFILL_HEAD_DIMS = (256,)


def wg_prefill_limits(d: int, dv: int) -> list[str]:
    """Why the wgmma prefill tiles do not take head dims ``d`` / ``dv`` beyond the tensor-core prefill's limits
    (empty: they do)."""
    if d not in WG_PREFILL_HEAD_DIMS or dv not in WG_PREFILL_HEAD_DIMS:
        return [f"head dims {d}/{dv} (the wgmma prefill tile takes {WG_PREFILL_HEAD_DIMS}: head dim 64 gave wrong "
                "results on the H200)"]
    return []


#: The wgmma prefill tiles (``tir_kernels._prefill_tc_tiles.TC_TILES`` with ``wgmma``): their K / V tiles are TMA
#: boxes, and their PrimFuncs also hold the op's first non-TMA default tile, run where TMA cannot read the
#: operands (not 16-byte aligned; pages not a multiple of 8 keys).
WG_PREFILL_TILES = ("wg2t", "wg1t")
#: Forced path values whose kernels need one CUDA arch (their instructions exist there only): a library holding
#: them is built for, and looked up under, that arch (``target_for_paths``). (switch, value) -> arch.
PATH_ARCHS: dict[tuple[str, str], str] = {**{("cuda_prefill_kernel", t): "sm_90a" for t in WG_PREFILL_TILES},
                                          ("cuda_mla_decode_kernel", "wgq"): "sm_90a",
                                          ("cuda_mla_prefill_kernel", "wgq"): "sm_90a"}


def target_for_paths(paths, target):
    """``target`` with the CUDA arch its forced ``paths`` need (``PATH_ARCHS``), as a canonical target dict;
    ``target`` itself when no forced path needs one (or it is not a CUDA target)."""
    archs = {PATH_ARCHS[p] for p in normalize_paths(paths) if p in PATH_ARCHS}
    if not archs:
        return target
    from .target import canonical

    spec = canonical(target)
    if spec["kind"] != "cuda":
        return target
    if len(archs) > 1:
        raise ValueError(f"forced paths {dict(normalize_paths(paths))} need different archs {sorted(archs)}")
    return {**spec, "arch": archs.pop()}


def normalize_paths(paths: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> tuple[tuple[str, str], ...]:
    """``paths`` as sorted ``(switch, value)`` pairs without "auto" entries; raises ``ValueError`` naming an
    unknown switch or value."""
    items = dict(paths.items() if isinstance(paths, Mapping) else (paths or ()))
    out = []
    for name, value in sorted(items.items()):
        if name not in SWITCHES:
            raise ValueError(f"unknown kernel path switch {name!r}; known: {', '.join(sorted(SWITCHES))}")
        allowed = SWITCHES[name][1]
        if str(value) not in allowed:
            raise ValueError(f"kernel path switch {name!r} takes {', '.join(allowed)}; got {value!r}")
        if str(value) != "auto":
            out.append((name, str(value)))
    return tuple(out)


def forced(paths: tuple[tuple[str, str], ...], switch: str) -> str:
    """The value forced for ``switch`` in normalized ``paths``, or ``"auto"``."""
    if switch not in SWITCHES:
        raise KeyError(f"unknown kernel path switch {switch!r}")
    return dict(paths).get(switch, "auto")


@dataclass(frozen=True)
class KernelSpec:
    """The compile-time shape of one layer's kernels: what every backend builds for, derived from a
    ``KVCacheConfig`` in one place (``from_config``), validated once (here), and the kernel library key's input.

    Parameters
    ----------
    num_qo_heads, num_kv_heads : int
        Query and kv heads; ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (GQA group size).
    head_dim : int
        qk head dim ``D``. RoPE (``apply_rope = 1``) rotates halves and is defined for an even ``D`` only;
        an odd ``D`` (MLA's self-attention) is served with ``apply_rope = 0`` (pagedkv's config rejects RoPE
        with an odd head dim, so its caches never pass 1 then).
    v_head_dim : int or None
        v head dim ``Dv`` (only ``attn_prefill_ragged`` and ``merge_state`` may use ``Dv != D``);
        ``None`` means ``head_dim``. (Each target family states its own limits: the CPU attention kernels
        need an even value dim, ``kv_lora_rank`` included, as they accumulate ``P @ V`` in column pairs.)
    dtype : str
        Storage dtype of q/k/v/o and pages: ``"float16"``, ``"float32"`` or ``"bfloat16"`` (accumulation is
        float32).
    kv_lora_rank, qk_rope_head_dim : int
        MLA layers (both > 0): pages hold a latent of ``kv_lora_rank + qk_rope_head_dim`` elements per
        token; ``head_dim`` / ``v_head_dim`` / ``num_kv_heads`` then describe the ragged self-attention
        (``num_kv_heads == num_qo_heads``). 0 for MHA.
    sliding_window : int
        MHA attention kernels only; 0 = off. Query row ``i`` of an entry with ``n`` queries and ``m`` keys
        sits at key position ``p = m - n + i`` (bottom-right alignment, as the causal mask) and sees keys
        ``j >= p + 1 - sliding_window`` (besides the causal / length limit). Compile-time: the op ABI does
        not change, and with 0 the generated code is what it was before the field existed.
    logits_soft_cap : float
        MHA attention kernels only; 0 = off. Scores ``s = sm_scale * q.k`` become
        ``logits_soft_cap * tanh(s / logits_soft_cap)`` before masking and softmax (FlashInfer's and
        Gemma-2's definition); lse is over the capped scores.
    paths : tuple of (str, str)
        Forced run-time code paths, ``(switch, value)`` pairs of ``_paths.SWITCHES`` (tests use them to
        reach every path on small shapes); empty = every kernel chooses for itself, and the generated code
        is what it is without the field. Accepts a mapping; stored normalized (sorted, no "auto").
    target_arch : str
        The CUDA arch the kernels are made for (``"sm_90a"``...), "" = unknown / not CUDA. Filled by
        ``pagedkv.tir_kernels.make`` from the target (the family factories see only the spec): kernels that
        need an arch-specific PTX target (the wgmma prefill tiles need sm_90a) read it. Not part of
        ``to_dict`` when "" (the library key's config part is what it was before the field).
    partial : bool
        Build an attention op's partial-state variant (``pagedkv.ops.PARTIAL_OF``: the same kernel writing ``o``
        in float32, the state one pass of a multi-pass forward leaves for ``merge_state_partial``). Set by
        ``pagedkv.tir_kernels.make`` for the ``*_partial`` ops only: with False every kernel is what it was
        before the field. Not part of ``to_dict`` when False (a library holds both variants of a config).
    attention_sinks : bool
        The config's ``attention_sinks``: its op set holds the sink ops (``pagedkv.ops.SINK_OPS``, ``ops_for``); no
        other kernel reads it. Not part of ``to_dict`` when False (the key of a library without sinks is what it
        was before the field).
    rope : RopeTable or None
        A RoPE variant the kernels' own formula (``p * rope_scale / rope_theta ** (2i / D)``, whole head, halves)
        does not give (``pagedkv.rope_spec.rope_table``): the rotating kernels (``split_rotary``, inline RoPE) take
        its frequencies, pairing, rotated dims and attention factor as compile-time constants and ignore their
        ``rope_scale`` / ``rope_theta`` arguments; ``apply_rope == 2`` selects LongRoPE's long set. None: the
        kernels are what they were before the field (not part of ``to_dict``).
    kv_dtype : str
        ``""``: the pages hold ``dtype``. ``"float8_e4m3fn"``: they hold e4m3 codes (``uint8`` tensors) that the
        kernels encode and decode themselves (``tir_kernels._fp8``); q, k, v and o keep ``dtype``.
    k_scale, v_scale : tuple of float
        FP8 MHA pages: the scale of each kv head (``num_kv_heads`` values; the page holds ``x / scale``), compiled
        into the kernels. Empty otherwise.
    ckv_scale, kpe_scale : float
        FP8 MLA pages: the scales of the latent's first ``kv_lora_rank`` elements and of its rope part.
        ``kv_dtype`` and the scales are not part of ``to_dict`` when ``kv_dtype`` is "" (keys of other caches are
        what they were before the fields).
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    dtype: str = "float16"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    sliding_window: int = 0
    logits_soft_cap: float = 0.0
    paths: tuple = ()
    target_arch: str = ""
    partial: bool = False
    attention_sinks: bool = False
    rope: RopeTable | None = None
    kv_dtype: str = ""
    k_scale: tuple = ()
    v_scale: tuple = ()
    ckv_scale: float = 1.0
    kpe_scale: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "paths", normalize_paths(self.paths))
        if self.target_arch:  # sm_90 and sm_90a are one machine (pagedkv.target)
            from .target import canonical_arch

            object.__setattr__(self, "target_arch", canonical_arch(self.target_arch))
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        for name in ("num_qo_heads", "num_kv_heads", "head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KernelSpec.{name} must be a positive int, got {value!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads={self.num_qo_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if (self.kv_lora_rank > 0) != (self.qk_rope_head_dim > 0):
            raise ValueError("MLA needs both kv_lora_rank and qk_rope_head_dim > 0, got "
                             f"{self.kv_lora_rank} and {self.qk_rope_head_dim}")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError(f"sliding_window must be an int >= 0 (0: off), got {self.sliding_window!r}")
        if isinstance(self.logits_soft_cap, int) and not isinstance(self.logits_soft_cap, bool):
            object.__setattr__(self, "logits_soft_cap", float(self.logits_soft_cap))
        cap = self.logits_soft_cap
        if not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap < 0:
            raise ValueError(f"logits_soft_cap must be a finite number >= 0 (0: off), got {cap!r}")
        if self.is_mla and (self.sliding_window or cap):
            raise ValueError("MLA kernels take no sliding_window or logits_soft_cap")
        if self.rope is not None:
            self._check_rope()
        self._check_fp8()

    def _check_fp8(self):
        if self.kv_dtype not in ("", *FP8_KV_DTYPES):
            raise ValueError(f"KernelSpec.kv_dtype must be '' (dtype) or one of {FP8_KV_DTYPES}, got {self.kv_dtype!r}")
        object.__setattr__(self, "k_scale", tuple(float(v) for v in self.k_scale))
        object.__setattr__(self, "v_scale", tuple(float(v) for v in self.v_scale))
        heads = () if self.is_mla or not self.kv_dtype else (self.num_kv_heads,)
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if len(value) not in heads + (0,) or (heads and len(value) != heads[0]):
                raise ValueError(f"KernelSpec.{name} takes one value per kv head with FP8 MHA pages (else none), got "
                                 f"{value!r}")
        scales = (*self.k_scale, *self.v_scale, self.ckv_scale, self.kpe_scale)
        if not all(math.isfinite(v) and v > 0 for v in scales):
            raise ValueError(f"KernelSpec scales must be finite and > 0, got {scales}")
        if not self.kv_dtype and scales != (1.0, 1.0):
            raise ValueError("KernelSpec scales need FP8 pages (kv_dtype)")

    @property
    def page_dtype(self) -> str:
        """The dtype of the ``pages`` buffer: ``dtype``, or ``uint8`` for FP8 pages."""
        return "uint8" if self.kv_dtype else self.dtype

    def _check_rope(self):
        r = self.rope
        if not isinstance(r, RopeTable):
            raise ValueError(f"KernelSpec.rope must be a pagedkv.rope_spec.RopeTable or None, got {r!r}")
        if r.rotary_dim < 2 or r.rotary_dim % 2 or r.rotary_dim > self.head_dim:
            raise ValueError(f"KernelSpec.rope.rotary_dim must be even and in [2, head_dim {self.head_dim}], got "
                             f"{r.rotary_dim}")
        if len(r.inv_freq) != r.half or len(r.inv_freq_long) not in (0, r.half):
            raise ValueError(f"KernelSpec.rope needs {r.half} frequencies per set, got {len(r.inv_freq)} and "
                             f"{len(r.inv_freq_long)}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def latent_dim(self) -> int:
        """Elements per token of an MLA page."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def group_size(self) -> int:
        """Query heads per kv head."""
        return self.num_qo_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config, *, paths=()) -> "KernelSpec":
        """The kernel spec of a ``pagedkv.config.KVCacheConfig`` (its kernel fields; capacity, page size and
        plain RoPE's parameters are kernel arguments, so configs differing only there share kernels; a RoPE
        variant's frequencies are compile-time, ``rope``)."""
        from .config import ATTENTION_OPTION_FIELDS  # every attention option carries over by name

        rope = getattr(config, "rope", None)
        table = (rope_table(rope, config.head_dim, config.rope_theta, config.rope_scale)
                 if rope is not None and config.rope_mode != "none" else None)
        fp8 = {}
        if getattr(config, "fp8", False):
            per_head = () if config.is_mla else (config.num_kv_heads,)
            fp8 = {"kv_dtype": config.kv_dtype, "ckv_scale": config.ckv_scale, "kpe_scale": config.kpe_scale,
                   **{n: (config.scales_of(n) * per_head[0] if len(config.scales_of(n)) == 1 else config.scales_of(n))
                      if per_head else () for n in ("k_scale", "v_scale")}}
        return cls(**fp8,num_qo_heads=config.num_qo_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                   v_head_dim=config.v_dim, dtype=config.dtype, kv_lora_rank=config.kv_lora_rank,
                   qk_rope_head_dim=config.qk_rope_head_dim, paths=paths, rope=table,
                   attention_sinks=bool(getattr(config, "attention_sinks", False)),
                   **{f: getattr(config, f) for f in ATTENTION_OPTION_FIELDS})

    def options(self) -> dict:
        """The attention options (``pagedkv.config.ATTENTION_OPTION_FIELDS``) by name."""
        from .config import ATTENTION_OPTION_FIELDS

        return {f: getattr(self, f) for f in ATTENTION_OPTION_FIELDS}

    def to_dict(self) -> dict:
        """JSON-able fields (the kernel library key's config part)."""
        def kept(name, value):  # fields added later are left out at their defaults (older keys stay the same)
            if name in _FP8_FIELDS:
                return bool(self.kv_dtype)
            return name not in ("target_arch", "partial", "attention_sinks", "rope") or value

        out = {f.name: (list(map(list, v)) if f.name == "paths" else v)
               for f in fields(self) for v in [getattr(self, f.name)] if kept(f.name, v)}
        if self.rope is not None:
            out["rope"] = self.rope.to_dict()
        return out


__all__ = ["DTYPES", "KernelSpec", "PATH_ARCHS", "SWITCHES", "WG_PREFILL_TILES", "forced", "normalize_paths", "target_for_paths",
           "tc_decode_limits"]
