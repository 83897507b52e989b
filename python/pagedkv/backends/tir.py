"""The TIR backend: every op as a TIR PrimFunc from ``pagedkv.tir_kernels``."""

from __future__ import annotations

import functools
import json
from typing import Any

from .. import ops
from ..config import KVCacheConfig
from .base import Backend, OpBuild, target_kind

#: Target kinds the TIR kernels are scheduled for.
SUPPORTED_TARGETS = ("llvm", "cuda")
SUPPORTED_DTYPES = ("float16", "float32")


def kernel_config(config: KVCacheConfig):
    from ..tir_kernels import KernelConfig

    return KernelConfig(num_qo_heads=config.num_qo_heads, num_kv_heads=config.num_kv_heads,
                        head_dim=config.head_dim, v_head_dim=config.v_dim, dtype=config.dtype)


def _target_key(target: Any) -> str:
    if isinstance(target, dict):
        return json.dumps(target, sort_keys=True)
    return target if isinstance(target, str) else str(target)  # a Target prints as its JSON form


@functools.lru_cache(maxsize=32)
def _all_kernels(kcfg, target_key: str) -> dict:
    # One factory call yields every op's PrimFunc; cache it so building the op table stays cheap.
    from ..tir_kernels import build_kernels

    target = json.loads(target_key) if target_key.startswith("{") else target_key
    return build_kernels(kcfg, target)


class TIRBackend(Backend):
    """TIR kernels (our own, ``pagedkv.tir_kernels``) for every op."""

    tag = "tir"
    ops = ops.OPS

    def validate_configuration(self, op: str, config: KVCacheConfig, target: Any) -> list[str]:
        reasons = self._unsupported_op(op)
        kind = target_kind(target)
        if kind not in SUPPORTED_TARGETS:
            reasons.append(f"TIR kernels are not scheduled for target kind {kind!r} "
                           f"(supported: {', '.join(SUPPORTED_TARGETS)})")
        if config.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {config.dtype!r} not supported (supported: {SUPPORTED_DTYPES})")
        return reasons

    def build(self, op: str, config: KVCacheConfig, target: Any) -> OpBuild:
        func = _all_kernels(kernel_config(config), _target_key(target))[op]
        return OpBuild(op=op, backend=self.tag, prim_funcs=((f"pagedkv_{op}", func),))
