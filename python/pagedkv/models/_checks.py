"""Range checks of the model configs' fields (``LlamaConfig``, ``DeepseekV3Config``), free of TVM: a NaN or
negative ``rope_theta`` or ``rms_norm_eps`` would compile and run into plausible-looking numbers, a zero dim into a
shape error far from its cause."""

from __future__ import annotations

import math


def check_fields(cfg, *, positive_ints: tuple[str, ...], positive_floats: tuple[str, ...],
                 nonnegative_ints: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` naming the first field of ``cfg`` out of range: ``positive_ints`` must be ints >= 1,
    ``nonnegative_ints`` ints >= 0, ``positive_floats`` finite numbers > 0."""
    name = type(cfg).__name__
    for field in positive_ints + nonnegative_ints:
        value, low = getattr(cfg, field), 1 if field in positive_ints else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}.{field} must be an int >= {low}, got {value!r}")
    for field in positive_floats:
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}.{field} must be a finite number > 0, got {value!r}")
