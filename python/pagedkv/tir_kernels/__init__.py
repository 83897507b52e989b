"""TIR kernels of pagedkv: one factory per op, dispatching on the target kind.

Imported as ``pagedkv.tir_kernels`` (installed, or from a source checkout). Argument lists are those of
the op table ``pagedkv.ops.OP_SPECS``; every PrimFunc carries the global symbol ``pagedkv_<op>``.

Example
-------
>>> import tvm
>>> from pagedkv.tir_kernels import KernelSpec, build_kernels, host_target
>>> funcs = build_kernels(KernelSpec(32, 8, 128, 128, "float16"), host_target())
>>> lib = tvm.compile(tvm.IRModule({f"pagedkv_{op}": f for op, f in funcs.items()}), target=host_target())
"""

from __future__ import annotations

import dataclasses

from ..kernel_spec import DTYPES, SWITCHES, KernelSpec, forced, normalize_paths  # the spec, written once
from ..target import canonical as canonical_target
from ..ops import BASE_OF, OPS, OPS_BY_KIND, ops_for  # the op vocabulary, written once (pagedkv.ops)
from ._abi import abi_dims, abi_prim_func, adapter_of
from ._common import as_target, dispatch, host_target
from . import family_cpu, family_cuda

#: target kind -> the family's op factories (each family owns its table: ``family_cpu``, ``family_cuda``).
FAMILIES = {"llvm": family_cpu, "cuda": family_cuda}


def _check_mla(cfg: KernelSpec, op: str) -> None:
    if op.startswith("mla_") and not cfg.is_mla:
        raise ValueError(f"{op} needs an MLA KernelSpec (kv_lora_rank and qk_rope_head_dim > 0)")


def make(op: str, cfg: KernelSpec, target):
    """PrimFunc ``pagedkv_<op>`` of ``cfg`` for ``target``'s family (``FAMILIES``); a CUDA target's arch
    reaches the family as ``cfg.target_arch`` (unless the spec already names one). A partial-state op
    (``pagedkv.ops.BASE_OF``) is its attention op's kernel built with ``cfg.partial``: o in float32."""
    _check_mla(cfg, op)
    target = as_target(target)
    if target.kind.name == "cuda" and not cfg.target_arch:  # the canonical arch: sm_90 is sm_90a (Hopper)
        cfg = dataclasses.replace(cfg, target_arch=canonical_target(target)["arch"])
    if op in BASE_OF:
        cfg, op = dataclasses.replace(cfg, partial=True), BASE_OF[op]
    return dispatch(op, target, {kind: (lambda fam=fam: fam.FACTORIES[op](cfg)) for kind, fam in FAMILIES.items()})


def make_empty_rows(dtype: str, target):
    """PrimFunc ``pagedkv_empty_rows(o, lse, fill)`` for ``target`` (not an op: the FlashInfer backend's helper
    that writes pagedkv's empty state, see ``empty_rows.py``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dispatch("empty_rows", target, {kind: (lambda fam=fam: fam.HELPERS["empty_rows"](dtype))
                                           for kind, fam in FAMILIES.items()})


def _op_factory(op: str):
    def factory(cfg: KernelSpec, target):
        return make(op, cfg, target)

    factory.__name__ = f"make_{op}"
    factory.__doc__ = f"PrimFunc ``pagedkv_{op}`` for ``target``."
    return factory


#: op name -> factory ``(cfg, target) -> PrimFunc``.
FACTORIES = {op: _op_factory(op) for op in OPS}
globals().update({f"make_{op}": f for op, f in FACTORIES.items()})


def build_kernels(cfg: KernelSpec, target, ops=None) -> dict:
    """Every op's PrimFunc (global symbol ``pagedkv_<op>``) for ``cfg`` on ``target``.

    Parameters
    ----------
    cfg : KernelSpec
    target : str | dict | tvm.target.Target
    ops : iterable of str, optional
        A subset of ``OPS``; default: every op a cache of ``cfg`` uses (``pagedkv.ops.ops_for``: its layer
        kind's, without the partial-state ops for float32).

    Returns
    -------
    dict[str, tvm.tirx.PrimFunc]
        Keyed by op name, in ``OPS`` order.
    """
    target = as_target(target)
    wanted = ops_for(cfg) if ops is None else tuple(ops)
    unknown = [op for op in wanted if op not in FACTORIES]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; known ops: {', '.join(OPS)}")
    return {op: FACTORIES[op](cfg, target) for op in OPS if op in wanted}


__all__ = ["OPS", "OPS_BY_KIND", "FAMILIES", "KernelSpec", "KernelSpec", "make", "abi_dims", "abi_prim_func", "adapter_of", "SWITCHES", "forced", "normalize_paths", "FACTORIES", "build_kernels", "host_target", "make_empty_rows"] + [
    f"make_{op}" for op in OPS]
