"""Layer 1: what one FlashInfer module is (``ModuleSpec``), and its content key.

A spec names one JIT module of flashinfer-python 0.7.4 by its template parameters: the module kind, dtypes,
head dims and the compile-time variant flags. Everything that changes the generated code or the compiled
objects is a field here or part of the build recipe digest in ``content_key``; values known only when the
model runs (window size, soft-cap value, sm_scale, RoPE scale/theta, page size, head counts) are arguments
of the module's functions and are not part of the spec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

#: flashinfer-python release whose JIT modules and function ABI this package pins.
FLASHINFER_VERSION = "0.7.4"

#: Module kinds and the flashinfer 0.7.4 generator each maps to.
#:   decode      -- gen_batch_decode_module (fa2 decode: plan / run / workspace_size)
#:   prefill_fa2 -- gen_batch_prefill_module("fa2", ...) (plan / ragged_run / paged_run / workspace_size)
#:   prefill_fa3 -- gen_batch_prefill_module("fa3", ...) (Hopper, sm_90 only: plan / ragged_run / paged_run)
#:   mla         -- gen_batch_mla_module("fa2", ...) (plan / run)
#:   mla_fa3     -- gen_batch_mla_module("fa3", ...) (Hopper, sm_90 only; plan / run with mla's argument lists)
KINDS = ("decode", "prefill_fa2", "prefill_fa3", "mla", "mla_fa3")
#: The MLA kinds (the same plan / run argument lists, the DeepSeek head dims).
MLA_KINDS = ("mla", "mla_fa3")

#: Data types the specs take (names as in ``KVCacheConfig.dtype`` / torch).
DTYPES = ("float16", "bfloat16")
_SHORT = {"float16": "f16", "bfloat16": "bf16", "int32": "i32"}

#: Head dims FlashInfer 0.7.4 instantiates for its attention kernels (qk == vo except for MLA).
FA2_HEAD_DIMS = (64, 128, 256)
FA3_HEAD_DIMS = (64, 128, 256)
#: MLA: compressed-kv and rope head dims of the only shape the MLA kernels are written for (DeepSeek).
MLA_HEAD_DIMS = ((512, 64),)
#: CUDA archs a spec may target; fa3 needs Hopper.
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")

#: Bump when the recipe that turns a spec into an object changes (flags, post-processing): old cache
#: entries then stop matching.
RECIPE_VERSION = 1


@dataclass(frozen=True)
class ModuleSpec:
    """One FlashInfer JIT module. For ``mla``, ``head_dim_qk`` is the compressed-kv dim (512) and
    ``head_dim_vo`` the RoPE dim (64), as flashinfer's ``head_dim_ckv`` / ``head_dim_kpe``."""

    kind: str
    dtype_q: str
    dtype_kv: str
    dtype_o: str
    head_dim_qk: int
    head_dim_vo: int
    dtype_idx: str = "int32"
    #: flashinfer PosEncodingMode: 0 none, 1 RoPE (Llama) inside the kernel, 2 ALiBi. Not used by mla.
    pos_encoding_mode: int = 0
    use_sliding_window: bool = False
    use_logits_soft_cap: bool = False
    #: fa2 prefill only.
    use_fp16_qk_reduction: bool = False
    arch: str = "sm_90"

    FIELDS_UNUSED: ClassVar[dict[str, tuple[str, ...]]] = {
        "mla": ("pos_encoding_mode", "use_sliding_window", "use_logits_soft_cap", "use_fp16_qk_reduction"),
        "mla_fa3": ("pos_encoding_mode", "use_sliding_window", "use_logits_soft_cap", "use_fp16_qk_reduction"),
        "decode": ("use_fp16_qk_reduction",),
        "prefill_fa3": ("use_fp16_qk_reduction",),
    }

    def __post_init__(self) -> None:
        why = self.reasons()
        if why:
            raise ValueError(f"unsupported FlashInfer module {self.name}: " + "; ".join(why))

    # -- what FlashInfer 0.7.4 can build ----------------------------------------------------------------
    def reasons(self) -> list[str]:
        """Every reason FlashInfer 0.7.4 cannot build this module (empty: it can)."""
        out = []
        if self.kind not in KINDS:
            return [f"unknown FlashInfer module kind {self.kind!r} (known: {', '.join(KINDS)})"]
        for field in ("dtype_q", "dtype_kv", "dtype_o"):
            if getattr(self, field) not in DTYPES:
                out.append(f"{field} {getattr(self, field)!r} not supported (supported: {', '.join(DTYPES)})")
        if self.dtype_idx != "int32":
            out.append(f"dtype_idx {self.dtype_idx!r}: pagedkv's index arrays are int32")
        if self.arch not in ARCHS:
            out.append(f"arch {self.arch!r} not supported (supported: {', '.join(ARCHS)})")
        if self.kind in MLA_KINDS:
            if (self.head_dim_qk, self.head_dim_vo) not in MLA_HEAD_DIMS:
                out.append(f"MLA head dims (ckv {self.head_dim_qk}, kpe {self.head_dim_vo}) not supported "
                           f"(supported: {MLA_HEAD_DIMS})")
        else:
            dims = FA3_HEAD_DIMS if self.kind == "prefill_fa3" else FA2_HEAD_DIMS
            if self.head_dim_qk != self.head_dim_vo:
                out.append(f"{self.kind} needs head_dim_qk == head_dim_vo, got {self.head_dim_qk} and "
                           f"{self.head_dim_vo}")
            elif self.head_dim_qk not in dims:
                out.append(f"{self.kind} head dim {self.head_dim_qk} not supported (supported: {dims})")
            if self.pos_encoding_mode not in (0, 1, 2):
                out.append(f"pos_encoding_mode {self.pos_encoding_mode} is not 0, 1 or 2")
        if self.kind in ("prefill_fa3", "mla_fa3") and self.arch != "sm_90":
            out.append(f"{self.kind} runs on Hopper (sm_90) only, got {self.arch}")
        if self.kind == "prefill_fa3":
            if self.pos_encoding_mode != 0:
                out.append("prefill_fa3 has no in-kernel RoPE (pos_encoding_mode must be 0)")
        for field in self.FIELDS_UNUSED.get(self.kind, ()):
            default = ModuleSpec.__dataclass_fields__[field].default
            if getattr(self, field) != default:
                out.append(f"{field} does not apply to {self.kind} modules (leave it {default!r})")
        return out

    # -- names and keys ------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """A readable name, unique per spec: ``decode_f16_f16_f16_qk128_vo128_pe0_sm90`` (+ flags)."""
        parts = [self.kind, _SHORT.get(self.dtype_q, self.dtype_q), _SHORT.get(self.dtype_kv, self.dtype_kv),
                 _SHORT.get(self.dtype_o, self.dtype_o)]
        if self.kind in MLA_KINDS:
            parts += [f"ckv{self.head_dim_qk}", f"kpe{self.head_dim_vo}"]
        else:
            parts += [f"qk{self.head_dim_qk}", f"vo{self.head_dim_vo}", f"pe{self.pos_encoding_mode}"]
        if self.use_sliding_window:
            parts.append("swa")
        if self.use_logits_soft_cap:
            parts.append("cap")
        if self.use_fp16_qk_reduction:
            parts.append("f16qk")
        if self.dtype_idx != "int32":
            parts.append(_SHORT.get(self.dtype_idx, self.dtype_idx))
        parts.append(self.arch.replace("_", ""))
        return "_".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModuleSpec":
        return cls(**d)

    def content_key(self, toolchain: dict[str, str] | None = None) -> str:
        """``<name>-<digest>``: the digest covers the spec, the flashinfer version, the recipe version and
        the toolchain description (nvcc version, extra flags) that produced the objects."""
        blob = json.dumps({"spec": self.to_dict(), "flashinfer": FLASHINFER_VERSION, "recipe": RECIPE_VERSION,
                           "toolchain": toolchain or {}}, sort_keys=True)
        return f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"

    def symbol_prefix(self, content_key: str) -> str:
        """Prefix of the module's exported function names (``<prefix><func>``): unique per content key, so
        modules of different specs or toolchains link into one library side by side."""
        return f"pagedkv_fi_{self.kind}_{content_key.rsplit('-', 1)[1]}_"


__all__ = ["ModuleSpec", "KINDS", "MLA_KINDS", "DTYPES", "FLASHINFER_VERSION", "FA2_HEAD_DIMS", "FA3_HEAD_DIMS",
           "MLA_HEAD_DIMS", "ARCHS", "RECIPE_VERSION"]
