"""TIR kernels of pagedkv: one factory per op, dispatching on the target kind.

Imported as ``pagedkv.tir_kernels`` (installed, or from a source checkout). Argument lists are those of
the op table ``pagedkv.ops.OP_SPECS``; every PrimFunc carries the global symbol ``pagedkv_<op>``.

Example
-------
>>> import tvm
>>> from pagedkv.tir_kernels import KernelConfig, build_kernels, host_target
>>> funcs = build_kernels(KernelConfig(32, 8, 128, 128, "float16"), host_target())
>>> lib = tvm.compile(tvm.IRModule({f"pagedkv_{op}": f for op, f in funcs.items()}), target=host_target())
"""

from __future__ import annotations

from ..kernel_spec import DTYPES, SWITCHES, KernelSpec, forced, normalize_paths  # the spec, written once
from ..ops import OPS, OPS_BY_KIND  # the op vocabulary, written once (pagedkv.ops)
from ._abi import abi_dims, abi_prim_func
from ._common import as_target, dispatch, host_target
from .attention_cpu import (
    attn_decode_paged_cpu,
    attn_prefill_paged_cpu,
    attn_prefill_ragged_cpu,
)
from .attention_cuda import (
    attn_decode_paged_cuda,
    attn_prefill_paged_cuda,
    attn_prefill_ragged_cuda,
)
from .empty_rows import empty_rows_cpu, empty_rows_cuda
from .merge import merge_state_cpu
from .merge_cuda import merge_state_cuda
from .mla_cpu import mla_attn_decode_paged_cpu, mla_attn_prefill_paged_cpu
from .page_ops import (
    append_kv_cpu,
    compact_copy_cpu,
    copy_page_cpu,
    gather_kv_cpu,
    mla_append_kv_cpu,
    mla_gather_kv_cpu,
)
from .page_ops_cuda import (
    append_kv_cuda,
    compact_copy_cuda,
    copy_page_cuda,
    gather_kv_cuda,
)
from .rope import split_rotary_cpu
from .rope_cuda import split_rotary_cuda



#: The kernel spec (``pagedkv.kernel_spec.KernelSpec``) under the kernels' older name.
KernelConfig = KernelSpec


def make_split_rotary(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_split_rotary`` for ``target``."""
    return dispatch("split_rotary", target, {
        "llvm": lambda: split_rotary_cpu(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype),
        "cuda": lambda: split_rotary_cuda(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)})


def make_append_kv(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_append_kv`` for ``target``."""
    return dispatch("append_kv", target, {
        "llvm": lambda: append_kv_cpu(cfg.num_kv_heads, cfg.head_dim, cfg.dtype),
        "cuda": lambda: append_kv_cuda(cfg.num_kv_heads, cfg.head_dim, cfg.dtype)})


def make_gather_kv(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_gather_kv`` for ``target``."""
    return dispatch("gather_kv", target, {
        "llvm": lambda: gather_kv_cpu(cfg.num_kv_heads, cfg.head_dim, cfg.dtype),
        "cuda": lambda: gather_kv_cuda(cfg.num_kv_heads, cfg.head_dim, cfg.dtype)})


def make_attn_prefill_ragged(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_attn_prefill_ragged`` for ``target``."""
    return dispatch("attn_prefill_ragged", target, {
        "llvm": lambda: attn_prefill_ragged_cpu(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                                                cfg.v_head_dim, cfg.dtype, **cfg.masking, paths=cfg.paths),
        "cuda": lambda: attn_prefill_ragged_cuda(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                                                 cfg.v_head_dim, cfg.dtype, **cfg.masking)})


def make_attn_prefill_paged(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_attn_prefill_paged`` for ``target``."""
    return dispatch("attn_prefill_paged", target, {
        "llvm": lambda: attn_prefill_paged_cpu(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                                               cfg.dtype, **cfg.masking, paths=cfg.paths),
        "cuda": lambda: attn_prefill_paged_cuda(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                                                cfg.dtype, **cfg.masking)})


def make_attn_decode_paged(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_attn_decode_paged`` for ``target``."""
    return dispatch("attn_decode_paged", target, {
        "llvm": lambda: attn_decode_paged_cpu(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                                              cfg.dtype, **cfg.masking, paths=cfg.paths),
        "cuda": lambda: attn_decode_paged_cuda(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                                               cfg.dtype, **cfg.masking, **_cuda_decode_paths(cfg))})


def _cuda_decode_paths(cfg: KernelConfig) -> dict:
    """Forced paths of the CUDA decode kernels (MHA and MLA) as keyword arguments: ``decode_splits`` (0 =
    automatic; ``pagedkv.kernel_spec.SWITCHES["cuda_decode_splits"]``)."""
    splits = forced(cfg.paths, "cuda_decode_splits")
    return {"decode_splits": 0 if splits == "auto" else int(splits)}


def make_merge_state(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_merge_state`` for ``target`` (``H = num_qo_heads``; ``Dv`` symbolic)."""
    return dispatch("merge_state", target, {
        "llvm": lambda: merge_state_cpu(cfg.num_qo_heads, cfg.dtype),
        "cuda": lambda: merge_state_cuda(cfg.num_qo_heads, cfg.dtype)})


def _page_layout(cfg: KernelConfig) -> tuple[int, int, int]:
    """(kv heads, row length, planes) of one page: MHA ``[2, Hkv, ps, D]``, MLA ``[1, 1, ps, DL]``."""
    return (1, cfg.latent_dim, 1) if cfg.is_mla else (cfg.num_kv_heads, cfg.head_dim, 2)


def make_copy_page(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_copy_page`` for ``target`` (MHA or MLA pages)."""
    hkv, d, planes = _page_layout(cfg)
    return dispatch("copy_page", target, {
        "llvm": lambda: copy_page_cpu(hkv, d, cfg.dtype, planes=planes),
        "cuda": lambda: copy_page_cuda(hkv, d, cfg.dtype, planes=planes)})


def make_compact_copy(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_compact_copy`` for ``target`` (MHA or MLA pages)."""
    hkv, d, planes = _page_layout(cfg)
    return dispatch("compact_copy", target, {
        "llvm": lambda: compact_copy_cpu(hkv, d, cfg.dtype, planes=planes),
        "cuda": lambda: compact_copy_cuda(hkv, d, cfg.dtype, planes=planes)})


def _mla_cuda(name: str):
    from . import mla_cuda  # pylint: disable=import-outside-toplevel

    return getattr(mla_cuda, name)


def _check_mla(cfg: KernelConfig, op: str) -> None:
    if not cfg.is_mla:
        raise ValueError(f"{op} needs an MLA KernelConfig (kv_lora_rank and qk_rope_head_dim > 0)")


def make_mla_append_kv(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_mla_append_kv`` for ``target``."""
    _check_mla(cfg, "mla_append_kv")
    return dispatch("mla_append_kv", target, {
        "llvm": lambda: mla_append_kv_cpu(cfg.latent_dim, cfg.dtype),
        "cuda": lambda: _mla_cuda("mla_append_kv_cuda")(cfg.latent_dim, cfg.dtype)})


def make_mla_gather_kv(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_mla_gather_kv`` for ``target``."""
    _check_mla(cfg, "mla_gather_kv")
    return dispatch("mla_gather_kv", target, {
        "llvm": lambda: mla_gather_kv_cpu(cfg.latent_dim, cfg.dtype),
        "cuda": lambda: _mla_cuda("mla_gather_kv_cuda")(cfg.latent_dim, cfg.dtype)})


def make_mla_attn_prefill_paged(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_mla_attn_prefill_paged`` for ``target``."""
    _check_mla(cfg, "mla_attn_prefill_paged")
    args = (cfg.num_qo_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.dtype)
    return dispatch("mla_attn_prefill_paged", target, {
        "llvm": lambda: mla_attn_prefill_paged_cpu(*args, paths=cfg.paths),
        "cuda": lambda: _mla_cuda("mla_attn_prefill_paged_cuda")(*args)})


def make_mla_attn_decode_paged(cfg: KernelConfig, target):
    """PrimFunc ``pagedkv_mla_attn_decode_paged`` for ``target``."""
    _check_mla(cfg, "mla_attn_decode_paged")
    args = (cfg.num_qo_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.dtype)
    return dispatch("mla_attn_decode_paged", target, {
        "llvm": lambda: mla_attn_decode_paged_cpu(*args, paths=cfg.paths),
        "cuda": lambda: _mla_cuda("mla_attn_decode_paged_cuda")(*args, **_cuda_decode_paths(cfg))})


def make_empty_rows(dtype: str, target):
    """PrimFunc ``pagedkv_empty_rows(o, lse, fill)`` for ``target`` (not an op: the FlashInfer backend's helper
    that writes pagedkv's empty state, see ``empty_rows.py``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dispatch("empty_rows", target, {"llvm": lambda: empty_rows_cpu(dtype),
                                           "cuda": lambda: empty_rows_cuda(dtype)})


#: op name -> factory ``(cfg, target) -> PrimFunc``.
FACTORIES = {
    "split_rotary": make_split_rotary,
    "append_kv": make_append_kv,
    "gather_kv": make_gather_kv,
    "attn_prefill_ragged": make_attn_prefill_ragged,
    "attn_prefill_paged": make_attn_prefill_paged,
    "attn_decode_paged": make_attn_decode_paged,
    "merge_state": make_merge_state,
    "copy_page": make_copy_page,
    "compact_copy": make_compact_copy,
    "mla_append_kv": make_mla_append_kv,
    "mla_gather_kv": make_mla_gather_kv,
    "mla_attn_prefill_paged": make_mla_attn_prefill_paged,
    "mla_attn_decode_paged": make_mla_attn_decode_paged,
}


def build_kernels(cfg: KernelConfig, target, ops=None) -> dict:
    """Every op's PrimFunc (global symbol ``pagedkv_<op>``) for ``cfg`` on ``target``.

    Parameters
    ----------
    cfg : KernelConfig
    target : str | dict | tvm.target.Target
    ops : iterable of str, optional
        A subset of ``OPS``; default: every op of ``cfg``'s layer kind (``OPS_BY_KIND``).

    Returns
    -------
    dict[str, tvm.tirx.PrimFunc]
        Keyed by op name, in ``OPS`` order.
    """
    target = as_target(target)
    wanted = OPS_BY_KIND["mla" if cfg.is_mla else "mha"] if ops is None else tuple(ops)
    unknown = [op for op in wanted if op not in FACTORIES]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; known ops: {', '.join(OPS)}")
    return {op: FACTORIES[op](cfg, target) for op in OPS if op in wanted}


__all__ = ["OPS", "OPS_BY_KIND", "KernelConfig", "KernelSpec", "abi_dims", "abi_prim_func", "SWITCHES", "forced", "normalize_paths", "FACTORIES", "build_kernels", "host_target", "make_empty_rows"] + [
    f"make_{op}" for op in OPS]
