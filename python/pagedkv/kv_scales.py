"""FP8 KV cache fields of ``KVCacheConfig`` (``kv_dtype``, ``k_scale``, ``v_scale``, ``ckv_scale``, ``kpe_scale``):
their checks, their normal form and JSON, and the checkpoint reader, kept apart from ``config.py`` (which calls
them). Imports nothing of pagedkv.

A scale that nothing applies is the bug every FP8 KV cache has shipped (a path that drops or doubles it), so a
config never holds one its kernels would ignore: scales other than 1 need an FP8 ``kv_dtype``, MHA layers take
``k_scale`` / ``v_scale``, MLA layers ``ckv_scale`` / ``kpe_scale``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

#: The 8-bit page formats (``kv_dtype``): OCP e4m3 without infinities (max 448), stored as bytes.
FP8_KV_DTYPES = ("float8_e4m3fn",)
#: The largest finite e4m3fn value: appends saturate there (``k / k_scale`` beyond it is stored as +-448).
FP8_E4M3_MAX = 448.0
MHA_SCALES = ("k_scale", "v_scale")
MLA_SCALES = ("ckv_scale", "kpe_scale")


def _positive_finite(value) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def as_scale(value: Any) -> Any:
    """A ``k_scale`` / ``v_scale`` as the config keeps it: a per-head list (JSON, numpy) as a tuple of floats (what is
    not a number is kept, for ``problems`` to name); a single value as given."""
    if isinstance(value, (list, tuple)) or (hasattr(value, "__len__") and not isinstance(value, str)):
        return tuple(float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v for v in value)
    return value


def json_fields(config) -> dict:
    """The FP8 fields of ``config`` as ``KVCacheConfig.to_dict`` writes them (schema ``FP8_SCHEMA``)."""
    out = {"kv_dtype": config.page_dtype}
    out.update({n: list(v) if isinstance(v, tuple) else float(v)
                for n in MHA_SCALES + MLA_SCALES for v in [getattr(config, n)]})
    return out


def _value_problems(config) -> list[str]:
    out = []
    heads = config.num_kv_heads if isinstance(config.num_kv_heads, int) else None
    for name in MHA_SCALES:
        value = getattr(config, name)
        values = value if isinstance(value, tuple) else (value,)
        if isinstance(value, tuple) and len(value) != heads:
            out.append(f"{name} has {len(value)} values; it takes one (per tensor) or num_kv_heads ({heads})")
        bad = [v for v in values if not _positive_finite(v)]
        if bad:
            out.append(f"{name} must hold finite numbers > 0, got {bad[0]!r}")
    out += [f"{name} must be a finite number > 0, got {getattr(config, name)!r}"
            for name in MLA_SCALES if not _positive_finite(getattr(config, name))]
    return out


def problems(config) -> list[str]:
    """Every reason the FP8 fields of ``config`` (a ``KVCacheConfig``) are invalid."""
    if config.kv_dtype is not None and config.kv_dtype not in FP8_KV_DTYPES:
        return [f"kv_dtype {config.kv_dtype!r} must be None (the dtype, {config.dtype!r}) or one of {FP8_KV_DTYPES}"]
    out = _value_problems(config)
    if out:
        return out
    given = [n for n in MHA_SCALES + MLA_SCALES if config.scales_of(n) != (1.0,)]
    if given and not config.fp8:
        return [f"{', '.join(given)} scale FP8 pages: they need kv_dtype 'float8_e4m3fn' (this cache stores "
                f"{config.page_dtype}, so they would be ignored)"]
    wrong = [n for n in given if (n in MHA_SCALES) == config.is_mla]
    if wrong:
        kind, right = ("MLA", "ckv_scale, kpe_scale") if config.is_mla else ("MHA", "k_scale, v_scale")
        out.append(f"{', '.join(wrong)} do not apply to {kind} layers (they take {right})")
    return out


def from_checkpoint(config, scales: Mapping[str, Any]) -> dict:
    """The field values of checkpoint arrays ``scales`` by name (``KVCacheConfig.with_kv_scales``).

    ``k_scale`` / ``v_scale`` (MHA) or ``ckv_scale`` / ``kpe_scale`` (MLA): arrays (numpy, torch) or numbers of shape
    ``()`` or ``[1]`` (per tensor) or ``[num_kv_heads]`` (per kv head; MHA). A per-layer checkpoint's ``[num_layers]``
    / ``[num_layers, num_kv_heads]`` arrays are refused unless every layer holds the same values: one cache applies
    one set to all its layers.

    Raises
    ------
    TypeError
        An unknown name, or a value that is not numeric.
    ValueError
        A wrong length, layers that differ, or a cache that is not FP8 (the config then checks the values).
    """
    import numpy as np  # checkpoints hand numpy / torch arrays; numpy reads both

    unknown = sorted(set(scales) - set(MHA_SCALES + MLA_SCALES))
    if unknown:
        raise TypeError(f"with_kv_scales: unknown scale names {unknown}; known: k_scale, v_scale (MHA), "
                        "ckv_scale, kpe_scale (MLA)")
    if not config.fp8:
        raise ValueError(f"with_kv_scales: the cache stores {config.page_dtype}; scales need kv_dtype "
                         f"{FP8_KV_DTYPES[0]!r} (replace(kv_dtype=...) first)")
    changes = {}
    for name, value in scales.items():
        arr = np.asarray(value.detach().float().cpu() if hasattr(value, "detach") else value)
        if arr.dtype.kind not in "fiu":
            raise TypeError(f"with_kv_scales: {name} must be numeric, got {arr.dtype}")
        arr = arr.astype(np.float64)
        per_layer = arr.ndim == 2 or (arr.ndim == 1 and arr.shape[0] == config.num_layers > 1
                                      and arr.shape[0] != config.num_kv_heads)
        if per_layer:
            if not np.all(arr == arr[:1]):
                raise ValueError(f"with_kv_scales: {name} differs between layers (shape {arr.shape}); a cache applies "
                                 "one scale set to all its layers (per-layer scales are not implemented)")
            arr = arr[0]
        flat = arr.reshape(-1)
        if flat.size != 1 and (name in MLA_SCALES or flat.size != config.num_kv_heads):
            raise ValueError(f"with_kv_scales: {name} takes one value"
                             + ("" if name in MLA_SCALES else f" or num_kv_heads ({config.num_kv_heads})")
                             + f", got shape {tuple(arr.shape)}")
        changes[name] = float(flat[0]) if flat.size == 1 else tuple(float(v) for v in flat)
    return changes
