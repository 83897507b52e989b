"""The CPU (``llvm``) family: op -> factory ``(spec: KernelSpec) -> PrimFunc``. This family's kernels, their
shared macros and its attention variant live in the ``*_cpu`` / ``_attn_cpu_*`` modules."""

from __future__ import annotations

from .attention_cpu import attn_decode_paged_cpu, attn_prefill_paged_cpu, attn_prefill_ragged_cpu
from .empty_rows import empty_rows_cpu
from .merge import merge_state_cpu, merge_state_partial_cpu
from .sinks import apply_sinks_cpu, merge_state_partial_sinks_cpu
from .mla_cpu import mla_attn_decode_paged_cpu, mla_attn_prefill_paged_cpu
from .page_ops import append_kv_cpu, compact_copy_cpu, copy_page_cpu, gather_kv_cpu, mla_append_kv_cpu, mla_gather_kv_cpu
from .rope import split_rotary_cpu


FACTORIES = {
    "split_rotary": split_rotary_cpu,
    "append_kv": append_kv_cpu,
    "gather_kv": gather_kv_cpu,
    "attn_prefill_ragged": attn_prefill_ragged_cpu,
    "attn_prefill_paged": attn_prefill_paged_cpu,
    "attn_decode_paged": attn_decode_paged_cpu,
    "merge_state": merge_state_cpu,
    "copy_page": copy_page_cpu,
    "compact_copy": compact_copy_cpu,
    "mla_append_kv": mla_append_kv_cpu,
    "mla_gather_kv": mla_gather_kv_cpu,
    "mla_attn_prefill_paged": mla_attn_prefill_paged_cpu,
    "mla_attn_decode_paged": mla_attn_decode_paged_cpu,
    # The partial-state variants of the attention ops are their kernels built with ``KernelSpec.partial``
    # (``pagedkv.tir_kernels.make``); their merge is a kernel of its own.
    "merge_state_partial": merge_state_partial_cpu,
    # The attention-sink ops (attention_sinks configs).
    "apply_sinks": apply_sinks_cpu,
    "merge_state_partial_sinks": merge_state_partial_sinks_cpu,
}

#: Kernels that are not ops (the FlashInfer backend's empty-state helper), by name -> factory ``(dtype)``.
HELPERS = {"empty_rows": empty_rows_cpu}
