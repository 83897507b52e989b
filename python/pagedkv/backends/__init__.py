"""Backend registry: backend tag -> lazily imported backend class, resolved per op.

>>> from pagedkv import backends
>>> backends.resolve(config, "llvm")            # priority order, per op
>>> backends.resolve(config, "llvm", backend="tir")   # explicit: every op from "tir" or an error
>>> backends.resolve(config, "cuda", backend="flashinfer")  # the ops it has no code for at all: "tir", said
>>> backends.resolve(config, "cuda", backend={"attn_decode_paged": ["flashinfer", "tir"], "*": "tir"})

A backend reports, per op, the reasons it cannot serve a configuration (``validate_configuration``).
Resolution never falls back silently: an explicit choice that cannot serve is an error listing the reasons
(and the backend that would, if listed), automatic selection records which backend each op got, and the ops an
explicit list has no backend for at all (``Backend.implements``) go to ``FILL_BACKEND``, printed and recorded
in ``Resolution.filled``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .. import ops as _ops
from ..config import KVCacheConfig
from .base import ADAPTERS, Backend, OpBuild, target_kind

__all__ = ["ADAPTERS", "Backend", "FILL_BACKEND", "OpBuild", "key_parts", "NoBackendError", "Resolution",
           "register_backend", "get_backend", "registered_backends", "resolve", "target_kind"]


class NoBackendError(ValueError):
    """No backend can serve an op; the message lists every backend's reasons."""


@dataclass(frozen=True)
class _Entry:
    tag: str
    class_path: str
    priority: int


_REGISTRY: dict[str, _Entry] = {}
_INSTANCES: dict[str, Backend] = {}


def register_backend(tag: str, class_path: str, *, priority: int = 0, replace: bool = False) -> None:
    """Register a backend class by import path (``"package.module:Class"``), imported on first use.

    Higher ``priority`` is tried first in automatic selection.
    """
    if not tag or not isinstance(tag, str):
        raise ValueError(f"backend tag must be a non-empty string, got {tag!r}")
    if ":" not in class_path:
        raise ValueError(f"class_path must look like 'module:Class', got {class_path!r}")
    if tag in _REGISTRY and not replace:
        raise ValueError(f"backend {tag!r} is already registered (pass replace=True to override)")
    _REGISTRY[tag] = _Entry(tag, class_path, priority)
    _INSTANCES.pop(tag, None)


def registered_backends() -> list[str]:
    """Registered tags, highest priority first."""
    return [e.tag for e in sorted(_REGISTRY.values(), key=lambda e: (-e.priority, e.tag))]


def get_backend(tag: str) -> Backend:
    """The backend instance for ``tag`` (imported on first use)."""
    if tag not in _REGISTRY:
        raise ValueError(f"unknown backend {tag!r}; registered: {', '.join(registered_backends())}")
    if tag not in _INSTANCES:
        module_name, cls_name = _REGISTRY[tag].class_path.split(":")
        cls = getattr(importlib.import_module(module_name), cls_name)
        instance = cls()
        if instance.tag != tag:
            raise ValueError(f"backend class {_REGISTRY[tag].class_path} has tag {instance.tag!r}, "
                             f"registered as {tag!r}")
        _INSTANCES[tag] = instance
    return _INSTANCES[tag]


#: The backend that implements every op (``pagedkv.ops.OPS``): it serves the ops that no backend of an explicit
#: list implements at all (``backend="flashinfer"``: the RoPE, append and merge ops), and ``resolve`` says so.
FILL_BACKEND = "tir"


@dataclass(frozen=True)
class Resolution:
    """Which backend serves each op, why the others were passed over, and which ops were filled in.

    ``filled`` maps each op that no backend of an explicit list implements (``Backend.implements``) to that
    list; ``FILL_BACKEND`` serves those ops, and ``resolve`` prints ``fill_note()``.
    """

    choice: dict[str, str]
    reasons: dict[str, dict[str, list[str]]]
    filled: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def report(self) -> str:
        return ", ".join(f"{op}={tag}" for op, tag in self.choice.items())

    def fill_note(self) -> str:
        """One line naming the filled ops and who serves them ("" when none was filled)."""
        if not self.filled:
            return ""
        by_list: dict[tuple[str, ...], list[str]] = {}
        for op, tags in self.filled.items():
            by_list.setdefault(tags, []).append(op)
        return "; ".join(f"backend {list(tags)} implements no {', '.join(ops)}: served by {self.choice[ops[0]]!r} "
                         f"(backend={[*tags, FILL_BACKEND]} says so explicitly)" for tags, ops in by_list.items())


def _candidates(backend: str | Sequence[str] | None) -> list[str]:
    if backend is None:
        return registered_backends()
    tags = [backend] if isinstance(backend, str) else list(backend)
    for tag in tags:
        get_backend(tag)  # raises, naming an unknown tag
    return tags


def _first_serving(op: str, tags: Sequence[str], config: KVCacheConfig, target: Any,
                   reasons: dict[str, dict[str, list[str]]]) -> str | None:
    """The first of ``tags`` that serves ``op``; the reasons of those before it go into ``reasons``."""
    for tag in tags:
        why = get_backend(tag).validate_configuration(op, config, target)
        if not why:
            return tag
        reasons.setdefault(op, {})[tag] = why
    return None


def _no_backend(op: str, tags: Sequence[str], given: Any, per_op: dict | None, config: KVCacheConfig,
                target: Any, reasons: dict[str, dict[str, list[str]]]) -> NoBackendError:
    """The error for an op none of ``tags`` serves: every reason, and for an explicit choice (``given``) the
    registered backend that would serve it if listed, in the spelling that works."""
    lines = [f"  {tag}: {'; '.join(why)}" for tag, why in reasons[op].items()]
    msg = f"no backend can serve op {op!r} on target {target_kind(target)!r}:\n" + "\n".join(lines)
    if given is not None:
        others = [t for t in registered_backends() if t not in tags
                  and not get_backend(t).validate_configuration(op, config, target)]
        if others:
            fixed = [*tags, others[0]]
            spelling = fixed if per_op is None else {**per_op, (op if op in per_op else "*"): fixed}
            msg += f"\n{others[0]!r} serves it if listed: backend={spelling!r}"
    return NoBackendError(msg)


def resolve(config: KVCacheConfig, target: Any,
            backend: str | Sequence[str] | Mapping[str, str | Sequence[str] | None] | None = None,
            *, ops: Iterable[str] | None = None) -> Resolution:
    """Choose a backend per op: the first of ``backend`` (a tag or priority list; ``None`` = all
    registered, by priority) that can serve it. A mapping gives the tag or list per op name, with ``"*"``
    for the ops it does not name (absent: all registered). ``ops`` defaults to the ops of the config's
    layer kind (``pagedkv.ops.ops_for``). Raises ``NoBackendError`` listing every reason.

    An op that no backend of an explicit list (a tag, a list, or a mapping's ``"*"``) implements at all is
    served by ``FILL_BACKEND``, recorded in ``Resolution.filled`` and printed; an op a mapping names is never
    filled, and an op a listed backend implements but cannot serve here is an error, never filled.
    """
    per_op = dict(backend) if isinstance(backend, Mapping) else None
    if per_op is not None:
        for op in per_op:
            if op != "*":
                _ops.check_op(op)
    choice: dict[str, str] = {}
    reasons: dict[str, dict[str, list[str]]] = {}
    filled: dict[str, tuple[str, ...]] = {}
    for op in (_ops.ops_for(config) if ops is None else ops):
        _ops.check_op(op)
        given = per_op.get(op, per_op.get("*")) if per_op is not None else backend
        tags = _candidates(given)
        fillable = given is not None and (per_op is None or op not in per_op)
        if fillable and not any(get_backend(t).implements(op) for t in tags):
            _first_serving(op, tags, config, target, reasons)  # records each one's "does not implement"
            filled[op], tags = tuple(tags), [FILL_BACKEND]
        tag = _first_serving(op, tags, config, target, reasons)
        if tag is None:
            raise _no_backend(op, tags, given, per_op, config, target, reasons)
        choice[op] = tag
    resolution = Resolution(choice, reasons, filled)
    if filled:
        print(f"[pagedkv] {resolution.fill_note()}", flush=True)  # never silent: the user named other backends
    return resolution


def key_parts(config: KVCacheConfig, target: Any, choice: Sequence[tuple[str, str]]) -> dict:
    """tag -> ``Backend.key_part`` for the backends of ``choice`` that report one (part of the kernel library
    key and the compiled-module cache key)."""
    out = {}
    for tag in sorted({tag for _, tag in choice}):
        part = get_backend(tag).key_part(config, target, tuple(op for op, t in choice if t == tag))
        if part is not None:
            out[tag] = part
    return out


register_backend("tir", "pagedkv.backends.tir:TIRBackend", priority=0)
# Preferred where it serves (CUDA, flashinfer-python 0.7.4 installed, a supported shape); otherwise its
# reasons are recorded and the next backend serves.
register_backend("flashinfer", "pagedkv.backends.flashinfer:FlashInferBackend", priority=10)
