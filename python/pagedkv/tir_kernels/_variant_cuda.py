"""The attention variant of the CUDA family: every mask and logits rule of the CUDA attention kernels
(decode, paged and ragged prefill), in one place.

``CudaVariant.from_spec(spec)`` reads the compile-time options of a ``KernelSpec`` (values already checked
there) and gives the kernels helpers that return TIR expressions (called inside their ``@T.macro`` s):

* which keys a row sees: bottom-right causal (row ``t`` of an entry sits at key position
  ``p = kvlen - qlen + t`` and sees keys ``j <= p``); with a sliding window ``W`` also ``j > p - W``;
* the key range a row / tile / split reads (the window start; decode reads only its window);
* the logits transform: soft cap ``c tanh(s / c)`` on log2-unit scores, then the mask.

Every option is a static Python ``if``: with an option off the generated TIR is exactly the one from
before it existed. A new option (e.g. attention sinks) is added here only.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from ._common import LOG2E, MASKED
from ._common_cuda import frcp_rn

#: Sliding windows are clamped to this many keys so that window bounds stay in int32 (a window this long
#: hides no key of any entry the kernels can index anyway).
MAX_WINDOW = 1 << 30
#: First key of a padding row in the windowed kernels: past every key.
NO_ROW = 1 << 30
#: Span bound of the non-causal windowed mask: none (``key - first key`` stays below it).
NO_SPAN = (1 << 31) - 1


def soft_cap(score, cap: float):
    """``logits_soft_cap`` on a log2-unit score (the kernels fold ``log2(e)`` into q): ``c tanh(s / c)`` in
    natural units is ``C tanh(x / C)`` with ``x = s log2(e)``, ``C = c log2(e)``; ``cap = 0`` returns
    ``score`` unchanged.

    Written as ``C - 2C / (2^(2x/c) + 1)`` (``tanh y = 1 - 2 / (e^(2y) + 1)``) with ``exp2f`` and an IEEE
    reciprocal, because ``--use_fast_math`` turns ``tanhf`` into ``tanh.approx.f32`` (relative error
    2^-11: far too coarse for float32 scores). The absolute error stays within a few float32 ulps of
    ``C``; it saturates to exactly +-C (``exp2`` gives inf or 0) and maps 0 to 0.
    """
    if not cap:
        return score
    big_c = float(cap) * LOG2E
    return T.float32(big_c) - T.float32(2.0 * big_c) * frcp_rn(T.exp2(score * T.float32(2.0 / cap)) + T.float32(1))


@dataclass(frozen=True)
class CudaVariant:
    """Mask and logits rules of the CUDA attention kernels (module docstring)."""

    #: Sliding window in keys (0: off), clamped to ``MAX_WINDOW``.
    window: int = 0
    #: Logits soft cap (0: off).
    cap: float = 0.0

    @classmethod
    def from_spec(cls, spec) -> "CudaVariant":
        return cls(window=min(int(spec.sliding_window), MAX_WINDOW), cap=float(spec.logits_soft_cap))

    @property
    def has_window(self) -> bool:
        """A bool (TVMScript evaluates ``if variant.has_window:`` at parse time)."""
        return self.window > 0

    # --- logits -------------------------------------------------------------------------------------
    def logits(self, score, visible):
        """The score the softmax takes: capped when ``visible``, else ``MASKED`` (the cap comes first, as in
        the reference)."""
        return T.if_then_else(visible, soft_cap(score, self.cap), T.float32(MASKED))

    # --- decode: one query at key position kvlen - 1 --------------------------------------------------
    def decode_span_len(self, kvlen):
        """Keys the decode query sees: ``min(kvlen, W)`` with a window, else ``kvlen``."""
        return T.min(kvlen, self.window) if self.window else kvlen

    def decode_key(self, kvlen, off):
        """Key of offset ``off`` into the decode query's span (the span starts at ``max(kvlen - W, 0)``; no
        other mask is needed then: split ranges stay inside it)."""
        return T.max(kvlen - self.window, 0) + off if self.window else off

    def decode_avg_keys(self, avg_keys):
        """Keys an average entry's decode reads (host-side split count): at most ``W`` with a window."""
        return T.min(avg_keys, self.window) if self.window else avg_keys

    # --- prefill: rows of a query tile ----------------------------------------------------------------
    def key_start(self, kvlen, qlen, qt0, tok):
        """First key of token ``qt0 + tok`` with a window: its position ``kvlen - qlen + qt0 + tok`` + 1 - W."""
        return kvlen - qlen + qt0 + tok + 1 - self.window

    def first_tile(self, kvlen, qlen, qt0, kv_end, tk: int):
        """First key tile of a windowed loop: the one holding the tile's first visible key (capped at kv_end,
        so that the loop never has a negative trip count)."""
        return T.truncdiv(T.min(T.max(self.key_start(kvlen, qlen, qt0, 0), 0), kv_end), tk)

    def row_bound(self, valid, kvlen, qlen, qt0, tok, causal):
        """The per-row register bound ``lim`` of token ``qt0 + tok`` (``valid``: not a padding row): without
        a window the keys it sees (``key < lim``; 0 for padding rows), with one its first key (``NO_ROW``
        for padding rows)."""
        if self.window:
            return T.if_then_else(valid, self.key_start(kvlen, qlen, qt0, tok), NO_ROW)
        return T.if_then_else(valid, T.if_then_else(causal > 0, T.min(kvlen, kvlen - qlen + qt0 + tok + 1), kvlen),
                              0)

    def visible(self, key, lim, kvlen, causal):
        """Whether a row with bound ``lim`` (``row_bound``) sees ``key``: ``key < lim``, or with a window
        ``lim <= key < kvlen`` and, when causal, ``key - lim < W`` (up to the row's own position)."""
        if not self.window:
            return key < lim
        return T.And(T.And(key >= lim, key < kvlen), key - lim < T.if_then_else(causal > 0, self.window, NO_SPAN))


__all__ = ["CudaVariant", "MAX_WINDOW", "soft_cap"]
