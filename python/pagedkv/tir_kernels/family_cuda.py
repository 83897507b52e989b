"""The CUDA family: op -> factory ``(spec: KernelSpec) -> PrimFunc``. This family's kernels, their shared
macros and its attention variant live in the ``*_cuda`` / ``_common_cuda`` modules."""

from __future__ import annotations

from .attention_cuda import attn_decode_paged_cuda, attn_prefill_paged_cuda, attn_prefill_ragged_cuda
from .empty_rows import empty_rows_cuda
from .merge_cuda import merge_state_cuda, merge_state_partial_cuda
from .sinks_cuda import apply_sinks_cuda, merge_state_partial_sinks_cuda
from .page_ops_cuda import append_kv_cuda, compact_copy_cuda, copy_page_cuda, gather_kv_cuda
from .rope_cuda import split_rotary_cuda


def _mla_cuda(name: str):
    from . import mla_cuda  # pylint: disable=import-outside-toplevel

    return getattr(mla_cuda, name)


FACTORIES = {
    "split_rotary": split_rotary_cuda,
    "append_kv": append_kv_cuda,
    "gather_kv": gather_kv_cuda,
    "attn_prefill_ragged": attn_prefill_ragged_cuda,
    "attn_prefill_paged": attn_prefill_paged_cuda,
    "attn_decode_paged": attn_decode_paged_cuda,
    "merge_state": merge_state_cuda,
    "copy_page": copy_page_cuda,
    "compact_copy": compact_copy_cuda,
    "mla_append_kv": lambda s: _mla_cuda("mla_append_kv_cuda")(s),
    "mla_gather_kv": lambda s: _mla_cuda("mla_gather_kv_cuda")(s),
    "mla_attn_prefill_paged": lambda s: _mla_cuda("mla_attn_prefill_paged_cuda")(s),
    "mla_attn_decode_paged": lambda s: _mla_cuda("mla_attn_decode_paged_cuda")(s),
    # The partial-state variants of the attention ops are their kernels built with ``KernelSpec.partial``
    # (``pagedkv.tir_kernels.make``); their merge is a kernel of its own.
    "merge_state_partial": merge_state_partial_cuda,
    # The attention-sink ops (attention_sinks configs).
    "apply_sinks": apply_sinks_cuda,
    "merge_state_partial_sinks": merge_state_partial_sinks_cuda,
}

HELPERS = {"empty_rows": empty_rows_cuda}
