"""Loading compiled libraries in a process that has only the TVM *runtime* (``TVM_USE_RUNTIME_LIB=1``).

apache-tvm 0.27's runtime-only mode does not load its CUDA sidecar (``libtvm_runtime_cuda.so``), so a CUDA
library fails to load with "a loader of that name is not registered ... load_from_bytes.cuda".
``load_library`` loads the sidecar when the process has a CUDA driver, and the pagedkv runtime (whose
``pagedkv.*`` globals the library calls), then loads the library. Libraries built by pagedkv carry compiled
device code (see ``pagedkv.cuda_build``), so no CUDA compiler is needed here.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import sys
from pathlib import Path

from ._lib import load_runtime


@functools.lru_cache(maxsize=None)
def enable_cuda_runtime() -> bool:
    """Load TVM's CUDA runtime sidecar if a CUDA driver is present; returns whether CUDA is usable."""
    import tvm  # noqa: F401
    from tvm.base import _LOADED_LIBS

    if "tvm_runtime_cuda" in _LOADED_LIBS:
        return True
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    lib_dir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    sidecar = lib_dir / "libtvm_runtime_cuda.so"
    if not sidecar.exists():
        raise FileNotFoundError(f"TVM's CUDA runtime {sidecar} is missing from this TVM installation")
    _preload_cudart()
    _LOADED_LIBS["tvm_runtime_cuda"] = ctypes.CDLL(str(sidecar), mode=ctypes.RTLD_GLOBAL)
    return True


def _preload_cudart() -> None:
    # The sidecar needs libcudart.so.13; a GPU host with PyTorch has one inside the nvidia wheels.
    try:
        ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    import importlib.util

    for pkg in ("nvidia.cuda_runtime", "nvidia"):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        for root in (spec.submodule_search_locations or []) if spec else []:
            for cand in sorted(Path(root).rglob("libcudart.so.13*")):
                ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
                return
    raise OSError("libcudart.so.13 not found (needed by TVM's CUDA runtime); add its folder to LD_LIBRARY_PATH")


def _tvm_file(name: str):
    """The module ``tvm/<name>.py`` loaded on its own, without ``tvm/__init__`` (which loads the compiler
    library and every frontend: about a second), or None when this TVM has no such file or it does not load
    alone. Used for files that need nothing else of TVM (its version, its library search path)."""
    spec = importlib.util.find_spec("tvm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / f"{name}.py"
        if not path.is_file():
            continue
        file_spec = importlib.util.spec_from_file_location(f"_pagedkv_tvm_{name}", path)
        module = importlib.util.module_from_spec(file_spec)
        try:
            file_spec.loader.exec_module(module)
        except ImportError:
            return None
        return module
    return None


@functools.lru_cache(maxsize=None)
def tvm_version() -> str:
    """TVM's ``__version__``, read without importing TVM when it is not imported yet."""
    if "tvm" not in sys.modules:
        version = getattr(_tvm_file("_version"), "version", None)
        if isinstance(version, str):
            return version
    import tvm

    return getattr(tvm, "__version__", "?")


@functools.lru_cache(maxsize=None)
def load_tvm_runtime() -> None:
    """Load ``libtvm_runtime`` (its globals, e.g. the tensor allocator the pagedkv runtime calls) the way
    ``import tvm`` loads it first (same search path, ``RTLD_GLOBAL``), without the compiler library TVM's
    ``__init__`` loads after it; a later ``import tvm`` finds the same library already loaded."""
    if "tvm" in sys.modules:
        return
    libinfo = _tvm_file("libinfo")
    if libinfo is None or not hasattr(libinfo, "package_lib_paths"):
        import tvm  # noqa: F401  (an unusual TVM layout: its own import finds the runtime)

        return
    from tvm_ffi.libinfo import load_lib_ctypes

    load_lib_ctypes("tvm", "tvm_runtime", "RTLD_GLOBAL", extra_lib_paths=libinfo.package_lib_paths())


def load_library(path: str | Path, *, host_only: bool = False):
    """Load a library compiled by pagedkv (kernels or a whole model) with the TVM runtime only.

    Parameters
    ----------
    path : str or Path
        The library.
    host_only : bool
        The library holds host (CPU) code only: loaded with ``tvm_ffi`` after TVM's runtime library, without
        importing ``tvm`` (a second's import, most of a CPU cache's creation from a cached library).

    Returns
    -------
    Module
        The loaded module; wrap it in ``tvm.relax.VirtualMachine(module, device)`` for a model.
    """
    load_runtime()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no library at {path}")
    if host_only:
        import tvm_ffi

        load_tvm_runtime()
        return tvm_ffi.load_module(str(path))
    enable_cuda_runtime()
    import tvm

    return tvm.runtime.load_module(str(path))


__all__ = ["enable_cuda_runtime", "load_library", "load_tvm_runtime", "tvm_version"]
