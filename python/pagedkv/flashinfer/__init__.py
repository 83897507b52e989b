"""FlashInfer 0.7.4 JIT modules built at model compile time, on a host without a GPU.

Three layers per op, as in FlashInfer itself:

1. ``spec.ModuleSpec`` -- what a module is (kind decode / prefill_fa2 / prefill_fa3 / mla, dtypes, head dims,
   variant flags), with a readable name and a content key;
2. ``build.build_module`` -- the cached builder: flashinfer's own generator and ninja rules for the objects,
   in a child process, keyed by content under ``$PAGEDKV_CACHE_DIR/flashinfer`` (one printed line per
   build or cache hit; progress for long builds);
3. ``build.BuiltModule`` -- the product: one relocatable object whose only global definitions are the
   module's tvm-ffi exports, renamed with a per-module prefix, ready to link into a model library.

``abi`` pins the 0.7.4 argument lists the runtime adapter passes (and generates ``src/flashinfer_abi.h``).
Nothing here imports flashinfer or torch in the calling process.

``python -m pagedkv.flashinfer decode --dtype float16 --head-dim 128`` builds (or finds) one module.
"""

from . import abi
from .build import (CURAND_SPEC, BuiltModule, FlashInferUnavailable, build_module, build_modules, cache_root,
                    installed_version, module_unavailable_reasons, unavailable_reasons)
from .spec import FLASHINFER_VERSION, KINDS, MLA_KINDS, ModuleSpec

__all__ = ["abi", "BuiltModule", "FlashInferUnavailable", "ModuleSpec", "KINDS", "MLA_KINDS", "FLASHINFER_VERSION",
           "CURAND_SPEC", "build_module", "build_modules", "cache_root", "installed_version",
           "module_unavailable_reasons", "unavailable_reasons"]
