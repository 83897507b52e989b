"""The ``__global__`` kernels of a TVM-generated CUDA module source, for launchers outside TVM: the CPU emulator
(``tests/cpu/_cuda_emu.h``) and ``tools/prefill_probe.py``, which call a kernel by its parameter names as TVM's
host code would.

TVM emits each kernel as ``extern "C" __global__ void __launch_bounds__(THREADS) NAME(PARAMS) {`` ... ``}`` at
column 0; a kernel's parameters are its buffers' pointers, the scalars it reads and values TVM's host code
computed for the launch (``int cse_v*``), some of which the body never reads.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_HEAD = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(([^)]*)\) \{\n')


class KernelDef(NamedTuple):
    """One kernel: ``src[start:end]`` is its definition (the closing brace included), ``params`` its
    ``(type, name)`` parameters in order (``__restrict__`` dropped), ``threads`` its launch bound."""

    name: str
    threads: int
    params: list
    start: int
    end: int

    def text(self, src: str) -> str:
        return src[self.start:self.end]

    def body(self, src: str) -> str:
        """The statements between the braces."""
        return src[self.start:self.end][src[self.start:self.end].index(") {\n") + 4:-2]


def kernel_defs(src: str) -> list[KernelDef]:
    """The module's kernels in source order."""
    out = []
    for m in _HEAD.finditer(src):
        end = src.index("\n}\n", m.end()) + 3
        params = [tuple(p.replace("__restrict__", "").rsplit(None, 1)) for p in m.group(3).split(", ")]
        out.append(KernelDef(m.group(2), int(m.group(1)), params, m.start(), end))
    return out


def tensor_core_kernel(src: str) -> KernelDef:
    """The module's tensor-core kernel (the one calling ``pagedkv_mma_*`` or ``pagedkv_wgmma_*``: the prefill
    PrimFuncs also hold a SIMT RoPE kernel)."""
    for k in kernel_defs(src):
        if "pagedkv_mma_" in k.text(src) or "pagedkv_wgmma_" in k.text(src):
            return k
    raise ValueError("no tensor-core kernel in the source")


def unused_params(kernel: KernelDef, src: str) -> frozenset:
    """Indices of the parameters the kernel does not read: those its body never names, and TVM's host-side CSE
    values (``int cse_v*``), whose names the device code's own CSE may reuse for locals. A launcher outside TVM
    passes 0 for these, and only these, after ``hide_params``: it renames them in the signature, so a body that
    did read one no longer compiles."""
    body = kernel.body(src)
    return frozenset(i for i, (ty, name) in enumerate(kernel.params)
                     if not re.search(rf"\b{name}\b", body) or (ty == "int" and re.fullmatch(r"cse_v\d+", name)))


def hide_params(text: str, kernel: KernelDef, indices) -> str:
    """``kernel``'s definition ``text`` with the parameters ``indices`` renamed (``NAME_unread``) in its
    signature only."""
    head, rest = text.split(") {\n", 1)
    for i in indices:
        head = re.sub(rf"\b{kernel.params[i][1]}\b", f"{kernel.params[i][1]}_unread", head)
    return head + ") {\n" + rest


def static_shared(text: str, dyn_smem_bytes: int) -> str:
    """A kernel definition for a host compiler: ``alignas`` before ``static`` (``__shared__`` is ``static`` in the
    emulator) and the one dynamic shared buffer a static array of ``dyn_smem_bytes``."""
    text = re.sub(r"__shared__ (alignas\(\d+\))", r"\1 static", text)
    return re.sub(r"extern __shared__ __align__\((\d+)\) (\w+) (\w+)\[\];",
                  lambda d: f"alignas({d.group(1)}) static {d.group(2)} {d.group(3)}[{dyn_smem_bytes} / "
                            f"sizeof({d.group(2)})];", text)


__all__ = ["KernelDef", "hide_params", "kernel_defs", "static_shared", "tensor_core_kernel", "unused_params"]
