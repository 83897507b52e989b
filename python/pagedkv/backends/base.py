"""The backend interface: what a backend must say about an op, and what it builds for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..config import KVCacheConfig
from ..target import kind as target_kind  # noqa: F401 (re-exported: backends.target_kind)

#: Runtime adapter kinds (src/backend.cc): how the runtime calls an op's functions. ``direct``: the one function
#: follows the op's kernel ABI (src/ops.h) and is called with it unchanged (any backend whose functions do
#: needs no C++); ``direct_max_kv_len``: the same, then the longest entry's keys of the call's pass
#: (``pagedkv.ops.ADAPTER_ARGS``); ``flashinfer``: plan once per forward, run per layer (src/flashinfer_adapter.cc).
ADAPTERS = ("direct", "direct_max_kv_len", "flashinfer")


@dataclass(frozen=True)
class OpBuild:
    """What one backend built for one op.

    The op-table entry is ``[op, backend, "adapter=<adapter>", *options, *prim_funcs, *extern_symbols]``
    (``op_table_head``): ``adapter`` is the runtime adapter kind (``ADAPTERS``), separate from the backend
    tag; ``options`` are strings the adapter reads first (e.g. which FlashInfer module kind its functions
    come from); ``prim_funcs`` are TIR functions the caller adds to an IRModule under their names;
    ``extern_symbols`` name functions linked in from ``extern_modules``; ``export_options`` are the
    ``export_library(options=...)`` flags a library holding them needs (e.g. ``-lcudart``).
    """

    op: str
    backend: str
    prim_funcs: tuple[tuple[str, Any], ...] = ()
    options: tuple[str, ...] = ()
    extern_symbols: tuple[str, ...] = ()
    extern_modules: tuple[Any, ...] = field(default=(), compare=False)
    adapter: str = "direct"
    export_options: tuple[str, ...] = ()

    def __post_init__(self):
        if self.adapter not in ADAPTERS:
            raise ValueError(f"OpBuild.adapter must be one of {ADAPTERS}, got {self.adapter!r}")

    def op_table_head(self) -> list[str]:
        """The strings an op-table entry starts with (the functions follow)."""
        return [self.op, self.backend, f"adapter={self.adapter}", *self.options]


class Backend:
    """Base class of attention backends.

    Subclasses set ``tag`` and ``ops`` and implement ``validate_configuration`` and ``build``. A backend
    never falls back: when it cannot serve, it says why.
    """

    tag: ClassVar[str] = ""
    #: The ops this backend implements at all.
    ops: ClassVar[tuple[str, ...]] = ()

    def validate_configuration(self, op: str, config: KVCacheConfig, target: Any) -> list[str]:
        """Every reason this backend cannot serve ``op`` for ``config`` on ``target`` (empty: it can)."""
        raise NotImplementedError

    def build(self, op: str, config: KVCacheConfig, target: Any) -> OpBuild:
        """Build the functions of ``op``; only called when ``validate_configuration`` returned no reason."""
        raise NotImplementedError

    def describe(self, op: str, config: KVCacheConfig, target: Any) -> str:
        """A short note on how this backend serves ``op`` (e.g. which module kind), shown by
        ``pagedkv backends``; only called when ``validate_configuration`` returned no reason."""
        return ""

    def key_part(self, config: KVCacheConfig, target: Any, ops: tuple[str, ...]) -> Any:
        """What besides the kernel shape of ``config``, the target and the op choice decides this backend's
        functions for ``ops`` right now (JSON-able; ``None``: nothing): e.g. module variants or forced code
        paths. It joins the kernel library key and the compiled-module cache key."""
        return None

    def implements(self, op: str) -> bool:
        """Whether this backend has code for ``op`` at all (whatever the config): an explicit backend list none
        of whose backends implements an op leaves it to ``pagedkv.backends.FILL_BACKEND``."""
        return op in self.ops

    def _unsupported_op(self, op: str) -> list[str]:
        if op not in self.ops:
            return [f"backend {self.tag!r} does not implement op {op!r}"]
        return []
