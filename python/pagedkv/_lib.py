"""Locating and loading ``libpagedkv_runtime`` (the C++ runtime that registers the ``pagedkv.*`` globals)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

LIB_NAME = "libpagedkv_runtime.so"
_PKG = Path(__file__).resolve().parent


def runtime_library_path() -> Path:
    """Where the runtime library is: ``$PAGEDKV_RUNTIME_LIB``, else the installed ``pagedkv/lib``, else a
    development build under ``build/`` of a source checkout."""
    env = os.environ.get("PAGEDKV_RUNTIME_LIB")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"PAGEDKV_RUNTIME_LIB={env} is not a file")
        return Path(env)
    installed = _PKG / "lib" / LIB_NAME
    if installed.exists():
        return installed
    repo = _PKG.parent.parent
    for candidate in sorted(repo.glob(f"build/**/{LIB_NAME}")):
        return candidate
    raise FileNotFoundError(
        f"{LIB_NAME} not found in {installed.parent} (is pagedkv installed with `pip install .`?); "
        "set PAGEDKV_RUNTIME_LIB to its path")


@functools.lru_cache(maxsize=None)
def load_runtime():
    """Load the runtime library once; its globals (``pagedkv.*``) are registered on load."""
    import tvm_ffi

    # What the cache refuses of TVM's KV-state protocol (checkpoints, token trees that are not chains, ...)
    # raises errors of kind NotImplementedError, which tvm-ffi does not map to Python's by itself.
    tvm_ffi.register_error("NotImplementedError", NotImplementedError)
    return tvm_ffi.load_module(str(runtime_library_path()))


@functools.lru_cache(maxsize=None)
def get_global(name: str):
    """A ``pagedkv.*`` global function, loading the runtime library first. Cached: the lookup (registry
    search and a new function object) cost more than the call of a cheap global, on every cache method."""
    import tvm_ffi

    load_runtime()
    return tvm_ffi.get_global_func(name)
