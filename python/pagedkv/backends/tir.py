"""The TIR backend: every op as a TIR PrimFunc from ``pagedkv.tir_kernels``."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Iterator, Mapping

from .. import kernel_table, ops
from .. import target as _target
from ..config import KVCacheConfig
from ..kernel_spec import DTYPES, SWITCHES, KernelSpec, normalize_paths
from ..rope_spec import cuda_inline_serves
from .base import Backend, OpBuild, target_kind

#: Target kinds the TIR kernels are scheduled for.
SUPPORTED_TARGETS = ("llvm", "cuda")
#: Storage dtypes the TIR kernels take (``pagedkv.kernel_spec.DTYPES``: fp16, fp32, bf16).
SUPPORTED_DTYPES = DTYPES


_FORCED_PATHS: contextvars.ContextVar[tuple] = contextvars.ContextVar("pagedkv_tir_forced_paths", default=())


def path_switches() -> dict:
    """``pagedkv.kernel_spec.SWITCHES`` (switch -> (what reads it, values)); works with the TVM runtime only."""
    return SWITCHES


@contextlib.contextmanager
def forced_paths(paths: Mapping[str, str]) -> Iterator[tuple]:
    """Within this context, TIR kernels are compiled with their run-time code paths forced (tests reach
    every path on small shapes): ``paths`` maps switches of ``pagedkv.kernel_spec.SWITCHES`` to values,
    e.g. ``{"cpu_threads": "parallel"}``. Kernel libraries and cached modules are keyed by the forced
    paths (``key_part``), so a forced build never serves an automatic one or the reverse; in a runtime-only
    process the context selects the prebuilt libraries (``$PAGEDKV_KERNEL_DIR``) built under the same paths."""
    token = _FORCED_PATHS.set(normalize_paths(paths))
    try:
        yield _FORCED_PATHS.get()
    finally:
        _FORCED_PATHS.reset(token)


def current_forced_paths() -> tuple:
    """The normalized ``(switch, value)`` pairs forced by the innermost ``forced_paths`` (empty: none)."""
    return _FORCED_PATHS.get()


def kernel_spec_of(config: KVCacheConfig) -> KernelSpec:
    """The kernel spec of ``config`` with the paths forced now (``forced_paths``)."""
    return KernelSpec.from_config(config, paths=current_forced_paths())


@functools.lru_cache(maxsize=32)
def _all_kernels(kcfg, target_key: str) -> dict:
    # One factory call yields every op's PrimFunc; cache it so building the op table stays cheap.
    from ..tir_kernels import build_kernels

    return build_kernels(kcfg, _target.canonical(target_key))


def _cuda_attention_limits(op: str, config: KVCacheConfig) -> list[str]:
    """Shapes the CUDA attention kernels do not take (16-byte vector loads; static shared-memory tiles)."""
    d, group = config.head_dim, config.group_size
    out = []
    if op in (ops.MLA_ATTN_PREFILL_PAGED, ops.MLA_ATTN_DECODE_PAGED):
        return _cuda_mla_limits(op, config)
    if config.v_dim % 16:
        out.append(f"CUDA {op} needs v_head_dim % 16 == 0, got v_head_dim {config.v_dim}")
    if d % 16:
        out.append(f"CUDA {op} needs head_dim % 16 == 0, got head_dim {d}")
    if op != ops.ATTN_DECODE_PAGED:
        if d > 256:
            out.append(f"CUDA {op} supports head_dim <= 256, got head_dim {d}")
        elif group > (16 if d > 128 else 32):
            out.append(f"CUDA {op} supports GQA groups up to {16 if d > 128 else 32} at head_dim {d}, "
                       f"got {group}")
    return out


#: Limits of the CUDA MLA attention kernels (``tir_kernels/mla_cuda.py``: 16-byte page vectors that never
#: straddle the value / rope boundary; float32 output accumulators and 48 KB of static shared memory).
#: Kept here as numbers because a runtime-only process validates without importing the kernels.
MLA_CUDA_MAX_RANK = 1024
MLA_CUDA_MAX_LATENT = 1216


def _cuda_mla_limits(op: str, config: KVCacheConfig) -> list[str]:
    out = [f"CUDA {op} needs {name} to be a multiple of 16, got {value}"
           for name, value in (("kv_lora_rank", config.kv_lora_rank), ("qk_rope_head_dim", config.qk_rope_head_dim))
           if value % 16]
    if config.kv_lora_rank > MLA_CUDA_MAX_RANK:
        out.append(f"CUDA {op} supports kv_lora_rank up to {MLA_CUDA_MAX_RANK}, got {config.kv_lora_rank}")
    if config.latent_dim > MLA_CUDA_MAX_LATENT:
        out.append(f"CUDA {op} supports kv_lora_rank + qk_rope_head_dim up to {MLA_CUDA_MAX_LATENT}, got "
                   f"{config.latent_dim}")
    return out


def _cuda_inline_rope_limits(op: str, config: KVCacheConfig) -> list[str]:
    """The CUDA attention kernels' inline RoPE pairs the halves of the whole head (their lane layouts): every
    ``rope_type`` of that shape is served (the decode's lane-group kernel and the SIMT prefill take the variant's
    table), a partial ``rotary_dim`` or interleaved pairs are refused with ``rope_mode="inline"`` (the kernels raise
    on ``apply_rope != 0``); ``"normal"`` serves them (``split_rotary`` rotates before the cache)."""
    if config.rope_mode != "inline" or config.is_mla or cuda_inline_serves(config.rope, config.head_dim):
        return []
    r = config.rope
    what = ", ".join(([f"rotary_dim {r.rotary_dim}"] if r.dims(config.head_dim) != config.head_dim else [])
                     + (["interleaved pairs"] if r.interleaved else []))
    return [f"CUDA {op} has no inline RoPE for {what} yet (its lane layouts pair the halves of the whole head; "
            "the CPU kernels and split_rotary take them): use rope_mode 'normal' (split_rotary rotates q and k "
            "before the cache)"]


def _cpu_attention_limits(op: str, config: KVCacheConfig) -> list[str]:
    """The CPU attention kernels accumulate ``P @ V`` in pairs of value columns (``tir_kernels`` tile plan):
    an odd value head dim would leave the output unwritten, so it is refused here."""
    if op == ops.ATTN_PREFILL_RAGGED:
        name, value = "v_head_dim", config.v_dim
    elif op in (ops.MLA_ATTN_PREFILL_PAGED, ops.MLA_ATTN_DECODE_PAGED):
        name, value = "kv_lora_rank", config.kv_lora_rank  # the value dim of the absorbed attention
    elif not config.is_mla:
        name, value = "head_dim", config.head_dim  # MHA pages hold V at head_dim
    else:
        return []  # an MHA op of an MLA config: refused as such
    if value % 2:
        return [f"TIR CPU {op} needs an even value head dim (it accumulates P @ V in pairs of value columns), "
                f"got {name} {value}"]
    return []


#: The ops that read or write FP8 pages (an FP8 cache's other ops see only dtype tensors). The partial-state
#: variants run their attention op's kernel.
FP8_PAGE_OPS = frozenset({ops.APPEND_KV, ops.GATHER_KV, ops.ATTN_PREFILL_PAGED, ops.ATTN_DECODE_PAGED, ops.COPY_PAGE,
                          ops.COMPACT_COPY, ops.MLA_APPEND_KV, ops.MLA_GATHER_KV, ops.MLA_ATTN_PREFILL_PAGED,
                          ops.MLA_ATTN_DECODE_PAGED, ops.ATTN_PREFILL_RAGGED,
                          *(p for b, p in ops.PARTIAL_OF.items())})


def fp8_path(op: str, config: KVCacheConfig) -> str:
    """What the CPU kernel of ``op`` does with an FP8 cache's pages and scales (``pagedkv backends``)."""
    mla = config.is_mla
    k, v = ("ckv_scale / kpe_scale", "ckv_scale") if mla else ("k_scale", "v_scale")
    reads = {ops.ATTN_DECODE_PAGED, ops.ATTN_PREFILL_PAGED, ops.MLA_ATTN_DECODE_PAGED, ops.MLA_ATTN_PREFILL_PAGED}
    if op in reads:
        return (f"FP8 e4m3 pages decoded by integer ops; {k} folded into q (per kv head), {v} into o when each "
                "pass stores it")
    if op == ops.ATTN_PREFILL_RAGGED:
        if mla:
            return "FP8 cache: self_attention reads the model's k / v (dtype), no pages"
        return ("FP8 cache: new k / v read as their pages will hold them (e4m3 of x / scale), k_scale folded into q, "
                "v_scale into o")
    if op in (ops.APPEND_KV, ops.MLA_APPEND_KV):
        return f"FP8 e4m3 pages: writes e4m3(x / scale), round to nearest even, saturated at +-448 ({k}, {v})"
    if op in (ops.GATHER_KV, ops.MLA_GATHER_KV):
        return "FP8 e4m3 pages: reads code * scale"
    if op in (ops.COPY_PAGE, ops.COMPACT_COPY):
        return "FP8 e4m3 pages: copies the bytes"
    return "FP8 cache: dtype tensors only (no pages)"


class TIRBackend(Backend):
    """TIR kernels (our own, ``pagedkv.tir_kernels``) for every op."""

    tag = "tir"
    ops = ops.OPS

    def validate_configuration(self, op: str, config: KVCacheConfig, target: Any) -> list[str]:
        reasons = self._unsupported_op(op)
        layer_kind = "mla" if config.is_mla else "mha"
        if op not in ops.OPS_BY_KIND[layer_kind]:
            reasons.append(f"op {op!r} is not an op of {layer_kind} layers")
        kind = target_kind(target)
        if kind not in SUPPORTED_TARGETS:
            reasons.append(f"TIR kernels are not scheduled for target kind {kind!r} "
                           f"(supported: {', '.join(SUPPORTED_TARGETS)})")
        if config.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {config.dtype!r} not supported (supported: {SUPPORTED_DTYPES})")
        if kind == "cuda":
            why = _target.unserved_arch(_target.arch(target))  # before any code is generated
            reasons += [why] if why else []
        kernel_op = ops.BASE_OF.get(op, op)  # a partial-state variant is its attention op's kernel
        if kind == "cuda" and kernel_op in ops.ATTENTION_OPS:
            reasons += _cuda_attention_limits(kernel_op, config)
            reasons += _cuda_inline_rope_limits(kernel_op, config)
        if kind == "llvm" and kernel_op in ops.ATTENTION_OPS:
            reasons += _cpu_attention_limits(kernel_op, config)
        mla_self = config.is_mla and kernel_op == ops.ATTN_PREFILL_RAGGED  # reads no cached values
        if kind == "cuda" and getattr(config, "fp8", False) and op in FP8_PAGE_OPS and not mla_self:
            reasons.append(f"kv_dtype {config.kv_dtype}: the CUDA TIR kernels read pages of the cache dtype only "
                           "(FP8 pages are served by the CPU kernels, target llvm)")
        return reasons

    def describe(self, op: str, config: KVCacheConfig, target: Any) -> str:
        """The kernel ``op`` gets: on CUDA the variant of the selection table (``pagedkv.kernel_table``) and
        why the faster ones were not taken."""
        kind = target_kind(target)
        head = f"TIR {kind} kernel pagedkv_{op}"
        kernel_op = ops.BASE_OF.get(op, op)  # a partial-state variant runs its attention op's kernel
        if getattr(config, "fp8", False) and kind == "llvm":
            return f"{head}: {fp8_path(kernel_op, config)}"
        if kind != "cuda" or kernel_op not in kernel_table.SWITCH_OF_OP:
            return head
        spec = dataclasses.replace(kernel_spec_of(config), target_arch=_target.arch(target) or "")
        try:
            out = f"{head}: {kernel_table.choose(kernel_op, spec).explain()}"
            if kernel_op == ops.ATTN_DECODE_PAGED and config.rope_mode == "inline":
                out += f" | inline RoPE: {kernel_table.choose(kernel_op, spec, rope=True).explain()}"
        except NotImplementedError as err:
            return f"{head}: {err}"
        return out

    def key_part(self, config: KVCacheConfig, target: Any, ops: tuple[str, ...]) -> Any:
        """Forced code paths (``forced_paths``) change the compiled kernels: they join the library key."""
        paths = current_forced_paths()
        return {"paths": [list(p) for p in paths]} if paths else None

    def build(self, op: str, config: KVCacheConfig, target: Any) -> OpBuild:
        from ..tir_kernels import adapter_of

        func = _all_kernels(kernel_spec_of(config), _target.key(target))[op]
        # The kernel says how the runtime calls it (direct, or direct_max_kv_len: a launch-shape hint after the ABI).
        return OpBuild(op=op, backend=self.tag, prim_funcs=((f"pagedkv_{op}", func),), adapter=adapter_of(func))
