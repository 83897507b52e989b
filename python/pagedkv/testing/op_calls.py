"""Calling a compiled op-table entry's function directly, as the runtime's adapter would (kernel tests and
benchmarks that bypass the cache)."""

from __future__ import annotations

from typing import Any, Callable

from ..ops import ADAPTER_ARGS

_PREFIX = "adapter="


def entry_adapter(entry) -> str:
    """The runtime adapter kind of an op-table entry ``[op, tag, "adapter=<kind>", ...]`` (``direct`` for the
    older ``[op, tag, func...]``)."""
    third = entry[2] if len(entry) > 2 else None
    if isinstance(third, str) and third.startswith(_PREFIX):
        return third[len(_PREFIX):]
    return "direct"


def op_function(entry) -> Callable[..., Any]:
    """The one function of a ``direct`` / ``direct_max_kv_len`` entry, as ``f(*abi_args, **facts)``: the op's
    ABI arguments positionally, the runtime's facts by name (``pagedkv.ops.ADAPTER_ARGS``, e.g.
    ``max_kv_len``). Each fact the entry's adapter passes must be given; the others are dropped, as the
    runtime gives a ``direct`` function none (so one call serves kernels of either kind)."""
    adapter, func = entry_adapter(entry), entry[-1]
    if adapter not in ADAPTER_ARGS:
        raise ValueError(f"op {entry[0]!r}: adapter {adapter!r} is not a direct call (it plans; use the cache)")
    known = {a.name for args in ADAPTER_ARGS.values() for a in args}
    names = [a.name for a in ADAPTER_ARGS[adapter]]

    def call(*abi_args, **facts):
        unknown, missing = set(facts) - known, [n for n in names if n not in facts]
        if unknown or missing:
            raise TypeError(f"op {entry[0]!r} (adapter {adapter!r}) takes {names or 'no facts'}; missing "
                            f"{missing}, unknown {sorted(unknown)}")
        return func(*abi_args, *(facts[n] for n in names))

    call.adapter = adapter
    return call


__all__ = ["entry_adapter", "op_function"]
