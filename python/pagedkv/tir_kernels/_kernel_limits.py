"""The kernels' own limits, in the one signature the selection table (``pagedkv.kernel_table``) calls:
``(spec, op, name, rope) -> list[str]`` (empty: the kernel serves the spec). The table checks arch, dtypes,
head dims and groups as data; these add what only the kernel knows (shared memory, tile fits)."""

from __future__ import annotations

from ..ops import ATTN_PREFILL_PAGED, shape_values


def prefill_tile(spec, op: str, name: str, rope: bool) -> list[str]:
    """The tensor-core prefill tile ``name`` (``attention_cuda_prefill_tc.tc_unserved``)."""
    from .attention_cuda_prefill_tc import tc_unserved

    paged = op == ATTN_PREFILL_PAGED
    why = tc_unserved(spec, spec.head_dim if paged else shape_values(spec)["Dv"], name, paged=paged)
    return [why] if why else []


def decode_staged(spec, op: str, name: str, rope: bool) -> list[str]:
    """The staged decode, plain or inline RoPE (``staged_limits`` / ``staged_rope_limits``)."""
    from ._decode_staged_cuda import staged_limits
    from ._decode_staged_rope_cuda import staged_rope_limits

    return (staged_rope_limits if rope else staged_limits)(spec.group_size, spec.head_dim, spec.dtype)


def mla_wgq(spec, op: str, name: str, rope: bool) -> list[str]:
    """The Q-in-shared-memory wgmma MLA kernel (``mla_cuda_wgq.wgq_unserved``)."""
    from .mla_cuda_wgq import wgq_unserved

    return wgq_unserved(spec)


def mla_tc(spec, op: str, name: str, rope: bool) -> list[str]:
    """The mma.sync MLA kernel (``mla_cuda_tc.tc_unserved``)."""
    from .mla_cuda_tc import tc_unserved

    return tc_unserved(spec)
