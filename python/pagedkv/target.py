"""Targets, normalised in one place (below the cache, the backends, the Relax constructor and the kernels).

A target may be given as ``"llvm"`` (this host's CPU), ``"cuda"`` (sm_90), a JSON dict such as
``{"kind": "cuda", "arch": "sm_90"}``, or a ``tvm.target.Target``. ``canonical`` turns each into the one
value pagedkv keys and compares by: a dict with ``kind`` and, for CUDA, ``arch`` (other attributes, such as
an llvm ``mcpu``, do not change pagedkv's kernels: ``"llvm"`` always means the machine that compiles).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

#: The CUDA arch a bare ``"cuda"`` means (the project's GPU: Hopper).
DEFAULT_CUDA_ARCH = "sm_90"


def canonical(target: Any) -> dict:
    """The canonical dict of ``target`` (see the module docstring); raises ``ValueError`` for a string that is
    neither ``"llvm"`` nor ``"cuda"``."""
    if isinstance(target, Mapping):
        if "kind" not in target:
            raise ValueError(f"target dict {dict(target)!r} has no 'kind'")
        spec = {"kind": str(target["kind"])}
        if spec["kind"] == "cuda":
            spec["arch"] = str(target.get("arch", DEFAULT_CUDA_ARCH))
        return spec
    if isinstance(target, str):
        text = target.strip()
        if text.startswith("{"):
            return canonical(json.loads(text))
        if text.split()[0] == "llvm":
            return {"kind": "llvm"}
        if text == "cuda":
            return {"kind": "cuda", "arch": DEFAULT_CUDA_ARCH}
        raise ValueError(f"target {target!r}: use 'llvm', 'cuda' or a JSON dict such as "
                         "{'kind': 'cuda', 'arch': 'sm_90'}")
    kind = str(target.kind.name)  # a tvm.target.Target
    spec = {"kind": kind}
    if kind == "cuda":
        spec["arch"] = str(target.arch) if "arch" in target.attrs else DEFAULT_CUDA_ARCH
    return spec


def key(target: Any) -> str:
    """``canonical(target)`` as a sorted JSON string (a hashable cache key)."""
    return json.dumps(canonical(target), sort_keys=True)


def kind(target: Any) -> str:
    """The target's kind name (``"llvm"``, ``"cuda"``, ...)."""
    return canonical(target)["kind"]


def arch(target: Any) -> str | None:
    """A CUDA target's arch (``"sm_90"``), else ``None``."""
    return canonical(target).get("arch")


def host_target():
    """An ``llvm`` ``Target`` for this machine's CPU (``mcpu`` set, so AVX2/AVX-512 and F16C are used); a bare
    ``"llvm"`` compiles for baseline x86-64 (SSE2, software fp16 conversion), which works, only slower."""
    from tvm.target import Target, codegen

    return Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})


def to_tvm(target: Any):
    """The ``tvm.target.Target`` pagedkv compiles for: this host's CPU for llvm, CUDA with an llvm host."""
    import tvm

    spec = canonical(target)
    if spec["kind"] == "llvm":
        return host_target()
    if spec["kind"] == "cuda":
        return tvm.target.Target(spec, host="llvm")
    return tvm.target.Target(spec)


def runtime_only() -> bool:
    """Whether this process's TVM is the runtime only (``TVM_USE_RUNTIME_LIB=1``: no compiler)."""
    import tvm

    return bool(getattr(tvm.base, "_RUNTIME_ONLY", False))


__all__ = ["DEFAULT_CUDA_ARCH", "arch", "canonical", "host_target", "key", "kind", "runtime_only", "to_tvm"]
