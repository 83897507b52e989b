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


def load_library(path: str | Path):
    """Load a library compiled by pagedkv (kernels or a whole model) with the TVM runtime only.

    Returns the ``tvm.runtime.Module``; wrap it in ``tvm.relax.VirtualMachine(module, device)`` for a model.
    """
    load_runtime()
    enable_cuda_runtime()
    import tvm

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no library at {path}")
    return tvm.runtime.load_module(str(path))


__all__ = ["enable_cuda_runtime", "load_library"]
