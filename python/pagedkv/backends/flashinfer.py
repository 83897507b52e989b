"""The FlashInfer backend: FlashInfer 0.7.4 JIT modules, built at model compile time and linked into the model
library (``pagedkv.flashinfer``), driven by the runtime's "flashinfer" adapters (``src/flashinfer_adapter.cc``).

Ops and the module each runs on:

========================== ====================================================================
``attn_decode_paged``      ``decode`` (batch decode; plan per decode pass, run per layer)
``attn_prefill_ragged``    ``prefill_fa3`` on sm_90 (Hopper), else ``prefill_fa2`` (plan once per
                           prefill forward, causal)
``attn_prefill_paged``     ``prefill_fa2`` (plan per pass, non-causal; its passes include the short
                           shared-prefix passes of decode forwards, where FlashInfer itself prefers fa2)
``mla_attn_decode_paged``  ``mla`` (fa2 MLA; plan per decode pass)
``mla_attn_prefill_paged`` ``mla`` (plan per pass, non-causal)
========================== ====================================================================

``PAGEDKV_FLASHINFER_FA3=0`` makes ``attn_prefill_ragged`` use fa2 on sm_90 too (the choice is part of the
kernel-library key). Every reason the backend cannot serve an op is reported, so an explicit
``backend="flashinfer"`` fails at compile time listing them, and automatic selection records them.
"""

from __future__ import annotations

import os
from typing import Any

from .. import ops
from ..config import KVCacheConfig
from ..target import arch as target_arch
from ..target import runtime_only
from .base import Backend, OpBuild, target_kind

#: GQA group sizes FlashInfer 0.7.4's decode kernels dispatch on (DISPATCH_GQA_GROUP_SIZE); the prefill
#: kernels take any group (a runtime uint_fastdiv).
GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)

#: The MHA ops and the MLA ops the backend serves.
MHA_OPS = (ops.ATTN_DECODE_PAGED, ops.ATTN_PREFILL_RAGGED, ops.ATTN_PREFILL_PAGED)
MLA_OPS = (ops.MLA_ATTN_DECODE_PAGED, ops.MLA_ATTN_PREFILL_PAGED)

#: FlashInfer's MLA planner holds at most this many work items (scheduler.cuh MLAPlan); a pass needs one per
#: 64 packed (token, head) rows of an entry plus at most one KV split per SM (``MLA_MAX_SPLITS``).
MLA_MAX_WORKS = 16384
MLA_MAX_SPLITS = 1024


def use_fa3() -> bool:
    return os.environ.get("PAGEDKV_FLASHINFER_FA3", "1") != "0"


def module_kind(op: str, arch: str | None, *, windowed: bool = False) -> str:
    """The FlashInfer module kind that serves ``op`` on ``arch`` (see the module docstring)."""
    if op == ops.ATTN_DECODE_PAGED:
        return "decode"
    if op == ops.ATTN_PREFILL_RAGGED:
        # A windowed cache's ragged calls attend no key (self_attention of a through forward): fa2, the
        # module attn_prefill_paged links anyway, saves a second prefill module build.
        return "prefill_fa3" if arch == "sm_90" and use_fa3() and not windowed else "prefill_fa2"
    if op == ops.ATTN_PREFILL_PAGED:
        return "prefill_fa2"
    if op in MLA_OPS:
        return "mla"
    raise ValueError(f"no FlashInfer module for op {op!r}")


def module_spec(op: str, config: KVCacheConfig, arch: str):
    """The FlashInfer module that serves ``op`` for ``config`` (raises ValueError listing why there is none)."""
    from ..flashinfer import ModuleSpec

    kind = module_kind(op, arch, windowed=config.sliding_window > 0)
    if kind == "mla":
        return ModuleSpec("mla", config.dtype, config.dtype, config.dtype, config.kv_lora_rank,
                          config.qk_rope_head_dim, arch=arch)
    # the v head dim of attn_prefill_ragged is v_head_dim; the paged ops read pages of head_dim
    vo = config.v_dim if op == ops.ATTN_PREFILL_RAGGED else config.head_dim
    # The options' values are run-time arguments (src/flashinfer_common.h ReadOptions); the modules only
    # need the code paths, so they are built with them exactly when the config turns them on.
    return ModuleSpec(kind, config.dtype, config.dtype, config.dtype, config.head_dim, vo, arch=arch,
                      use_sliding_window=config.sliding_window > 0,
                      use_logits_soft_cap=config.logits_soft_cap > 0)


def run_function(op: str) -> str:
    """The module function the op's adapter runs (after ``plan``)."""
    return {ops.ATTN_PREFILL_RAGGED: "ragged_run", ops.ATTN_PREFILL_PAGED: "paged_run"}.get(op, "run")


class FlashInferBackend(Backend):
    """FlashInfer JIT modules for the attention ops the runtime has adapters for."""

    tag = "flashinfer"
    ops = MHA_OPS + MLA_OPS

    def validate_configuration(self, op: str, config: KVCacheConfig, target: Any) -> list[str]:
        reasons = self._unsupported_op(op)
        if reasons:
            return reasons
        kind = target_kind(target)
        if kind != "cuda":
            return [f"FlashInfer modules are CUDA code; target kind is {kind!r}"]
        layer_kind = "mla" if config.is_mla else "mha"
        if op not in ops.OPS_BY_KIND[layer_kind]:
            return [f"op {op!r} is not an op of {layer_kind} layers"]
        if op in MHA_OPS:
            if config.rope_mode == "inline":
                reasons.append("rope_mode 'inline' needs RoPE inside the attention kernel with a per-entry key "
                               "position offset; pagedkv's FlashInfer modules are built without in-kernel RoPE "
                               "(use 'normal': RoPE applied before the cache)")
            if config.num_qo_heads % config.num_kv_heads:
                reasons.append(f"num_qo_heads {config.num_qo_heads} is not a multiple of num_kv_heads "
                               f"{config.num_kv_heads}")
            elif op == ops.ATTN_DECODE_PAGED and config.group_size not in GROUP_SIZES:
                reasons.append(f"GQA group size {config.num_qo_heads}/{config.num_kv_heads} not supported by "
                               f"the decode kernels (FlashInfer 0.7.4 dispatches {GROUP_SIZES})")
        else:
            # one pass holds at most prefill_chunk_size queries over at most max_batch_size entries
            works = (config.prefill_chunk_size * config.num_qo_heads + 63) // 64 + config.max_batch_size
            if works + MLA_MAX_SPLITS > MLA_MAX_WORKS:
                reasons.append(f"a pass of prefill_chunk_size={config.prefill_chunk_size} tokens x "
                               f"{config.num_qo_heads} heads needs up to {works + MLA_MAX_SPLITS} MLA work items, "
                               f"more than FlashInfer's planner holds ({MLA_MAX_WORKS})")
        arch = target_arch(target)
        if arch is None:
            reasons.append("the CUDA target names no arch (FlashInfer modules are built for one)")
        else:
            try:
                module_spec(op, config, arch)
            except ValueError as err:
                reasons.append(str(err).split(": ", 1)[-1])
        if not runtime_only():
            # Building needs flashinfer-python 0.7.4, nvcc and binutils. A runtime-only process (the GPU
            # host) builds nothing: it needs the prebuilt library, and says so when it is missing.
            from ..flashinfer import unavailable_reasons

            reasons += unavailable_reasons()
        return reasons

    def key_part(self, config: KVCacheConfig, target: Any, ops: tuple[str, ...]) -> Any:
        """The FlashInfer version, our recipe and the module kind per op (fa2/fa3 is a choice, see
        ``module_kind``): a library built with other modules never stands in for this one."""
        from ..flashinfer.spec import FLASHINFER_VERSION, RECIPE_VERSION

        return [FLASHINFER_VERSION, RECIPE_VERSION,
                {op: module_kind(op, target_arch(target), windowed=config.sliding_window > 0) for op in ops}]

    def describe(self, op: str, config: KVCacheConfig, target: Any) -> str:
        return f"module {module_spec(op, config, target_arch(target)).kind}"

    def build(self, op: str, config: KVCacheConfig, target: Any) -> OpBuild:
        """Op-table entry ``[op, "flashinfer", module_kind, empty_rows, plan, run]`` (src/flashinfer_adapter.cc):
        the module's ``plan`` and the op's run function, and the TIR helper ``pagedkv_empty_rows`` that writes
        pagedkv's empty state (FlashInfer writes lse = -inf for rows without keys)."""
        from ..flashinfer import build_module
        from ..tir_kernels import make_empty_rows

        spec = module_spec(op, config, target_arch(target))
        built = build_module(spec)
        names = (built.symbol("plan"), built.symbol(run_function(op)))
        helper = make_empty_rows(config.dtype, target)
        from ..flashinfer.link import export_options

        return OpBuild(op=op, backend=self.tag, adapter="flashinfer", options=(spec.kind,),
                       prim_funcs=(("pagedkv_empty_rows", helper),), extern_symbols=names,
                       extern_modules=(built,), export_options=tuple(export_options()))
