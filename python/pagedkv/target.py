"""Targets, normalised in one place (below the cache, the backends, the Relax constructor and the kernels).

Every spelling a TVM user has names one canonical value (``canonical``): a dict with ``kind`` and, for CUDA,
``arch``. Accepted: ``"llvm"`` (this host's CPU; an llvm ``mcpu`` does not change pagedkv's kernels), a bare
``"cuda"``, a CLI-style string (``"cuda -arch=sm_90a"``), a TVM tag (``"nvidia/nvidia-h100"``), a JSON string
or dict (``{"kind": "cuda", "arch": "sm_90a"}``) and a ``tvm.target.Target``.

The CUDA arch:
- ``sm_90`` and ``sm_90a`` are one machine (Hopper): both canonicalise to ``sm_90a``, so the TIR kernels use
  their wgmma / TMA paths and FlashInfer its fa3 modules whichever way the target is spelled.
- A bare ``"cuda"`` (or a dict without ``arch``) means this host's GPU where one is visible, else
  ``DEFAULT_CUDA_ARCH`` (Hopper): building on a host without a GPU is the normal case, and every CUDA build
  prints the arch it builds for (``describe``).
- ``tvm.target.Target("cuda")`` on a host without a GPU is TVM's ``sm_50``: kept as given, and refused by the
  backends (``unserved_arch``) before any code is generated, with the spelling to use instead.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Mapping

#: The CUDA arch a bare ``"cuda"`` means on a host without a visible GPU (the project's GPU: Hopper).
DEFAULT_CUDA_ARCH = "sm_90a"
#: Archs that are one machine: the key is canonicalised to the value.
ARCH_ALIASES = {"sm_90": "sm_90a"}
#: The oldest arch pagedkv's CUDA kernels are written for (cp.async, ldmatrix, mma.sync, bf16: Ampere).
MIN_CUDA_ARCH = 80
_ARCH_RE = re.compile(r"^sm_(\d+)([a-z]?)$")


def canonical_arch(arch: str) -> str:
    """``arch`` in canonical form (``sm_90`` -> ``sm_90a``); raises ``ValueError`` for a malformed name."""
    text = str(arch).strip()
    if not _ARCH_RE.match(text):
        raise ValueError(f"CUDA arch {arch!r} is not of the form sm_XY (e.g. 'sm_90a', 'sm_80')")
    return ARCH_ALIASES.get(text, text)


def arch_number(arch: str) -> int:
    """The compute capability of ``arch`` as an int (``"sm_90a"`` -> 90)."""
    return int(_ARCH_RE.match(canonical_arch(arch)).group(1))


def unserved_arch(arch: str | None) -> str | None:
    """Why pagedkv's CUDA kernels cannot be built for ``arch`` (None: they can)."""
    if arch is None:
        return "the CUDA target names no arch"
    if arch_number(arch) >= MIN_CUDA_ARCH:
        return None
    hint = (" (tvm.target.Target('cuda') is sm_50 on a host without a GPU: pass 'cuda', which means "
            f"{DEFAULT_CUDA_ARCH} there, a tag such as 'nvidia/nvidia-h100', or {{'kind': 'cuda', 'arch': "
            f"'{DEFAULT_CUDA_ARCH}'}})") if arch == "sm_50" else ""
    return f"CUDA arch {arch}: pagedkv's CUDA kernels need sm_{MIN_CUDA_ARCH} or newer{hint}"


@functools.lru_cache(maxsize=None)
def detected_cuda_arch() -> str | None:
    """The arch of this host's first CUDA GPU as TVM's runtime sees it (None without one; asked once)."""
    try:
        import tvm

        dev = tvm.runtime.cuda(0)
        if not dev.exist:
            return None
        return "sm_" + str(dev.compute_version).replace(".", "")
    except Exception:  # noqa: BLE001 (no CUDA runtime in this TVM: no GPU to detect)
        return None


def _default_arch() -> str:
    return canonical_arch(detected_cuda_arch() or DEFAULT_CUDA_ARCH)


def _from_dict(target: Mapping) -> dict:
    if "kind" not in target:
        raise ValueError(f"target dict {dict(target)!r} has no 'kind'")
    kind = str(target["kind"])
    if kind == "cuda":
        arch = target.get("arch")
        return {"kind": "cuda", "arch": canonical_arch(arch) if arch else _default_arch()}
    return {"kind": kind}


def _from_cli(text: str) -> dict:
    """``"cuda -arch=sm_90a -max_num_threads=1024"`` (TVM's older CLI form) as a dict."""
    kind, *flags = text.split()
    out: dict = {"kind": kind}
    for flag in flags:
        name, sep, value = flag.lstrip("-").partition("=")
        if not sep or not name:
            raise ValueError(f"target {text!r}: cannot read {flag!r} (expected -name=value)")
        out[name] = value
    return out


def _from_string(text: str) -> dict:
    text = text.strip()
    if text.startswith("{"):
        return _from_dict(json.loads(text))
    head = text.split()[0] if text else ""
    if head in ("llvm", "cuda"):
        return _from_dict(_from_cli(text))
    if "/" in head:  # a TVM tag such as nvidia/nvidia-h100
        try:
            from tvm.target import Target
        except ImportError as err:
            raise ValueError(f"target tag {text!r} needs TVM's compiler to be read; in a runtime-only process "
                             "pass a dict such as {'kind': 'cuda', 'arch': 'sm_90a'}") from err
        try:
            return _from_target(Target(text))
        except Exception as err:  # noqa: BLE001 (TVM raises its own error types)
            raise ValueError(f"target {text!r} is not a TVM target tag TVM knows ({err})") from None
    raise ValueError(f"target {text!r}: use 'llvm', 'cuda', 'cuda -arch=sm_90a', a TVM tag such as "
                     "'nvidia/nvidia-h100', a JSON dict such as {'kind': 'cuda', 'arch': 'sm_90a'} or a "
                     "tvm.target.Target")


def _from_target(target) -> dict:
    kind = str(target.kind.name)
    if kind == "cuda":
        arch = target.attrs.get("arch") if "arch" in target.attrs else None
        return {"kind": "cuda", "arch": canonical_arch(str(arch)) if arch else _default_arch()}
    return {"kind": kind}


def canonical(target: Any) -> dict:
    """The canonical dict of ``target`` (see the module docstring); raises ``ValueError`` for a spelling
    pagedkv cannot read."""
    if isinstance(target, Mapping):
        return _from_dict(target)
    if isinstance(target, str):
        return _from_string(target)
    if hasattr(target, "kind") and hasattr(target, "attrs"):  # a tvm.target.Target
        return _from_target(target)
    raise ValueError(f"target {target!r} of type {type(target).__name__} is not a string, dict or "
                     "tvm.target.Target")


def describe(target: Any) -> str:
    """One line naming what ``target`` builds for (printed by every CUDA build)."""
    spec = canonical(target)
    if spec["kind"] != "cuda":
        return f"target {spec['kind']}"
    arch = spec["arch"]
    source = "this host's GPU" if detected_cuda_arch() else f"no GPU here: 'cuda' means {DEFAULT_CUDA_ARCH}"
    return f"target cuda {arch} ({source}; sm_90 and sm_90a are one machine, Hopper)"


def key(target: Any) -> str:
    """``canonical(target)`` as a sorted JSON string (a hashable cache key)."""
    return json.dumps(canonical(target), sort_keys=True)


def kind(target: Any) -> str:
    """The target's kind name (``"llvm"``, ``"cuda"``, ...)."""
    return canonical(target)["kind"]


def arch(target: Any) -> str | None:
    """A CUDA target's canonical arch (``"sm_90a"``), else ``None``."""
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


__all__ = ["ARCH_ALIASES", "DEFAULT_CUDA_ARCH", "MIN_CUDA_ARCH", "arch", "arch_number", "canonical",
           "canonical_arch", "describe", "detected_cuda_arch", "host_target", "key", "kind", "runtime_only",
           "to_tvm", "unserved_arch"]
