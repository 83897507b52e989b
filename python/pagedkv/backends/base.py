"""The backend interface: what a backend must say about an op, and what it builds for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from ..config import KVCacheConfig


def target_kind(target: Any) -> str:
    """The target's kind name (``"llvm"``, ``"cuda"``, ...) for a ``Target``, dict or string."""
    if isinstance(target, str):
        return target.split()[0]
    if isinstance(target, Mapping):
        return str(target["kind"])
    return str(target.kind.name)


@dataclass(frozen=True)
class OpBuild:
    """What one backend built for one op.

    The op-table entry is ``[op, backend, *options, *prim_funcs, *extern_symbols]``: ``options`` are strings
    the runtime adapter reads first (e.g. which FlashInfer module kind its functions come from);
    ``prim_funcs`` are TIR functions the caller adds to an IRModule under their names; ``extern_symbols``
    name functions linked in from ``extern_modules``. The order is the one the runtime adapter expects.
    """

    op: str
    backend: str
    prim_funcs: tuple[tuple[str, Any], ...] = ()
    options: tuple[str, ...] = ()
    extern_symbols: tuple[str, ...] = ()
    extern_modules: tuple[Any, ...] = field(default=(), compare=False)


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

    def key_part(self) -> Any:
        """What besides the config, target and op choice decides this backend's compiled functions right
        now (JSON-able; ``None``: nothing). It joins the kernel library key and the compiled-module cache key."""
        return None

    def _unsupported_op(self, op: str) -> list[str]:
        if op not in self.ops:
            return [f"backend {self.tag!r} does not implement op {op!r}"]
        return []
