"""CUDA source and nvcc helpers shared by the CUDA compile tests (``test_cuda_compile.py``,
``test_mla_cuda_compile.py``): no GPU needed."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess


def cuda_source_of(executable) -> str:
    """The CUDA C source of a compiled module (source-only module, or a real one that kept its source)."""
    for mod in executable.mod.imports:
        for fmt in ("", "cu", "cuda"):
            try:
                src = mod.inspect_source(fmt) if fmt else mod.inspect_source()
            except Exception:  # noqa: BLE001, S112 (format not kept by this module kind)
                continue
            if "__global__" in src:
                return src
    raise AssertionError("no CUDA source in the compiled module")


def ops_cuda_source(spec, ops, target) -> str:
    """CUDA C source of the kernels of ``ops`` (None: every op) built for ``spec`` (a ``KernelSpec``), compiled
    for ``target`` (a CUDA ``tvm.target.Target``)."""
    import tvm

    from pagedkv import tir_kernels as tk

    funcs = tk.build_kernels(spec, target, ops=ops)
    with target:
        exe = tvm.compile(tvm.IRModule({f"pagedkv_{op}": f for op, f in funcs.items()}), target=target)
    return cuda_source_of(exe)


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (str(p) for p in sorted(pathlib.Path("/usr/local").glob("cuda*/bin/nvcc"))), None)


def _compile(name: str, source: str, workdir: pathlib.Path) -> tuple[int, str]:
    cu = workdir / f"{name}.cu"
    cu.write_text(source)
    cmd = [find_nvcc(), "--cubin", "-arch=sm_90a", "-O3", "-Xptxas", "-v", "-diag-suppress", "177,1444,1046",
           "-o", str(workdir / f"{name}.cubin"), str(cu)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def nvcc_all(configs, source, workdir: pathlib.Path, prefix: str = "") -> dict:
    """``{cfg: (returncode, ptxas log)}`` of ``nvcc --cubin -arch=sm_90a`` on ``source(cfg)`` per config.

    The sources are produced first in this thread (TVM lowering must not overlap with itself), then the nvcc
    jobs run in parallel. Skips the calling test when nvcc is not installed.
    """
    if find_nvcc() is None:
        import pytest

        pytest.skip("nvcc not found")
    sources = {cfg: source(cfg) for cfg in configs}
    workers = max(1, min(len(configs), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
        futures = {cfg: ex.submit(_compile, prefix + "_".join(map(str, cfg)), src, workdir)
                   for cfg, src in sources.items()}
        return {cfg: fut.result() for cfg, fut in futures.items()}


def stack_frames(log: str) -> dict:
    """``{kernel: stack frame bytes}`` from an ``-Xptxas -v`` log (local arrays ptxas could not keep in
    registers live there: a rolled loop over a register array is enough)."""
    out, name = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif (m := re.search(r"(\d+) bytes stack frame", line)) and name is not None:
            out[name] = int(m.group(1))
    return out


def ptxas_usage(log: str) -> dict:
    """``{kernel: (registers, spill store bytes, spill load bytes)}`` from an ``-Xptxas -v`` log."""
    usage, name, spills = {}, None, (0, 0)
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name, spills = m.group(1), (0, 0)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := re.search(r"Used (\d+) registers", line)) and name is not None:
            usage[name] = (int(m.group(1)), *spills)
    return usage
