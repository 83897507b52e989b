"""The FlashInfer backend: FlashInfer 0.7.4 JIT modules, built at model compile time and linked into the model
library (``pagedkv.flashinfer``), driven by the runtime's "flashinfer" adapters (``src/flashinfer_adapter.cc``).

The runtime has an adapter for ``attn_decode_paged`` so far (plan per forward and pass, run per layer); the
other attention ops follow with their adapters. Every reason it cannot serve is reported, so an explicit
``backend="flashinfer"`` fails at compile time listing them, and automatic selection records them.
"""

from __future__ import annotations

from typing import Any

from .. import ops
from ..config import KVCacheConfig
from .base import Backend, OpBuild, target_kind

#: GQA group sizes FlashInfer 0.7.4's kernels dispatch on (DISPATCH_GQA_GROUP_SIZE).
GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)


def target_arch(target: Any) -> str | None:
    """``"sm_90"`` for a CUDA target with an arch (``"cuda"`` alone means sm_90, as in ``pagedkv.cache``)."""
    from ..cache import target_spec

    return target_spec(target).get("arch")


def module_spec(op: str, config: KVCacheConfig, arch: str):
    """The FlashInfer module that serves ``op`` for ``config`` (raises ValueError listing why there is none)."""
    from ..flashinfer import ModuleSpec

    if op == ops.ATTN_DECODE_PAGED:
        return ModuleSpec("decode", config.dtype, config.dtype, config.dtype, config.head_dim, config.v_dim,
                          arch=arch)
    raise ValueError(f"no FlashInfer module for op {op!r}")


class FlashInferBackend(Backend):
    """FlashInfer JIT modules for the attention ops the runtime has adapters for."""

    tag = "flashinfer"
    ops = (ops.ATTN_DECODE_PAGED,)

    def validate_configuration(self, op: str, config: KVCacheConfig, target: Any) -> list[str]:
        reasons = self._unsupported_op(op)
        if reasons:
            return reasons
        kind = target_kind(target)
        if kind != "cuda":
            return [f"FlashInfer modules are CUDA code; target kind is {kind!r}"]
        if config.rope_mode == "inline":
            reasons.append("rope_mode 'inline' needs a per-entry key position offset that FlashInfer's decode "
                           "kernel does not take (use 'normal': RoPE applied before the cache)")
        if config.is_mla:
            reasons.append(f"{op} is an MHA op; MLA caches use the mla_* ops (FlashInfer's MLA module has no "
                           "runtime adapter yet)")
        if config.num_qo_heads % config.num_kv_heads or config.group_size not in GROUP_SIZES:
            reasons.append(f"GQA group size {config.num_qo_heads}/{config.num_kv_heads} not supported "
                           f"(FlashInfer 0.7.4 dispatches {GROUP_SIZES})")
        arch = target_arch(target)
        if arch is None:
            reasons.append("the CUDA target names no arch (FlashInfer modules are built for one)")
        else:
            try:
                module_spec(op, config, arch)
            except ValueError as err:
                reasons.append(str(err).split(": ", 1)[-1])
        from ..cache import _runtime_only

        if not _runtime_only():
            # Building needs flashinfer-python 0.7.4, nvcc and binutils. A runtime-only process (the GPU
            # host) builds nothing: it needs the prebuilt library, and says so when it is missing.
            from ..flashinfer import unavailable_reasons

            reasons += unavailable_reasons()
        return reasons

    def build(self, op: str, config: KVCacheConfig, target: Any) -> OpBuild:
        from ..flashinfer import abi, build_module

        built = build_module(module_spec(op, config, target_arch(target)))
        names = tuple(built.symbol(f.func) for f in abi.functions(built.spec.kind))  # [plan, run, ...]
        return OpBuild(op=op, backend=self.tag, extern_symbols=names, extern_modules=(built,))
