"""The FlashInfer backend: FlashInfer 0.7.4 JIT modules, built at model compile time and linked into the model
library (``pagedkv.flashinfer``), driven by the runtime's "flashinfer" adapters (``src/flashinfer_adapter.cc``).

Ops and the module each runs on by default (``module_kind``; chosen by measurement on the H200 with
``benchmarks/bench_gpu.py``, see benchmarks/HISTORY.md):

========================== ====================================================================
``attn_decode_paged``      GQA group >= 8: ``prefill_fa2`` (FlashInfer's "tensor-core decode": its
                           paged prefill kernel with one query row per entry, as its own decode wrapper
                           does with ``use_tensor_cores=True``); groups 4 and 6: ``decode|prefill_fa2``
                           (both linked; the runtime takes the CUDA-core kernel for a forward whose
                           longest sequence is at least twice the mean and whose entries x kv heads
                           are at most 256, tensor cores otherwise);
                           smaller groups: ``decode`` (the CUDA-core decode kernel)
``attn_prefill_ragged``    ``prefill_fa3`` on sm_90 (Hopper), else ``prefill_fa2`` (causal)
``attn_prefill_paged``     ``prefill_fa3`` on sm_90, else ``prefill_fa2`` (non-causal passes, and the
                           shared-prefix passes of decode forwards)
``mla_attn_decode_paged``  ``mla_fa3`` on sm_90, else ``mla`` (fa2 MLA)
``mla_attn_prefill_paged`` ``mla_fa3`` on sm_90, else ``mla`` (non-causal passes)
========================== ====================================================================

A windowed cache keeps the fa2 prefill module for its prefill ops (its passes are through passes; one
module serves both and no fa3 window module is built). ``forced_modules({op: kind})`` (or
``PAGEDKV_FLASHINFER_MODULES="op=kind,..."``) runs an op on another kind it can run on (``CHOICES``), for
benchmarks and tests; ``PAGEDKV_FLASHINFER_FA3=0`` keeps every op off the fa3 kinds. The kind per op is
part of the kernel-library key. Every reason the backend cannot serve an op is reported, so an explicit
``backend="flashinfer"`` fails at compile time listing them, and automatic selection records them. Outside a
runtime-only process that includes what building the op's modules needs (flashinfer-python, nvcc, binutils,
and curand's headers for a fa3 module not in the module cache), so no op is promised that cannot be built.
The ops it has no code for at all (``Backend.implements``) go to TIR under an explicit ``"flashinfer"``
(``pagedkv.backends.resolve``).

The partial-state ops (``pagedkv.ops.PARTIAL_OPS``: a multi-pass forward's passes writing a float32 ``o``, merged in
float32) are not served here: a FlashInfer run writes ``o`` in its module's ``DTypeO``, a template parameter fixed
when the module is generated (``dtype_o``; FlashInfer's own wrappers take ``o_data_type``), and unchecked at run time,
so a float32 ``o`` needs a module of its own per op kind (another JIT build of minutes, fa3's up to 20) and adapter
entries for the ``*_partial`` ops; ``ModuleSpec`` takes fp16 / bf16 outputs only. Automatic selection serves them
from TIR: a FlashInfer cache runs its single-pass forwards on FlashInfer and its prefix-shared ones on TIR kernels
that keep the partial outputs in float32.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any, Iterator, Mapping

from .. import ops
from ..config import KVCacheConfig
from ..target import arch as _canonical_arch
from ..target import runtime_only
from .base import Backend, OpBuild, target_kind


def target_arch(target: Any) -> str | None:
    """The arch FlashInfer's module specs name for ``target`` (``pagedkv.flashinfer.spec.ARCHS``): pagedkv's
    canonical ``sm_90a`` is FlashInfer's ``sm_90`` (its fa3 modules are sm_90a code built from that name)."""
    arch = _canonical_arch(target)
    return "sm_90" if arch == "sm_90a" else arch


#: GQA group sizes FlashInfer 0.7.4's decode kernels dispatch on (DISPATCH_GQA_GROUP_SIZE); the prefill
#: kernels take any group (a runtime uint_fastdiv).
GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)

#: The MHA ops and the MLA ops the backend serves.
MHA_OPS = (ops.ATTN_DECODE_PAGED, ops.ATTN_PREFILL_RAGGED, ops.ATTN_PREFILL_PAGED)
MLA_OPS = (ops.MLA_ATTN_DECODE_PAGED, ops.MLA_ATTN_PREFILL_PAGED)

#: The module kinds each op can run on (the runtime has an adapter for each pair).
CHOICES: dict[str, tuple[str, ...]] = {
    ops.ATTN_DECODE_PAGED: ("decode", "prefill_fa2", "prefill_fa3", "decode|prefill_fa2"),
    ops.ATTN_PREFILL_RAGGED: ("prefill_fa2", "prefill_fa3"),
    ops.ATTN_PREFILL_PAGED: ("prefill_fa2", "prefill_fa3"),
    ops.MLA_ATTN_DECODE_PAGED: ("mla", "mla_fa3"),
    ops.MLA_ATTN_PREFILL_PAGED: ("mla", "mla_fa3"),
}
#: From this GQA group size on, decode may run on the prefill kernel's tensor cores (a group's query rows
#: share each K/V tile in one MMA), and from ``TENSOR_CORE_DECODE_ALWAYS_GROUP`` on it always does. Measured
#: on the H200 (benchmarks/HISTORY.md, fp16 x/8/128): at group 4 tensor cores win on uniform batches (1x32K to
#: 256x2K, by 4-25%) and lose on a skewed one (128 ... 16K, by 26%); at group 8 they win on all of them.
TENSOR_CORE_DECODE_MIN_GROUP = 4
TENSOR_CORE_DECODE_ALWAYS_GROUP = 8

_FORCED: contextvars.ContextVar[tuple] = contextvars.ContextVar("pagedkv_flashinfer_forced", default=())


def _normalize(modules: Mapping[str, str]) -> tuple:
    out = []
    for op, kind in sorted(modules.items()):
        if op not in CHOICES:
            raise ValueError(f"forced_modules: op {op!r} is not a FlashInfer op (ops: {', '.join(CHOICES)})")
        if kind not in CHOICES[op]:
            raise ValueError(f"forced_modules: op {op!r} runs on {', '.join(CHOICES[op])}, not {kind!r}")
        out.append((op, kind))
    return tuple(out)


@contextlib.contextmanager
def forced_modules(modules: Mapping[str, str]) -> Iterator[tuple]:
    """Within the block, ``op`` runs on module kind ``modules[op]`` (one of ``CHOICES[op]``)."""
    token = _FORCED.set(_normalize(modules))
    try:
        yield _FORCED.get()
    finally:
        _FORCED.reset(token)


def current_forced_modules() -> dict[str, str]:
    """``forced_modules``' choices, else those of ``PAGEDKV_FLASHINFER_MODULES`` ("op=kind,...")."""
    if _FORCED.get():
        return dict(_FORCED.get())
    env = os.environ.get("PAGEDKV_FLASHINFER_MODULES", "").strip()
    if not env:
        return {}
    pairs = dict(item.split("=", 1) for item in env.split(",") if item.strip())
    return dict(_normalize({k.strip(): v.strip() for k, v in pairs.items()}))


def use_fa3() -> bool:
    return os.environ.get("PAGEDKV_FLASHINFER_FA3", "1") != "0"


def module_kind(op: str, config: KVCacheConfig, arch: str | None) -> str:
    """The FlashInfer module kind that serves ``op`` of ``config`` on ``arch`` (see the module docstring)."""
    if op not in CHOICES:
        raise ValueError(f"no FlashInfer module for op {op!r}")
    forced = current_forced_modules().get(op)
    if forced is not None:
        return forced
    fa3 = arch == "sm_90" and use_fa3()
    windowed = config.sliding_window > 0
    if op == ops.ATTN_DECODE_PAGED:
        g = config.group_size
        if g >= TENSOR_CORE_DECODE_ALWAYS_GROUP or g not in GROUP_SIZES:
            return "prefill_fa2"
        return "decode|prefill_fa2" if g >= TENSOR_CORE_DECODE_MIN_GROUP else "decode"
    if op in (ops.ATTN_PREFILL_RAGGED, ops.ATTN_PREFILL_PAGED):
        return "prefill_fa3" if fa3 and not windowed else "prefill_fa2"
    return "mla_fa3" if fa3 else "mla"


def module_specs(op: str, config: KVCacheConfig, arch: str) -> tuple:
    """The FlashInfer modules that serve ``op`` for ``config``: one, or two for a per-forward choice
    (``"decode|prefill_fa2"``). Raises ValueError listing why a module cannot be built."""
    return tuple(_module_spec(op, config, arch, k) for k in module_kind(op, config, arch).split("|"))


def _module_spec(op: str, config: KVCacheConfig, arch: str, kind: str):
    """The FlashInfer module of kind ``kind`` for ``op`` of ``config``."""
    from ..flashinfer import MLA_KINDS, ModuleSpec

    if kind in MLA_KINDS:
        return ModuleSpec(kind, config.dtype, config.dtype, config.dtype, config.kv_lora_rank,
                          config.qk_rope_head_dim, arch=arch)
    # the v head dim of attn_prefill_ragged is v_head_dim; the paged ops read pages of head_dim
    vo = config.v_dim if op == ops.ATTN_PREFILL_RAGGED else config.head_dim
    # The options' values are run-time arguments (src/flashinfer_common.h ReadOptions); the modules only
    # need the code paths, so they are built with them exactly when the config turns them on.
    return ModuleSpec(kind, config.dtype, config.dtype, config.dtype, config.head_dim, vo, arch=arch,
                      use_sliding_window=config.sliding_window > 0,
                      use_logits_soft_cap=config.logits_soft_cap > 0)


def run_function(op: str, kind: str) -> str:
    """The module function the op's adapter runs (after ``plan``)."""
    if op == ops.ATTN_PREFILL_RAGGED:
        return "ragged_run"
    if op == ops.ATTN_PREFILL_PAGED or kind.startswith("prefill_"):
        return "paged_run"
    return "run"


def _build_reasons(specs: tuple) -> list[str]:
    """Why the modules ``specs`` can be neither built nor loaded from the cache in this process (what every
    build needs: flashinfer-python 0.7.4, nvcc, binutils, ninja; fa3 builds also curand's headers), each once."""
    from ..flashinfer.build import module_unavailable_reasons, unavailable_reasons

    if not specs:
        return unavailable_reasons()
    out: list[str] = []
    for spec in specs:
        out += [r for r in module_unavailable_reasons(spec) if r not in out]
    return out


def _rope_variant_reasons(config: KVCacheConfig) -> list[str]:
    """FlashInfer's own RoPE (``pos_encoding_mode`` ROPE_LLAMA) is the plain formula over the whole head with
    ``rope_scale`` / ``rope_theta`` (and "linear", as a scale): other variants (llama3, yarn, longrope, a partial
    ``rotary_dim``, interleaved pairs) it cannot rotate; with ``rope_mode="normal"`` the TIR ``split_rotary``
    rotates them before the cache and FlashInfer's attention serves."""
    r = config.rope
    out = []
    if r.rope_type not in ("default", "linear"):
        out.append(f"FlashInfer's RoPE (pos_encoding_mode ROPE_LLAMA) has no rope_type {r.rope_type!r}")
    if r.rotary_dim and r.rotary_dim != config.head_dim:
        out.append(f"FlashInfer's RoPE rotates the whole head, not rotary_dim {r.rotary_dim}")
    if r.interleaved:
        out.append("FlashInfer's RoPE pairs halves, not interleaved dims")
    return out


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
        if getattr(config, "layer_groups", None) is not None:
            # each window pool is a plan of its own (its pages, its passes): not wired to the FlashInfer adapters
            return ["layer_groups (per-layer windows with window-sized memory, schema 7) are not implemented on "
                    "pagedkv's FlashInfer adapters yet: the TIR kernels serve them"]
        if op in MHA_OPS:
            if config.rope_mode == "inline":
                reasons.append("rope_mode 'inline' needs RoPE inside the attention kernel with a per-entry key "
                               "position offset; pagedkv's FlashInfer modules are built without in-kernel RoPE "
                               "(use 'normal': RoPE applied before the cache)")
                reasons += _rope_variant_reasons(config)
            if config.num_qo_heads % config.num_kv_heads:
                reasons.append(f"num_qo_heads {config.num_qo_heads} is not a multiple of num_kv_heads "
                               f"{config.num_kv_heads}")
            elif (op == ops.ATTN_DECODE_PAGED and "decode" in module_kind(op, config, target_arch(target)).split("|")
                  and config.group_size not in GROUP_SIZES):
                reasons.append(f"GQA group size {config.num_qo_heads}/{config.num_kv_heads} not supported by "
                               f"the decode kernels (FlashInfer 0.7.4 dispatches {GROUP_SIZES})")
        arch, specs = target_arch(target), ()
        if arch is None:
            reasons.append("the CUDA target names no arch (FlashInfer modules are built for one)")
        else:
            try:
                specs = module_specs(op, config, arch)
            except ValueError as err:
                reasons.append(str(err).split(": ", 1)[-1])
        if not runtime_only():
            # A runtime-only process (the GPU host) builds nothing: it needs the prebuilt library, and says so
            # when it is missing. Elsewhere the op is promised only where its modules can be built or loaded.
            reasons += _build_reasons(specs)
        return reasons

    def key_part(self, config: KVCacheConfig, target: Any, ops: tuple[str, ...]) -> Any:
        """The FlashInfer version, our recipe and the module kind per op (fa2/fa3 is a choice, see
        ``module_kind``): a library built with other modules never stands in for this one."""
        from ..flashinfer.spec import FLASHINFER_VERSION, RECIPE_VERSION

        return [FLASHINFER_VERSION, RECIPE_VERSION, {op: module_kind(op, config, target_arch(target)) for op in ops}]

    def describe(self, op: str, config: KVCacheConfig, target: Any) -> str:
        return f"module {module_kind(op, config, target_arch(target))}"

    def build(self, op: str, config: KVCacheConfig, target: Any) -> OpBuild:
        """Op-table entry ``[op, "flashinfer", module_kind, empty_rows, plan, run(, plan, run)]``
        (src/flashinfer_adapter.cc): each module's ``plan`` and the op's run function, and the TIR helper
        ``pagedkv_empty_rows`` that writes pagedkv's empty state (FlashInfer writes lse = -inf for rows
        without keys)."""
        from ..flashinfer import build_module
        from ..flashinfer.link import export_options
        from ..tir_kernels import make_empty_rows

        kind = module_kind(op, config, target_arch(target))
        built = [build_module(spec) for spec in module_specs(op, config, target_arch(target))]
        names = tuple(n for b in built for n in (b.symbol("plan"), b.symbol(run_function(op, b.spec.kind))))
        helper = make_empty_rows(config.dtype, target)
        return OpBuild(op=op, backend=self.tag, adapter="flashinfer", options=(kind,),
                       prim_funcs=(("pagedkv_empty_rows", helper),), extern_symbols=names,
                       extern_modules=tuple(built), export_options=tuple(export_options()))
