"""Build real CUDA device code (fatbins) on a host that has nvcc but no GPU driver.

apache-tvm 0.27 compiles CUDA kernels to fatbins only when its CUDA runtime sidecar
(``libtvm_runtime_cuda.so``) is loaded, and that library needs ``libcuda.so.1`` (the driver) and
``libcudart.so.13``. On a build host without a driver TVM silently falls back to a *source* module, which a
runtime-only GPU host cannot compile. ``enable_cuda_codegen()`` fixes that for this process:

1. loads the CUDA runtime library of the toolkit that holds ``nvcc``;
2. loads the real ``libcuda.so.1`` if there is one, else a stub built here with gcc whose ``cu*`` functions
   all return ``CUDA_ERROR_NO_DEVICE`` (only their presence matters: nothing runs on a GPU here);
3. loads TVM's CUDA sidecar, and selects nvcc as TVM's CUDA compiler (NVRTC may be absent).

Compile inside ``with target:`` so the target's arch reaches nvcc (see ``compile_cuda``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

#: Driver functions the TVM 0.27 sidecar imports (read from the library when nm is available).
_FALLBACK_SYMBOLS = ("cuDeviceGetName", "cuFuncSetAttribute", "cuGetErrorName", "cuGetErrorString",
                     "cuLaunchKernelEx", "cuModuleGetFunction", "cuModuleLoadData", "cuModuleUnload",
                     "cuTensorMapEncodeTiled")
_CUDA_ERROR_NO_DEVICE = 100


def _toolkit_candidates() -> list[Path]:
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    out = [Path(env)] if env else []
    nvcc = shutil.which("nvcc")
    if nvcc:
        out.append(Path(nvcc).resolve().parent.parent)
    out += [Path("/usr/local/cuda")] + sorted(Path("/usr/local").glob("cuda-*"), reverse=True)
    return out


def _find_cudart(home: Path) -> Path | None:
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
        for cand in sorted((home / sub).glob("libcudart.so.*")):
            return cand
    return None


def cuda_home() -> Path:
    """The CUDA toolkit folder: ``$CUDA_HOME``, the one holding ``nvcc``, or ``/usr/local/cuda*`` — the
    first that has both ``bin/nvcc`` and ``libcudart`` (``nvcc`` on ``PATH`` may be a wrapper script)."""
    for home in _toolkit_candidates():
        if (home / "bin" / "nvcc").exists() and _find_cudart(home):
            return home
    raise RuntimeError("no CUDA toolkit with nvcc and libcudart found (set CUDA_HOME): CUDA builds need it")


def cudart_path() -> Path:
    return _find_cudart(cuda_home())


def _tvm_lib_dir() -> Path:
    from tvm.base import _LOADED_LIBS

    return Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent


def _driver_symbols(sidecar: Path) -> list[str]:
    try:
        out = subprocess.run(["nm", "-D", "--undefined-only", str(sidecar)], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return list(_FALLBACK_SYMBOLS)
    names = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.split()}
    return sorted(n for n in names if n.startswith("cu") and n[2:3].isupper()) or list(_FALLBACK_SYMBOLS)


def build_stub_libcuda(symbols: list[str], out_dir: Path) -> Path:
    """A ``libcuda.so.1`` exporting ``symbols``, each returning CUDA_ERROR_NO_DEVICE."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libcuda.so.1"
    # A digest stable across processes (str hashes are salted per process, which rebuilt the stub in every
    # process and rewrote a library other processes had loaded).
    digest = hashlib.sha256("\n".join(symbols).encode()).hexdigest()[:16]
    key = out_dir / f"symbols-{digest}.txt"
    if lib.exists() and key.exists():
        return lib
    src = out_dir / "stub_libcuda.c"
    src.write_text("\n".join(f"int {s}(void) {{ return {_CUDA_ERROR_NO_DEVICE}; }}" for s in symbols) + "\n")
    tmp = out_dir / f"libcuda.so.1.{os.getpid()}.tmp"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(src)],
                   check=True)
    tmp.replace(lib)  # atomic: a process that has the old file open keeps it
    key.write_text("\n".join(symbols))
    return lib


@functools.lru_cache(maxsize=None)
def stub_libcuda() -> Path:
    """The stub ``libcuda.so.1`` of this host (built on first use, cached under pagedkv's cache root,
    ``pagedkv.kernel_cache.cache_root``): it exports the driver functions TVM's CUDA runtime imports, each
    failing with CUDA_ERROR_NO_DEVICE. Links that need ``-lcuda`` on a host without a driver take it too."""
    from .kernel_cache import cache_root

    symbols = _driver_symbols(_tvm_lib_dir() / "libtvm_runtime_cuda.so")
    return build_stub_libcuda(symbols, cache_root() / "stub-libcuda")


@functools.lru_cache(maxsize=None)
def enable_cuda_codegen() -> str:
    """Make ``tvm.compile`` emit fatbins for CUDA targets in this process. Returns a one-line status."""
    import tvm  # noqa: F401  (loads libtvm_runtime first; the sidecar links against it)
    from tvm.base import _LOADED_LIBS

    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    os.environ["PATH"] = f"{cuda_home() / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    sidecar = _tvm_lib_dir() / "libtvm_runtime_cuda.so"
    if "tvm_runtime_cuda" in _LOADED_LIBS:
        return "TVM CUDA runtime already loaded"
    ctypes.CDLL(str(cudart_path()), mode=ctypes.RTLD_GLOBAL)
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        driver = "the real CUDA driver"
    except OSError:
        ctypes.CDLL(str(stub_libcuda()), mode=ctypes.RTLD_GLOBAL)
        driver = "a stub libcuda (no GPU driver here)"
    _LOADED_LIBS["tvm_runtime_cuda"] = ctypes.CDLL(str(sidecar), mode=ctypes.RTLD_GLOBAL)
    return f"TVM CUDA codegen enabled with {driver}, nvcc from {cuda_home()}"


def compile_for_cuda(mod, target):
    """``tvm.compile(mod, target)`` with real device code; ``target`` is a CUDA ``Target``."""
    import tvm

    enable_cuda_codegen()
    with target:
        return tvm.compile(mod, target=target)


#: First bytes of a CUDA fatbin (little-endian 0xBA55ED50), as embedded in an exported library.
FATBIN_MAGIC = bytes.fromhex("50ed55ba")


def has_device_code(library_path: str | Path) -> bool:
    """True when an exported library embeds a CUDA fatbin (not only CUDA source, TVM's silent fallback)."""
    return FATBIN_MAGIC in Path(library_path).read_bytes()
