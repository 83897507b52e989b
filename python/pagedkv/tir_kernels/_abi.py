"""PrimFunc headers from the op table (``pagedkv.ops.OP_SPECS``): a kernel writes its body once as a
``@T.macro`` and ``abi_prim_func`` gives it the op's parameters, buffers and attributes, so no kernel types
its own argument list.

The body is called as ``body(*args, dims)``: ``args`` are the op's arguments in ABI order (buffers for
tensors, typed scalars), then those its runtime adapter kind adds (``pagedkv.ops.call_args``: e.g.
``max_kv_len`` of ``direct_max_kv_len``; the PrimFunc's attribute ``pagedkv.adapter`` names the kind, and the
TIR backend puts it in the op table), ``dims`` the tuple of its run-time shape variables in ``abi_dims(op)`` order (e.g.
``("b", "p", "ps", "nnz")`` for ``attn_decode_paged``). Every tensor but ``pages`` is matched with a
symbolic ``elem_offset`` (the runtime passes views into one index buffer); ``pages`` never has one.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Mapping

import tvm
from tvm.script import from_source
from tvm.script import tirx as T

from ..ops import PARTIAL_OF, SPECS, call_args

_SCALAR = {"int32": "T.int32", "int64": "T.int64", "float32": "T.float32"}


def abi_dims(op: str) -> tuple[str, ...]:
    """The run-time shape symbols of ``op`` in order of first appearance (the ``dims`` a body receives)."""
    out: list[str] = []
    for arg in SPECS[op].args:
        for sym in arg.shape or ():
            base = sym.removesuffix("+1")
            if base[0].islower() and base not in out:
                out.append(base)
    return tuple(out)


def _dim(sym: str, shape: Mapping[str, int]) -> str:
    if sym[0].islower():
        return f"{sym[:-2]} + 1" if sym.endswith("+1") else sym
    missing = [w for w in re.findall(r"[A-Za-z]+", sym) if w not in shape]
    if missing:
        raise KeyError(f"shape symbol(s) {missing} of {sym!r} have no value (give them in `shape`)")
    return str(int(eval(sym, {}, dict(shape))))  # noqa: S307 (the op table's own arithmetic, e.g. Hq+2*Hkv)


@functools.lru_cache(maxsize=None)
def _header(op: str, shape_items: tuple, dtype: str, scheduled: bool, symbol: str, adapter: str,
            any_align: tuple = (), page_dtype: str | None = None) -> str:
    args, shape = call_args(op, adapter), dict(shape_items)
    params, lines = [], []
    for a in args:
        if a.is_tensor:
            params.append(f"{a.name}_h: T.handle")
            dt = dtype if a.dtype == "cache" else a.dtype
            if a.name == "pages" and page_dtype:  # FP8 pages: bytes (tir_kernels._fp8)
                dt = page_dtype
            dims = ", ".join(_dim(s, shape) for s in a.shape)
            offset = "" if a.name == "pages" else ", elem_offset=T.int32()"
            if a.name in any_align:  # the data pointer itself may sit anywhere (element-aligned)
                offset += f", align={tvm.DataType(dt).bits // 8}"
            lines.append(f"    {a.name} = T.match_buffer({a.name}_h, ({dims},), \"{dt}\"{offset})")
        else:
            params.append(f"{a.name}: {_SCALAR[a.dtype]}")
    attrs = f'"global_symbol": "{symbol}", "tirx.noalias": True, "pagedkv.adapter": "{adapter}"' + (
        ', "tirx.is_scheduled": True' if scheduled else "")
    dims = abi_dims(op)
    head = [f"def {op}({', '.join(params)}):", f"    T.func_attr({{{attrs}}})"]
    if dims:
        head.append(f"    {', '.join(dims)} = " + ", ".join("T.int32()" for _ in dims))
    call = ", ".join([a.name for a in args] + [f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"])
    return "\n".join(["@T.prim_func", *head, *lines, f"    body({call})", ""])


def abi_prim_func(op: str, shape: Mapping[str, int], dtype: str, body: Any, *, scheduled: bool = False,
                  symbol: str | None = None, adapter: str = "direct", any_align: tuple[str, ...] = (),
                  page_dtype: str | None = None):
    """The PrimFunc (global symbol ``symbol``, default ``pagedkv_<op>``) whose parameters are the op table's and whose body is ``body``.

    Parameters
    ----------
    op : str
        An op of ``pagedkv.ops.OPS``.
    shape : mapping
        Values of the compile-time shape symbols the op's tensors use (``Hq``, ``Hkv``, ``D``, ``Dv``,
        ``DL``, ``R``, ``PL``, ``PH``, ``PD``; ``pagedkv.ops.shape_values`` gives all of them for a config).
    dtype : str
        The cache dtype (tensors of dtype ``"cache"`` in the table).
    body : T.macro
        Called as ``body(*args, dims)`` (module docstring).
    scheduled : bool
        Mark the function ``tirx.is_scheduled`` (CUDA kernels that bind their own threads).
    symbol : str, optional
        Another backend's name for its function (its ``OpBuild.prim_funcs`` name must be the same).
    adapter : str
        The runtime adapter kind that calls it (``pagedkv.ops.ADAPTER_ARGS``): its arguments follow the op's,
        and the body receives them after the op's (before ``dims``).
    any_align : tuple of str
        Tensor arguments declared element-aligned instead of TVM's default 64 bytes (the calling convention is
        the same): host code that tests their addresses (``_tma_cuda.host_aligned16``) must not have the test
        folded away by that assumption (callers do pass views, e.g. torch slices, whose data pointers are not).
    page_dtype : str, optional
        The dtype of ``pages`` when it is not ``dtype`` (``KernelSpec.page_dtype``: ``uint8`` for FP8 pages).
    """
    src = _header(op, tuple(sorted(shape.items())), dtype, scheduled, symbol or SPECS[op].symbol, adapter,
                  tuple(any_align), None if page_dtype == dtype else page_dtype)
    return from_source(src, extra_vars={"T": T, "body": body})


def spec_op(op: str, spec) -> str:
    """The op whose header a factory of attention op ``op`` gives its PrimFunc for ``spec`` (a ``KernelSpec``):
    ``op``, or its partial-state variant (``pagedkv.ops.PARTIAL_OF``: ``o`` float32) when ``spec.partial``."""
    return PARTIAL_OF[op] if spec.partial else op


def adapter_of(func) -> str:
    """The runtime adapter kind a PrimFunc of ``abi_prim_func`` is called through (its ``pagedkv.adapter``)."""
    attrs = func.attrs or {}
    return str(attrs["pagedkv.adapter"]) if "pagedkv.adapter" in attrs else "direct"


__all__ = ["abi_dims", "abi_prim_func", "adapter_of", "spec_op"]
