"""Backend registry: backend tag -> lazily imported backend class, resolved per op.

>>> from pagedkv import backends
>>> backends.resolve(config, "llvm")            # priority order, per op
>>> backends.resolve(config, "llvm", backend="tir")   # explicit: every op from "tir" or an error
>>> backends.resolve(config, "cuda", backend={"attn_decode_paged": ["flashinfer", "tir"], "*": "tir"})

A backend reports, per op, the reasons it cannot serve a configuration (``validate_configuration``).
Resolution never falls back silently: an explicit choice that cannot serve is an error listing the reasons,
and automatic selection records which backend each op got.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .. import ops as _ops
from ..config import KVCacheConfig
from .base import ADAPTERS, Backend, OpBuild, target_kind

__all__ = ["ADAPTERS", "Backend", "OpBuild", "key_parts", "NoBackendError", "Resolution", "register_backend", "get_backend",
           "registered_backends", "resolve", "target_kind"]


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


@dataclass(frozen=True)
class Resolution:
    """Which backend serves each op, and why the others were passed over."""

    choice: dict[str, str]
    reasons: dict[str, dict[str, list[str]]]

    def report(self) -> str:
        return ", ".join(f"{op}={tag}" for op, tag in self.choice.items())


def _candidates(backend: str | Sequence[str] | None) -> list[str]:
    if backend is None:
        return registered_backends()
    tags = [backend] if isinstance(backend, str) else list(backend)
    for tag in tags:
        get_backend(tag)  # raises, naming an unknown tag
    return tags


def resolve(config: KVCacheConfig, target: Any,
            backend: str | Sequence[str] | Mapping[str, str | Sequence[str] | None] | None = None,
            *, ops: Iterable[str] | None = None) -> Resolution:
    """Choose a backend per op: the first of ``backend`` (a tag or priority list; ``None`` = all
    registered, by priority) that can serve it. A mapping gives the tag or list per op name, with ``"*"``
    for the ops it does not name (absent: all registered). ``ops`` defaults to the ops of the config's
    layer kind (``pagedkv.ops.ops_for``). Raises ``NoBackendError`` listing every reason."""
    per_op = dict(backend) if isinstance(backend, Mapping) else None
    if per_op is not None:
        for op in per_op:
            if op != "*":
                _ops.check_op(op)
    tags = None if per_op is not None else _candidates(backend)
    if ops is None:
        ops = _ops.ops_for(config)
    choice: dict[str, str] = {}
    reasons: dict[str, dict[str, list[str]]] = {}
    for op in ops:
        _ops.check_op(op)
        op_tags = _candidates(per_op.get(op, per_op.get("*"))) if per_op is not None else tags
        for tag in op_tags:
            why = get_backend(tag).validate_configuration(op, config, target)
            if not why:
                choice[op] = tag
                break
            reasons.setdefault(op, {})[tag] = why
        else:
            lines = [f"  {tag}: {'; '.join(why)}" for tag, why in reasons[op].items()]
            raise NoBackendError(f"no backend can serve op {op!r} on target {target_kind(target)!r}:\n"
                                 + "\n".join(lines))
    return Resolution(choice, reasons)


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
