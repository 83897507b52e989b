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
# MLA layers (pages hold one latent vector per token; see docs/ARCHITECTURE.md, "MLA").
MLA_APPEND_KV = "mla_append_kv"
MLA_GATHER_KV = "mla_gather_kv"
MLA_ATTN_PREFILL_PAGED = "mla_attn_prefill_paged"
MLA_ATTN_DECODE_PAGED = "mla_attn_decode_paged"

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
    MLA_APPEND_KV,
    MLA_GATHER_KV,
    MLA_ATTN_PREFILL_PAGED,
    MLA_ATTN_DECODE_PAGED,
)

#: The ops a cache of each layer kind uses (an MLA cache's self_attention is the ragged MHA kernel with
#: head_dim != v_head_dim; its pages move with the same copy ops, built for one latent plane).
OPS_BY_KIND: dict[str, tuple[str, ...]] = {
    "mha": (SPLIT_ROTARY, APPEND_KV, GATHER_KV, ATTN_PREFILL_RAGGED, ATTN_PREFILL_PAGED, ATTN_DECODE_PAGED,
            MERGE_STATE, COPY_PAGE, COMPACT_COPY),
    "mla": (MLA_APPEND_KV, MLA_GATHER_KV, ATTN_PREFILL_RAGGED, MLA_ATTN_PREFILL_PAGED,
            MLA_ATTN_DECODE_PAGED, MERGE_STATE, COPY_PAGE, COMPACT_COPY),
}

#: Ops that compute attention (the ones a faster backend is most likely to take over).
ATTENTION_OPS: tuple[str, ...] = (ATTN_PREFILL_RAGGED, ATTN_PREFILL_PAGED, ATTN_DECODE_PAGED,
                                  MLA_ATTN_PREFILL_PAGED, MLA_ATTN_DECODE_PAGED)


def ops_for(config) -> tuple[str, ...]:
    """The ops a cache with ``config`` (a ``KVCacheConfig``) uses, in ``OPS`` order."""
    return OPS_BY_KIND["mla" if config.is_mla else "mha"]


def check_op(name: str) -> str:
    """Return ``name`` if it is a known op, else raise ``ValueError`` naming it."""
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(OPS)}")
    return name
