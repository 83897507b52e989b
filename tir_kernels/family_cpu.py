"""The CPU (``llvm``) family: op -> factory ``(spec: KernelSpec) -> PrimFunc``. This family's kernels, their
shared macros and its attention variant live in the ``*_cpu`` / ``_attn_cpu_*`` modules."""

from __future__ import annotations

from .attention_cpu import attn_decode_paged_cpu, attn_prefill_paged_cpu, attn_prefill_ragged_cpu
from .empty_rows import empty_rows_cpu
from .merge import merge_state_cpu
from .mla_cpu import mla_attn_decode_paged_cpu, mla_attn_prefill_paged_cpu
from .page_ops import append_kv_cpu, compact_copy_cpu, copy_page_cpu, gather_kv_cpu, mla_append_kv_cpu, mla_gather_kv_cpu
from .rope import split_rotary_cpu


def _mla(s):
    return (s.num_qo_heads, s.kv_lora_rank, s.qk_rope_head_dim, s.dtype)


def _page(s):
    """(kv heads, row length, planes) of one page: MHA ``[2, Hkv, ps, D]``, MLA ``[1, 1, ps, DL]``."""
    return (1, s.latent_dim, 1) if s.is_mla else (s.num_kv_heads, s.head_dim, 2)


FACTORIES = {
    "split_rotary": lambda s: split_rotary_cpu(s.num_qo_heads, s.num_kv_heads, s.head_dim, s.dtype),
    "append_kv": lambda s: append_kv_cpu(s.num_kv_heads, s.head_dim, s.dtype),
    "gather_kv": lambda s: gather_kv_cpu(s.num_kv_heads, s.head_dim, s.dtype),
    "attn_prefill_ragged": lambda s: attn_prefill_ragged_cpu(s.num_qo_heads, s.num_kv_heads, s.head_dim, s.v_head_dim,
                                                             s.dtype, **s.masking, paths=s.paths),
    "attn_prefill_paged": lambda s: attn_prefill_paged_cpu(s.num_qo_heads, s.num_kv_heads, s.head_dim, s.dtype,
                                                           **s.masking, paths=s.paths),
    "attn_decode_paged": lambda s: attn_decode_paged_cpu(s.num_qo_heads, s.num_kv_heads, s.head_dim, s.dtype,
                                                         **s.masking, paths=s.paths),
    "merge_state": lambda s: merge_state_cpu(s.num_qo_heads, s.dtype),
    "copy_page": lambda s: copy_page_cpu(*_page(s)[:2], s.dtype, planes=_page(s)[2]),
    "compact_copy": lambda s: compact_copy_cpu(*_page(s)[:2], s.dtype, planes=_page(s)[2]),
    "mla_append_kv": lambda s: mla_append_kv_cpu(s.latent_dim, s.dtype),
    "mla_gather_kv": lambda s: mla_gather_kv_cpu(s.latent_dim, s.dtype),
    "mla_attn_prefill_paged": lambda s: mla_attn_prefill_paged_cpu(*_mla(s), paths=s.paths),
    "mla_attn_decode_paged": lambda s: mla_attn_decode_paged_cpu(*_mla(s), paths=s.paths),
}

#: Kernels that are not ops (the FlashInfer backend's empty-state helper), by name -> factory ``(dtype)``.
HELPERS = {"empty_rows": empty_rows_cpu}
