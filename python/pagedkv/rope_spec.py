"""RoPE variants of the cache's own rotation (``rope_mode`` "normal" / "inline"): ``RopeSpec``, its float64
frequencies, and the compile-time table the kernels take (``RopeTable``). TVM-free (a runtime-only process keys
its prebuilt libraries with ``KernelSpec``, which holds the table).

Every variant is, per rotation pair ``i < R / 2`` (``R`` = ``rotary_dim``, the rotated leading dims of a head):

* an inverse frequency ``inv_freq[i]``: the angle at position ``p`` is ``p * rope_scale * inv_freq[i]``;
* an attention factor ``a`` multiplying cos and sin (so the rotated dims of q and k are scaled by ``a``; YaRN's
  mscale, LongRoPE's factor; 1 otherwise);
* the pairing: ``"halves"`` rotates ``(x[i], x[i + R/2])`` (Llama / GPT-NeoX ``rotate_half``), ``interleaved``
  rotates ``(x[2i], x[2i + 1])`` (GPT-J ``rotate_every_two``); dims ``>= R`` pass through unrotated.

The frequencies follow transformers' ``modeling_rope_utils`` (``ROPE_INIT_FUNCTIONS``), evaluated in float64
here (transformers evaluates them in float32). ``pagedkv.testing.reference`` implements them again, independently,
and the tests check both against transformers.

LongRoPE has two sets (short and long factors); the cache picks one per forward, as transformers does per call:
the long set when the forward's longest sequence (its largest query position + 1) exceeds
``original_max_position_embeddings``. The runtime passes ``apply_rope = 2`` to the kernels for the long set
(1: the short set), so the op ABI is unchanged. With ``rope_mode="normal"`` the keys of earlier forwards keep the
rotation they were stored with (as transformers' KV cache does); with ``"inline"`` every key is rotated with the
set of the current forward.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Mapping

#: The variants the cache rotates itself (transformers' ``rope_type`` names).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
#: Parameters each variant requires (``None`` = not given).
REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
#: Parameters each variant may take beyond its required ones.
OPTIONAL = {
    "default": (),
    "linear": (),
    "llama3": (),
    "yarn": ("beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim", "attention_factor"),
    "longrope": ("factor", "attention_factor"),
}
#: The scaling parameters (every ``RopeSpec`` field but the type, the rotated dims and the pairing).
PARAMETERS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
              "beta_slow", "truncate", "mscale", "mscale_all_dim", "attention_factor", "short_factor", "long_factor")


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class RopeSpec:
    """How the cache rotates q and k beyond ``rope_theta`` / ``rope_scale`` (``KVCacheConfig.rope``, schema 6).

    Field names are transformers' ``rope_scaling`` keys (``from_hf`` reads them); ``None`` = not given.

    Parameters
    ----------
    rope_type : str
        ``"default"`` (plain RoPE), ``"linear"`` (positions divided by ``factor``), ``"llama3"`` (Llama 3.1+),
        ``"yarn"`` (gpt-oss, DeepSeek, Qwen long context), ``"longrope"`` (Phi-3 / Phi-4).
    rotary_dim : int
        Rotated leading dims of a head (even, <= head_dim; GPT-NeoX / GPT-J / Phi rotate part of it); 0: the whole
        head.
    interleaved : bool
        Pairing: False rotates ``(x[i], x[i + R/2])`` (Llama, GPT-NeoX: "rotate half"), True ``(x[2i], x[2i+1])``
        (GPT-J, "rotate every two").
    factor : float
        linear: position divisor; llama3 / yarn: context extension factor; longrope: only for the default
        ``attention_factor`` (transformers: ``max_position_embeddings / original_max_position_embeddings``).
    original_max_position_embeddings : int
        Pretraining context (llama3, yarn; longrope: the short / long switch).
    low_freq_factor, high_freq_factor : float
        llama3's wavelength bounds ``original / low_freq_factor`` and ``original / high_freq_factor``.
    beta_fast, beta_slow, truncate : float, float, bool
        yarn's correction range (32, 1, True when not given; gpt-oss: truncate False).
    mscale, mscale_all_dim : float
        yarn's attention factor ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given
        (DeepSeek), else ``mscale(factor) = 0.1 ln(factor) + 1``.
    attention_factor : float
        yarn / longrope: multiplies cos and sin; not given: derived as transformers does.
    short_factor, long_factor : tuple of float
        longrope: per-pair frequency divisors (``rotary_dim / 2`` each), short below
        ``original_max_position_embeddings``, long past it (module docstring).
    """

    rope_type: str = "default"
    rotary_dim: int = 0
    interleaved: bool = False
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    short_factor: tuple | None = None
    long_factor: tuple | None = None

    def __post_init__(self):
        for name in ("short_factor", "long_factor"):  # hashable and JSON-equal whatever sequence was given
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(float(v) if _number(v) else v for v in value))

    @property
    def is_default(self) -> bool:
        """Plain RoPE over the whole head, halves pairing (what the cache did before schema 6)."""
        return self == RopeSpec()

    def dims(self, head_dim: int) -> int:
        """The rotated dims ``R`` of a head of ``head_dim``."""
        return self.rotary_dim or head_dim

    # -- validation -------------------------------------------------------------------------------------
    def problems(self, head_dim: int) -> list[str]:
        """Every reason this spec cannot rotate heads of ``head_dim`` (empty: it can)."""
        if self.rope_type not in ROPE_TYPES:
            return [f"unknown rope_type {self.rope_type!r}; the cache rotates {', '.join(ROPE_TYPES)} (rotate "
                    "in the model and pass rope_mode='none' for others)"]
        out = self._dim_problems(head_dim)
        kind = self.rope_type
        missing = [n for n in REQUIRED[kind] if getattr(self, n) is None]
        if missing:
            out.append(f"rope_type {kind!r} needs {', '.join(missing)}")
        extra = [n for n in PARAMETERS if getattr(self, n) is not None and n not in REQUIRED[kind] + OPTIONAL[kind]]
        if extra:
            out.append(f"rope_type {kind!r} takes no {', '.join(extra)}")
        if missing or extra:
            return out
        return out + self._value_problems(head_dim)

    def _dim_problems(self, head_dim: int) -> list[str]:
        r = self.rotary_dim
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            return [f"rotary_dim must be an int >= 0 (0: the whole head), got {r!r}"]
        out = []
        if r % 2:
            out.append(f"rotary_dim {r} is odd (RoPE rotates pairs of dims)")
        if isinstance(head_dim, int) and r > head_dim:
            out.append(f"rotary_dim {r} is larger than head_dim {head_dim}")
        if not isinstance(self.interleaved, bool):
            out.append(f"interleaved must be a bool, got {self.interleaved!r}")
        return out

    def _value_problems(self, head_dim: int) -> list[str]:
        out = []
        positive = [n for n in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                                "attention_factor") if getattr(self, n) is not None]
        out += [f"{n} must be a finite number > 0, got {getattr(self, n)!r}" for n in positive
                if not _number(getattr(self, n)) or getattr(self, n) <= 0]
        out += [f"{n} must be a finite number, got {getattr(self, n)!r}" for n in ("mscale", "mscale_all_dim")
                if getattr(self, n) is not None and not _number(getattr(self, n))]
        omax = self.original_max_position_embeddings
        if omax is not None and (isinstance(omax, bool) or not isinstance(omax, int) or omax < 1):
            out.append(f"original_max_position_embeddings must be an int >= 1, got {omax!r}")
        if self.truncate is not None and not isinstance(self.truncate, bool):
            out.append(f"truncate must be a bool, got {self.truncate!r}")
        if out:
            return out
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            out.append(f"llama3 needs high_freq_factor > low_freq_factor, got {self.high_freq_factor} and "
                       f"{self.low_freq_factor}")
        if self.rope_type == "longrope":
            out += self._longrope_problems(head_dim)
        return out

    def _longrope_problems(self, head_dim: int) -> list[str]:
        out, half = [], self.dims(head_dim) // 2
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(_number(v) and v > 0 for v in value):
                out.append(f"{name} must be a list of finite numbers > 0, got {value!r}")
            elif len(value) != half:
                out.append(f"{name} has {len(value)} entries; rotary_dim {self.dims(head_dim)} has {half} pairs")
        if self.factor is None and self.attention_factor is None:
            out.append("longrope needs factor (max_position_embeddings / original_max_position_embeddings) or "
                       "attention_factor: its attention factor derives from factor")
        return out

    # -- serialization ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The given fields by name (``rope_type`` always; tuples as lists)."""
        out = {"rope_type": self.rope_type}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "rope_type" and value is not None and value != f.default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RopeSpec":
        """The spec ``to_dict`` wrote; unknown keys are errors (a misspelled parameter never passes unread)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"RopeSpec.from_dict takes a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown RoPE fields {unknown}; known: {sorted(known)}")
        return cls(**dict(data))

    @classmethod
    def from_hf(cls, rope_scaling: Mapping[str, Any] | None, *, head_dim: int, rotary_dim: int = 0,
                interleaved: bool = False, max_position_embeddings: int | None = None) -> "RopeSpec":
        """The spec of a transformers ``rope_scaling`` / ``rope_parameters`` dict (``rope_theta`` and
        ``partial_rotary_factor`` in it are read by ``pagedkv.config.hf_rope_fields``, not here).

        ``max_position_embeddings`` resolves what transformers derives from it: yarn's and longrope's missing
        ``factor``. Raises ``ValueError`` naming a type the cache does not rotate.
        """
        params = dict(rope_scaling or {})
        kind = params.pop("rope_type", params.pop("type", "default")) or "default"
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type {kind!r} is not rotated by the cache (it rotates {', '.join(ROPE_TYPES)}); "
                             "rotate in the model and pass rope_mode='none'")
        for ignored in ("rope_theta", "partial_rotary_factor"):
            params.pop(ignored, None)
        keep = {k: v for k, v in params.items() if v is not None and k in REQUIRED[kind] + OPTIONAL[kind]}
        if kind in ("yarn", "longrope") and keep.get("factor") is None and max_position_embeddings:
            omax = keep.get("original_max_position_embeddings")
            if omax:
                keep["factor"] = max_position_embeddings / omax
        if kind == "longrope" and "original_max_position_embeddings" not in keep and max_position_embeddings:
            keep["original_max_position_embeddings"] = max_position_embeddings
        for name in ("original_max_position_embeddings",):
            if isinstance(keep.get(name), float) and keep[name].is_integer():
                keep[name] = int(keep[name])
        rd = 0 if rotary_dim in (0, head_dim) else rotary_dim
        return cls(rope_type=kind, rotary_dim=rd, interleaved=interleaved, **keep)


# -- frequencies (float64) ------------------------------------------------------------------------------
def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def attention_factor(spec: RopeSpec) -> float:
    """The factor multiplying cos and sin (transformers' ``attention_scaling``)."""
    if spec.attention_factor is not None:
        return float(spec.attention_factor)
    if spec.rope_type == "yarn":
        if spec.mscale and spec.mscale_all_dim:
            return _mscale(spec.factor, spec.mscale) / _mscale(spec.factor, spec.mscale_all_dim)
        return _mscale(spec.factor)
    if spec.rope_type == "longrope" and spec.factor > 1:
        return math.sqrt(1 + math.log(spec.factor) / math.log(spec.original_max_position_embeddings))
    return 1.0


def inv_freq(spec: RopeSpec, head_dim: int, theta: float, *, long: bool = False) -> list[float]:
    """``inv_freq[i]``, ``i < R / 2``, in float64 (``long``: LongRoPE's long set; ignored otherwise)."""
    r = spec.dims(head_dim)
    base = [1.0 / theta ** (2 * i / r) for i in range(r // 2)]
    kind = spec.rope_type
    if kind == "linear":
        return [f / spec.factor for f in base]
    if kind == "llama3":
        return [_llama3(f, spec) for f in base]
    if kind == "yarn":
        return _yarn(base, spec, r, theta)
    if kind == "longrope":
        ext = spec.long_factor if long else spec.short_factor
        return [f / e for f, e in zip(base, ext)]
    return base


def _llama3(f: float, spec: RopeSpec) -> float:
    omax, lo, hi = spec.original_max_position_embeddings, spec.low_freq_factor, spec.high_freq_factor
    wavelen = 2 * math.pi / f
    if wavelen < omax / hi:  # high frequencies: kept
        return f
    if wavelen > omax / lo:  # low frequencies: interpolated by factor
        return f / spec.factor
    smooth = (omax / wavelen - lo) / (hi - lo)
    return (1 - smooth) * f / spec.factor + smooth * f


def _yarn(base: list[float], spec: RopeSpec, r: int, theta: float) -> list[float]:
    beta_fast = spec.beta_fast or 32.0
    beta_slow = spec.beta_slow or 1.0
    omax = spec.original_max_position_embeddings

    def correction_dim(rotations):  # the dim whose wavelength fits `rotations` times into omax
        return r * math.log(omax / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    out = []
    for i, f in enumerate(base):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: extrapolate (keep f), 1: interpolate (f / factor)
        out.append(f / spec.factor * ramp + f * (1 - ramp))
    return out


# -- the kernels' view ----------------------------------------------------------------------------------
def linear_factor(spec: RopeSpec) -> float:
    """The position divisor the runtime folds into the ``rope_scale`` argument (``rope_scale / factor``) for a
    "linear" spec the plain kernels serve; 1 for every other type."""
    return float(spec.factor) if spec.rope_type == "linear" else 1.0


def plain_kernels_serve(spec: RopeSpec, head_dim: int) -> bool:
    """Whether the kernels' own formula (``p * rope_scale / theta ** (2i / D)``, whole head, halves) serves
    ``spec``: the default type, and "linear" through the runtime's ``rope_scale / factor``."""
    return spec.rope_type in ("default", "linear") and spec.dims(head_dim) == head_dim and not spec.interleaved


def cuda_inline_serves(spec: RopeSpec, head_dim: int) -> bool:
    """Whether the CUDA attention kernels' inline RoPE serves ``spec``: the whole head in halves (their lane
    layouts pair ``x[i]`` with ``x[i + D/2]``), any ``rope_type``: a table's frequencies replace theirs and its
    attention factor, which then scales every dim of q and k, folds into the scores' scale (``a^2 * sm_scale``).
    The decode's lane-group kernel and the SIMT prefill take tables (``KernelSpec.rope``)."""
    return spec.dims(head_dim) == head_dim and not spec.interleaved


@dataclass(frozen=True)
class RopeTable:
    """A RoPE variant as the kernels take it: compile-time constants (``KernelSpec.rope``).

    Parameters
    ----------
    rotary_dim : int
        Rotated leading dims ``R`` of a head (even); dims ``>= R`` pass through.
    interleaved : bool
        Pairs ``(2i, 2i + 1)`` instead of ``(i, i + R/2)``.
    inv_freq : tuple of float
        ``R / 2`` float64 frequencies, ``rope_scale`` included: the angle is ``p * inv_freq[i]``.
    inv_freq_long : tuple of float
        LongRoPE's long set (``apply_rope == 2``); empty for every other variant.
    attention_factor : float
        Multiplies cos and sin.
    """

    rotary_dim: int
    interleaved: bool
    inv_freq: tuple
    inv_freq_long: tuple = ()
    attention_factor: float = 1.0

    @property
    def half(self) -> int:
        return self.rotary_dim // 2

    def pair(self, i):
        """Dims ``(a, b)`` of rotation pair ``i`` (ints or TIR expressions): ``x'[a] = x[a] c - x[b] s``,
        ``x'[b] = x[b] c + x[a] s``."""
        return (2 * i, 2 * i + 1) if self.interleaved else (i, i + self.half)

    def to_dict(self) -> dict:
        return {"rotary_dim": self.rotary_dim, "interleaved": self.interleaved, "inv_freq": list(self.inv_freq),
                "inv_freq_long": list(self.inv_freq_long), "attention_factor": self.attention_factor}


def rope_table(spec: RopeSpec, head_dim: int, theta: float, scale: float) -> RopeTable | None:
    """The kernels' table of ``spec`` (None: the plain kernels serve it, ``plain_kernels_serve``)."""
    if plain_kernels_serve(spec, head_dim):
        return None
    long = inv_freq(spec, head_dim, theta, long=True) if spec.rope_type == "longrope" else []
    return RopeTable(rotary_dim=spec.dims(head_dim), interleaved=spec.interleaved,
                     inv_freq=tuple(scale * f for f in inv_freq(spec, head_dim, theta)),
                     inv_freq_long=tuple(scale * f for f in long), attention_factor=attention_factor(spec))




def hf_rope_fields(hf_config) -> dict:
    """``{"rope_theta": ..., "rope": RopeSpec}`` of a transformers config, for ``KVCacheConfig(**fields, ...)``.

    Reads ``rope_parameters`` (transformers 5) or ``rope_scaling`` with ``rope_theta``, the head dim, the rotated
    part (``partial_rotary_factor``, GPT-NeoX's ``rotary_pct``, GPT-J's ``rotary_dim``), GPT-J / CodeGen's
    interleaved pairs and ``max_position_embeddings``. Raises ``ValueError`` for a ``rope_type`` the cache does not
    rotate (``RopeSpec.from_hf``).
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rotary_dim = getattr(hf_config, "rotary_dim", None)  # GPT-J / CodeGen: an absolute count
    if not rotary_dim:
        part = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
        part = getattr(hf_config, "rotary_pct", 1.0) if part is None else part
        rotary_dim = int(head_dim * part)  # transformers' own rounding
    interleaved = getattr(hf_config, "model_type", "") in ("gptj", "codegen")
    spec = RopeSpec.from_hf(params, head_dim=head_dim, rotary_dim=rotary_dim, interleaved=interleaved,
                            max_position_embeddings=getattr(hf_config, "max_position_embeddings", None))
    return {"rope_theta": float(10000.0 if theta is None else theta), "rope": spec}


__all__ = ["OPTIONAL", "PARAMETERS", "REQUIRED", "ROPE_TYPES", "RopeSpec", "RopeTable", "attention_factor", "hf_rope_fields",
           "cuda_inline_serves", "inv_freq", "linear_factor", "plain_kernels_serve", "rope_table"]
