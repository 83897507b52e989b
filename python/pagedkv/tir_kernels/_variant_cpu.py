"""The attention variant of the CPU family, defined once: which keys a query row sees and how its logits
are transformed. Decode, paged and ragged prefill (and MLA, which has no options) all take these pieces
from ``CpuVariant``; a new option (e.g. attention sinks) is added here only.

Semantics (``KernelSpec``; bottom-right aligned, query token ``t`` of an entry with ``qlen`` queries and
``kvlen`` keys sits at key position ``p = kvlen - qlen + t``):

* causal: the row sees keys ``j <= p`` (else every key ``j < kvlen``);
* sliding window ``W`` (0: off): it also needs ``j > p - W``, with or without causal;
* logits soft-cap ``c`` (0: off): the natural-units score ``s`` becomes ``c * tanh(s / c)``, before masking.

Scores are kept in log2 units (``sm_scale * log2(e)`` is folded into the queries), so the cap is applied
as ``C tanh(x / C)`` with ``C = c log2(e)``. An option at 0 leaves its code out at parse time, so a kernel
without options is built exactly as one that never had them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from ._math import LOG2E, tanh_approx


@dataclass(frozen=True)
class CpuVariant:
    """Compile-time attention options of one CPU kernel (validated by ``KernelSpec``, not here).

    Attributes
    ----------
    window : int
        Sliding window W (0: off).
    soft_cap : float
        Logits soft-cap c in natural units (0: off).
    """

    window: int = 0
    soft_cap: float = 0.0

    @classmethod
    def from_spec(cls, spec) -> "CpuVariant":
        """The variant of ``spec`` (a ``KernelSpec``; MLA specs carry no options)."""
        return cls(window=spec.sliding_window, soft_cap=float(spec.logits_soft_cap))

    # -- key range of a tile (which key tiles a work item visits) ---------------------------------------
    def first_tile(self, kvlen, qlen, qt0, tk: int):
        """First key tile a query tile starting at token ``qt0`` visits. With a window, its first row has
        the smallest lower bound ``kvlen - qlen + qt0 + 1 - W``: tiles wholly below it are skipped (the
        per-key mask handles the first visited tile); the loaders locate keys from ``j0``."""
        if not self.window:
            return 0
        return T.max(kvlen - qlen + qt0 + 1 - self.window, 0) // tk

    @staticmethod
    def kv_end(causal, kvlen, qlen, qt0, ntok):
        """One past the last key any row of the tile sees: causal caps it at the last token's position."""
        return T.if_then_else(causal > 0, T.min(kvlen, kvlen - qlen + qt0 + ntok), kvlen)

    def decode_keys(self, kvlen):
        """Keys a decode row reads (the work estimate): all, or with a window about the last W."""
        return T.min(kvlen, self.window) if self.window else kvlen

    # -- which keys a row sees ---------------------------------------------------------------------------
    def lim_size(self, rows: int) -> int:
        """Length of the per-row key-limit buffer: upper limits, then (window) lower bounds."""
        return 2 * rows if self.window else rows

    def limits_macro(self, group: int, rows: int):
        """``limits(lim, kvlen, causal, qlen, qt0)``: ``lim[r]`` = keys row ``r`` (token ``qt0 + r // G``)
        may see; with a window ``lim[R + r]`` = its first visible key (may be negative)."""
        G, R, W = group, rows, self.window

        @T.macro
        def limits(lim, kvlen, causal, qlen, qt0):
            for r in T.vectorized(R):
                lim[r] = T.if_then_else(causal > 0, T.min(kvlen, kvlen - qlen + qt0 + r // G + 1), kvlen)
            if W > 0:  # static; the lower bound holds with or without causal
                for r in T.vectorized(R):
                    lim[R + r] = kvlen - qlen + qt0 + r // G + 1 - W

        return limits

    def visible(self, lim, rows: int, r, key):
        """PrimExpr: row ``r`` may see key position ``key`` (``lim`` from ``limits_macro``)."""
        if self.window:
            return tirx.And(key < lim[r], key >= lim[rows + r])
        return key < lim[r]

    def hides_keys(self, lim, rows: int, nrows, j0, nk):
        """PrimExpr: some valid row (of ``nrows``) does not see some key of ``j0 .. j0 + nk``. Row limits grow
        with the row (``limits_macro``), so row 0 has the lowest upper limit and the last valid row the highest
        window start."""
        hidden = j0 + nk > lim[0]
        if self.window:
            return tirx.Or(hidden, j0 < lim[rows + nrows - 1])
        return hidden

    # -- logits transform ---------------------------------------------------------------------------------
    @property
    def capped(self) -> bool:
        return self.soft_cap > 0

    def cap(self, x):
        """PrimExpr: the soft-capped log2 score ``C tanh(x / C)``, or ``x`` itself when the cap is off."""
        c = self.soft_cap * LOG2E
        if not c:
            return x
        return tirx.const(c, "float32") * tanh_approx(x * tirx.const(1.0 / c, "float32"))


__all__ = ["CpuVariant"]
