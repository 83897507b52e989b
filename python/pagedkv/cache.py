"""``pagedkv.create``: a paged KV cache object from a config and a backend choice, usable from Python.

This is the direct (no Relax) path used by tests and tools. It compiles the chosen backends' functions for
the target, builds the named op table and calls the runtime's ``pagedkv.create``. Tensors in and out are
PyTorch tensors (exchanged through DLPack, no copies).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

from . import backends as _backends
from . import ops as _ops
from ._lib import get_global
from .config import KVCacheConfig

_FLOAT_DTYPES = {"float16", "float32", "bfloat16"}


def _to_ffi(tensor):
    import tvm_ffi

    return tvm_ffi.from_dlpack(tensor)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


@functools.lru_cache(maxsize=16)
def _compile_op_table(config: KVCacheConfig, target_key: str, choice: tuple[tuple[str, str], ...]):
    """Compile every op's functions for ``target_key`` into one module; return the op table entries."""
    import tvm

    funcs: dict[str, Any] = {}
    entries_symbols: list[tuple[str, str, list[str]]] = []
    for op, tag in choice:
        build = _backends.get_backend(tag).build(op, config, target_key)
        names = []
        for name, func in build.prim_funcs:
            funcs[name] = func
            names.append(name)
        entries_symbols.append((op, tag, names + list(build.extern_symbols)))
    module = tvm.compile(tvm.IRModule(funcs), target=tvm.target.Target(target_key))
    table = [[op, tag, *[module[name] for name in names]] for op, tag, names in entries_symbols]
    return module, table


def create(config: KVCacheConfig, *, backend: str | Sequence[str] | None = None,
           target: str = "llvm", device: Any = None, poison: bool = False) -> "KVCache":
    """Create a paged KV cache for ``config``.

    Parameters
    ----------
    config :
        The cache configuration.
    backend :
        A backend tag, a priority list of tags, or ``None`` for automatic selection (registered backends by
        priority). Each op gets the first that can serve it; if none can, ``NoBackendError`` lists why.
    target :
        The compilation target (``"llvm"`` for the CPU).
    device :
        A ``torch.device`` for the pages; default: the CPU.
    poison :
        Fill fresh pages and temporaries with NaN (tests: unwritten or over-read memory fails loudly).
    """
    import torch

    resolution = _backends.resolve(config, target, backend)
    module, table = _compile_op_table(config, str(target), tuple(resolution.choice.items()))
    device = torch.device("cpu") if device is None else torch.device(device)
    device_ref = torch.empty((1,), dtype=_torch_dtype(config.dtype), device=device)
    handle = get_global("pagedkv.create")(config.to_json(), (), table, _to_ffi(device_ref))
    cache = KVCache(handle, config, device, resolution, keepalive=module)
    if poison:
        get_global("pagedkv.debug_poison_pages")(handle, True)
    return cache


class KVCache:
    """Python view of a runtime ``PagedKVCache`` (see ``docs/ARCHITECTURE.md`` for the semantics)."""

    def __init__(self, handle, config: KVCacheConfig, device, resolution, *, keepalive=None) -> None:
        self.handle = handle
        self.config = config
        self.device = device
        self.resolution = resolution
        self._keepalive = keepalive  # the compiled kernel module must outlive the cache

    def _call(self, name: str, *args):
        return get_global(f"pagedkv.{name}")(self.handle, *args)

    # -- sequences ----------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        self._call("add_sequence", seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        self._call("remove_sequence", seq_id)

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> None:
        self._call("fork_sequence", parent_id, child_id, fork_pos)

    def popn(self, seq_id: int, n: int) -> None:
        self._call("popn", seq_id, n)

    def clear(self) -> None:
        self._call("clear")

    def get_sequence_length(self, seq_id: int) -> int:
        return int(self._call("get_sequence_length", seq_id))

    @property
    def num_available_pages(self) -> int:
        return int(self._call("get_num_available_pages"))

    @property
    def total_sequence_length(self) -> int:
        return int(self._call("get_total_sequence_length"))

    @property
    def op_backends(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self._call("op_backends").items()}

    # -- forward ------------------------------------------------------------------------------------
    def begin_forward(self, seq_ids: Sequence[int], append_lengths: Sequence[int]) -> None:
        self._call("begin_forward", tuple(int(s) for s in seq_ids), tuple(int(n) for n in append_lengths))

    def end_forward(self) -> None:
        self._call("end_forward")

    def _empty(self, shape, dtype=None):
        import torch

        dtype = _torch_dtype(self.config.dtype) if dtype is None else dtype
        return torch.full(shape, math.nan, dtype=dtype, device=self.device)

    def attention_with_fused_qkv(self, layer: int, qkv, sm_scale: float):
        """``qkv[n, Hq + 2 Hkv, D]`` -> ``o[n, Hq, D]``; appends k/v of the new tokens."""
        o = self._empty((qkv.shape[0], self.config.num_qo_heads, self.config.v_dim), qkv.dtype)
        self._call("attention_with_fused_qkv", layer, float(sm_scale), _to_ffi(qkv), _to_ffi(o))
        return o

    def self_attention(self, layer: int, q, k, v, sm_scale: float):
        """Ragged causal attention over the new tokens: ``q[n, Hq, D]`` -> ``(o[n, Hq, Dv], lse[n, Hq])``."""
        import torch

        o = self._empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
        lse = self._empty((q.shape[0], q.shape[1]), torch.float32)
        self._call("self_attention", layer, float(sm_scale), *map(_to_ffi, (q, k, v, o, lse)))
        return o, lse

    def cross_attention(self, layer: int, q, sm_scale: float, v_head_dim: int | None = None):
        """Attention of ``q[n, Hq, D]`` over the cached k/v -> ``(o[n, Hq, Dv], lse[n, Hq])``."""
        import torch

        dv = self.config.v_dim if v_head_dim is None else v_head_dim
        o = self._empty((q.shape[0], q.shape[1], dv), q.dtype)
        lse = self._empty((q.shape[0], q.shape[1]), torch.float32)
        self._call("cross_attention", layer, float(sm_scale), *map(_to_ffi, (q, o, lse)))
        return o, lse

    def merge_attn_output_inplace(self, o_a, lse_a, o_b, lse_b):
        self._call("merge_attn_output_inplace", *map(_to_ffi, (o_a, lse_a, o_b, lse_b)))
        return o_a, lse_a

    def get_query_positions(self):
        import torch

        return torch.from_dlpack(self._call("get_query_positions")).clone()

    # -- debugging ----------------------------------------------------------------------------------
    def debug_get_kv(self, seq_id: int, start: int = 0, end: int | None = None):
        """K and V of tokens ``[start, end)`` of a sequence: two ``[L, end - start, Hkv, D]`` tensors."""
        end = self.get_sequence_length(seq_id) if end is None else end
        shape = (self.config.num_layers, max(end - start, 0), self.config.num_kv_heads, self.config.head_dim)
        k, v = self._empty(shape), self._empty(shape)
        self._call("debug_get_kv", seq_id, start, end, _to_ffi(k), _to_ffi(v))
        return k, v

    def debug_set_kv(self, seq_id: int, start: int, k, v) -> None:
        self._call("debug_set_kv", seq_id, start, _to_ffi(k), _to_ffi(v))


__all__ = ["create", "KVCache"]
_ = _ops  # the op vocabulary is part of this module's contract (op_backends keys)
