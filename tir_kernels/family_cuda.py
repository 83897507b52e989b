"""The CUDA family: op -> factory ``(spec: KernelSpec) -> PrimFunc``. This family's kernels, their shared
macros and its attention variant live in the ``*_cuda`` / ``_common_cuda`` modules."""

from __future__ import annotations

from ..kernel_spec import forced
from .attention_cuda import attn_decode_paged_cuda, attn_prefill_paged_cuda, attn_prefill_ragged_cuda
from .empty_rows import empty_rows_cuda
from .merge_cuda import merge_state_cuda
from .page_ops_cuda import append_kv_cuda, compact_copy_cuda, copy_page_cuda, gather_kv_cuda
from .rope_cuda import split_rotary_cuda


def _mla_cuda(name: str):
    from . import mla_cuda  # pylint: disable=import-outside-toplevel

    return getattr(mla_cuda, name)


def _mla(s):
    return (s.num_qo_heads, s.kv_lora_rank, s.qk_rope_head_dim, s.dtype)


def _page(s):
    return (1, s.latent_dim, 1) if s.is_mla else (s.num_kv_heads, s.head_dim, 2)


def _decode_paths(s) -> dict:
    """Forced paths of the CUDA decode kernels (MHA and MLA) as keyword arguments: ``decode_splits`` (0 =
    automatic; ``pagedkv.kernel_spec.SWITCHES["cuda_decode_splits"]``)."""
    splits = forced(s.paths, "cuda_decode_splits")
    return {"decode_splits": 0 if splits == "auto" else int(splits)}


FACTORIES = {
    "split_rotary": lambda s: split_rotary_cuda(s.num_qo_heads, s.num_kv_heads, s.head_dim, s.dtype),
    "append_kv": lambda s: append_kv_cuda(s.num_kv_heads, s.head_dim, s.dtype),
    "gather_kv": lambda s: gather_kv_cuda(s.num_kv_heads, s.head_dim, s.dtype),
    "attn_prefill_ragged": lambda s: attn_prefill_ragged_cuda(s.num_qo_heads, s.num_kv_heads, s.head_dim,
                                                              s.v_head_dim, s.dtype, **s.masking),
    "attn_prefill_paged": lambda s: attn_prefill_paged_cuda(s.num_qo_heads, s.num_kv_heads, s.head_dim, s.dtype,
                                                            **s.masking),
    "attn_decode_paged": lambda s: attn_decode_paged_cuda(s.num_qo_heads, s.num_kv_heads, s.head_dim, s.dtype,
                                                          **s.masking, **_decode_paths(s)),
    "merge_state": lambda s: merge_state_cuda(s.num_qo_heads, s.dtype),
    "copy_page": lambda s: copy_page_cuda(*_page(s)[:2], s.dtype, planes=_page(s)[2]),
    "compact_copy": lambda s: compact_copy_cuda(*_page(s)[:2], s.dtype, planes=_page(s)[2]),
    "mla_append_kv": lambda s: _mla_cuda("mla_append_kv_cuda")(s.latent_dim, s.dtype),
    "mla_gather_kv": lambda s: _mla_cuda("mla_gather_kv_cuda")(s.latent_dim, s.dtype),
    "mla_attn_prefill_paged": lambda s: _mla_cuda("mla_attn_prefill_paged_cuda")(*_mla(s)),
    "mla_attn_decode_paged": lambda s: _mla_cuda("mla_attn_decode_paged_cuda")(*_mla(s), **_decode_paths(s)),
}

HELPERS = {"empty_rows": empty_rows_cuda}
