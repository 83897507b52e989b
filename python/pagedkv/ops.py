"""The op vocabulary shared by Python, the C++ runtime's op table (``src/ops.h``) and test ids.

Every backend serves some of these ops; the runtime looks an op up by this exact name. Names and the
argument list of an op are frozen once released (see ``docs/ARCHITECTURE.md``, versioning rule): a changed
ABI gets a new name.
"""

from __future__ import annotations

SPLIT_ROTARY = "split_rotary"
APPEND_KV = "append_kv"
GATHER_KV = "gather_kv"
ATTN_PREFILL_RAGGED = "attn_prefill_ragged"
ATTN_PREFILL_PAGED = "attn_prefill_paged"
ATTN_DECODE_PAGED = "attn_decode_paged"
MERGE_STATE = "merge_state"
COPY_PAGE = "copy_page"
COMPACT_COPY = "compact_copy"

#: Every op, in the order the Relax constructor emits them.
OPS: tuple[str, ...] = (
    SPLIT_ROTARY,
    APPEND_KV,
    GATHER_KV,
    ATTN_PREFILL_RAGGED,
    ATTN_PREFILL_PAGED,
    ATTN_DECODE_PAGED,
    MERGE_STATE,
    COPY_PAGE,
    COMPACT_COPY,
)

#: Ops that compute attention (the ones a faster backend is most likely to take over).
ATTENTION_OPS: tuple[str, ...] = (ATTN_PREFILL_RAGGED, ATTN_PREFILL_PAGED, ATTN_DECODE_PAGED)


def check_op(name: str) -> str:
    """Return ``name`` if it is a known op, else raise ``ValueError`` naming it."""
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(OPS)}")
    return name
