"""pagedkv: a paged KV cache for TVM Relax with pluggable attention backends.

>>> import pagedkv
>>> cfg = pagedkv.KVCacheConfig(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype="float32")
>>> cache = pagedkv.create(cfg, backend="tir", target="llvm")
"""

# The kernels live at the repository root (`tir_kernels/`); `python/pagedkv/tir_kernels` is a link to them, so
# `pagedkv.tir_kernels` is the one import path, installed or from a checkout (PYTHONPATH=python).
from . import ops
from ._lib import load_runtime, runtime_library_path
from .config import SCHEMA_VERSION, KVCacheConfig

__version__ = "0.1.0"

# Loading the runtime registers the `pagedkv.*` globals, so a compiled model library that calls them works
# as soon as `pagedkv` is imported.
load_runtime()


def create(config, **kwargs):
    """See :func:`pagedkv.cache.create`."""
    from .cache import create as _create

    return _create(config, **kwargs)


def __getattr__(name):
    # Heavy submodules (TVM, torch) load on first use so `import pagedkv` stays cheap.
    if name in ("backends", "relax", "testing", "cache", "tir_kernels"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(name)


__all__ = ["KVCacheConfig", "SCHEMA_VERSION", "create", "load_runtime", "ops", "runtime_library_path"]
