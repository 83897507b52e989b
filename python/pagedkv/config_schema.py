"""The JSON schema of ``KVCacheConfig``: the schema versions, the keys each one added, and the checks
``KVCacheConfig.from_dict`` makes on decoded JSON before the constructor judges the values. Kept apart from
``config.py`` (which re-exports the constants); imports nothing of pagedkv.
"""

from __future__ import annotations

from typing import Any, Mapping

#: The newest schema this package writes; the runtime accepts every schema up to its own newest.
#: Schema 2 added MLA layers (``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``); schema 3 the
#: attention options ``sliding_window`` and ``logits_soft_cap``; schema 4 ``cuda_graph_batch``; schema 5 the
#: attention sinks (``attention_sinks``, ``sink_size``); schema 6 the RoPE variants (``rope``: ``RopeSpec``); schema 7
#: the layer groups (``layer_groups``: per-layer windows, window-sized memory); schema ``FP8_SCHEMA`` the FP8 KV cache
#: (``kv_dtype``, ``k_scale``, ``v_scale``, ``ckv_scale``, ``kpe_scale``). A config is written with the lowest schema
#: that holds it, so an MHA library without those options still loads in a schema-1 runtime.
#: The schema that added the FP8 KV cache: one constant (mirrored by ``kFp8Schema`` in ``src/config.h``).
FP8_SCHEMA = 8
SCHEMA_VERSION = FP8_SCHEMA

#: Fields added by schema ``FP8_SCHEMA`` (``kv_dtype`` = ``dtype``, scales 1: off).
FP8_FIELDS = ("kv_dtype", "k_scale", "v_scale", "ckv_scale", "kpe_scale")
#: Fields added by schema 2 (all 0 for an MHA cache).
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
#: Fields added by schema 3 (0: off).
ATTENTION_OPTION_FIELDS = ("sliding_window", "logits_soft_cap")
#: Fields added by schema 5 (attention sinks; False / 0: off).
SINK_FIELDS = ("attention_sinks", "sink_size")

#: Fields that may be given at run time (e.g. as Relax symbolic variables) instead of at compile time.
RUNTIME_FIELDS = ("max_batch_size", "max_total_seq_len", "prefill_chunk_size", "page_size")

#: The keys ``to_dict`` writes, by the schema that introduced them.
_KEYS_BY_SCHEMA = {
    1: ("schema_version", "num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "v_head_dim", "dtype",
        "rope_mode", "rope_theta", "rope_scale", "page_size", "max_batch_size", "max_total_seq_len",
        "prefill_chunk_size", "layer_kinds", "runtime_fields"),
    2: MLA_FIELDS,
    3: ATTENTION_OPTION_FIELDS,
    4: ("cuda_graph_batch",),
    5: SINK_FIELDS,
    6: ("rope",),
    7: ("layer_groups",),
    FP8_SCHEMA: FP8_FIELDS,
}
_FLOAT_FIELDS = ("rope_theta", "rope_scale", "logits_soft_cap", "ckv_scale", "kpe_scale")
_STR_FIELDS = ("dtype", "rope_mode", "kv_dtype")


def check_keys(fields: dict, schema: int) -> None:
    """Unknown keys, and keys of a schema newer than the one the data says it is, are errors: a misspelled
    or misplaced field never passes as its default."""
    since = {key: v for v, keys in _KEYS_BY_SCHEMA.items() for key in keys}
    unknown = sorted(k for k in fields if k not in since)
    if unknown:
        raise ValueError(f"unknown KVCacheConfig keys {unknown}; known: {sorted(since)}")
    late = sorted(k for k in fields if since[k] > schema)
    if late:
        raise ValueError(f"keys {late} need schema_version >= {max(since[k] for k in late)}, but the config "
                         f"says schema_version {schema}")


def runtime_values(names: Any, values: Mapping[str, int] | None) -> dict:
    """The fields a config left to run time, from ``values``; each named one must be given."""
    if not isinstance(names, (list, tuple)) or any(n not in RUNTIME_FIELDS for n in names):
        raise ValueError(f"runtime_fields must list fields of {RUNTIME_FIELDS}, got {names!r}")
    values = dict(values or {})
    missing, extra = sorted(set(names) - set(values)), sorted(set(values) - set(names))
    if missing or extra:
        raise ValueError(f"the config leaves {list(names)} to run time: runtime_values must give exactly those "
                         f"(missing {missing}, not runtime fields here {extra})")
    return values


def check_types(fields: dict) -> None:
    """JSON types the constructor does not check itself (it checks the int fields)."""
    for name in _FLOAT_FIELDS:
        value = fields.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"KVCacheConfig field {name} must be a number, got {value!r}")
    for name in _STR_FIELDS:
        if name in fields and not isinstance(fields[name], str):
            raise TypeError(f"KVCacheConfig field {name} must be a string, got {fields[name]!r}")
    if not isinstance(fields.get("attention_sinks", False), bool):
        raise TypeError(f"KVCacheConfig field attention_sinks must be a bool, got {fields['attention_sinks']!r}")
    if not isinstance(fields.get("rope", {}), Mapping):
        raise TypeError(f"KVCacheConfig field rope must be an object (RopeSpec fields), got {fields['rope']!r}")
    for name in ("k_scale", "v_scale"):
        value = fields.get(name, 1.0)
        values = value if isinstance(value, list) else [value]
        if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise TypeError(f"KVCacheConfig field {name} must be a number or a non-empty list of numbers, "
                            f"got {value!r}")
    groups = fields.get("layer_groups") or []
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        raise TypeError(f"KVCacheConfig field layer_groups must be a list of objects (LayerGroup fields), got {groups!r}")
    kinds = fields.get("layer_kinds", [])
    if not isinstance(kinds, (list, tuple)) or not all(isinstance(k, str) for k in kinds):
        raise TypeError(f"KVCacheConfig field layer_kinds must be a list of strings, got {kinds!r}")
