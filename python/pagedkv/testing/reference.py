"""PyTorch reference of the paged KV cache (float64, no pages, no kernels).

Everything here follows ``docs/ARCHITECTURE.md`` and is written independently of the runtime (``src/``) and
the kernels (``tir_kernels/``): the functional pieces (:func:`rope`, :func:`attention`, :func:`merge_states`)
compute attention the textbook way, and :class:`ReferenceCache` keeps plain per-sequence, per-layer K/V
tensors. Page *accounting* (``num_available_pages``) is mirrored with a tree of blocks that holds token
counts only, because the number of pages in use is part of the documented semantics (shared full pages are
never copied; a mid-page fork copies one partial page).

Conventions
-----------
``n``: new tokens of a batch; ``m``: keys; ``Hq``/``Hkv``: query / kv heads (query head ``h`` reads kv head
``h // (Hq // Hkv)``); ``D``/``Dv``: qk / v head dims. LSE is base 2 and an attention row with no keys has
``o = 0`` and ``lse = EMPTY_LSE``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

# the functional pieces live in reference_ops.py (re-exported here)
from .reference_ops import EMPTY_LSE, ReferenceCacheError, apply_sinks, attention, merge_states, rope, split_qkv
from .reference_rope import rope_variant

__all__ = [
    "EMPTY_LSE",
    "ReferenceCacheError",
    "rope",
    "attention",
    "apply_sinks",
    "merge_states",
    "split_qkv",
    "ReferenceCache",
]


# ---------------------------------------------------------------------------------------------------------
# ReferenceCache
# ---------------------------------------------------------------------------------------------------------
class _Block:
    """A run of tokens starting at offset 0 of its first page (page accounting only)."""

    __slots__ = ("parent", "num_tokens", "children")

    def __init__(self, parent: "_Block | None", num_tokens: int) -> None:
        self.parent = parent
        self.num_tokens = num_tokens
        self.children: list[_Block] = []
        if parent is not None:
            parent.children.append(self)


@dataclass
class _Seq:
    leaf: _Block
    #: per layer K / V, float64 ``[len, Hkv, D]`` (K as the cache stores it: rotated only in "normal" mode)
    k: list[torch.Tensor]
    v: list[torch.Tensor]


@dataclass
class _Forward:
    seq_ids: list[int]
    lengths: list[int]
    prior: list[int]  # sequence lengths before the forward
    done_layers: set[int] = field(default_factory=set)
    windowed: bool = False
    mla: bool = False

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.lengths)

    @property
    def through(self) -> bool:
        """Whether cross_attention covers the new tokens too (decode forwards; a continuation forward, in
        which every sequence already held tokens, of an MHA cache; any forward of a windowed cache), so that
        self_attention covers no key."""
        return self.through_of(self.windowed)

    def through_of(self, windowed: bool) -> bool:
        """``through`` for a layer that is windowed or not (layer groups: each layer has its group's window)."""
        continuation = not self.mla and all(p > 0 for p in self.prior)
        return self.is_decode or windowed or continuation

    @property
    def q_pos(self) -> list[int]:
        return [p + i for p, n in zip(self.prior, self.lengths) for i in range(n)]

    @property
    def q_indptr(self) -> list[int]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out


class ReferenceCache:
    """The documented cache semantics on plain tensors (float64).

    Mirrors :class:`pagedkv.cache.KVCache` call for call; inputs may be of any float dtype (they are used
    at float64), outputs are float64. Every call validates before it changes anything and raises
    :class:`ReferenceCacheError` (a ``ValueError``) on a call the documented semantics reject.

    Parameters
    ----------
    config : pagedkv.KVCacheConfig
        Dims, RoPE settings, page size and capacity. The page pool has
        ``ceil(max_total_seq_len / page_size) + max_batch_size`` pages.
    """

    def __init__(self, config) -> None:
        self.config = config
        self.page_size = int(config.page_size)
        self.num_pages = -(-int(config.max_total_seq_len) // self.page_size) + int(config.max_batch_size)
        self.num_layers = int(config.num_layers)
        self.hq = int(config.num_qo_heads)
        self.hkv = int(config.num_kv_heads)
        self.d = int(config.head_dim)
        self.dv = int(config.v_dim)
        self.cross_dv = self.dv  # output dim of cross_attention (MLA: kv_lora_rank)
        self.rope_mode = config.rope_mode
        #: the attention options, as keyword arguments of :func:`attention`
        self.options = {"sliding_window": int(getattr(config, "sliding_window", 0)),
                        "logits_soft_cap": float(getattr(config, "logits_soft_cap", 0.0)),
                        "sink_size": int(getattr(config, "sink_size", 0))}
        self.seqs: dict[int, _Seq] = {}
        self.fwd: _Forward | None = None

    def _window(self, layer: int) -> int:
        """The sliding window of ``layer``: its layer group's (schema 7), else the config's."""
        of = getattr(self.config, "layer_window", None)
        return int(of(layer)) if of is not None else self.options["sliding_window"]

    def _options(self, layer: int) -> dict:
        """The attention options of ``layer``: the config's, with the layer's window."""
        return {**self.options, "sliding_window": self._window(layer)}

    def _through(self, layer: int) -> bool:
        return self._fwd().through_of(bool(self._window(layer)))

    # -- page accounting ----------------------------------------------------------------------------
    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _blocks(self) -> set[_Block]:
        out: set[_Block] = set()
        for s in self.seqs.values():
            b: _Block | None = s.leaf
            while b is not None and b not in out:
                out.add(b)
                b = b.parent
        return out

    @property
    def num_used_pages(self) -> int:
        return sum(self._pages(b.num_tokens) for b in self._blocks())

    @property
    def num_available_pages(self) -> int:
        """Free pages: pool size minus ``ceil(tokens / page_size)`` of every live block."""
        return self.num_pages - self.num_used_pages

    @staticmethod
    def _chain(leaf: _Block) -> list[_Block]:
        chain = []
        b: _Block | None = leaf
        while b is not None:
            chain.append(b)
            b = b.parent
        return chain[::-1]

    def _release(self, leaf: _Block) -> None:
        """Drop ``leaf`` and every ancestor that loses its last child."""
        b: _Block | None = leaf
        while b is not None and not b.children:
            parent = b.parent
            if parent is not None:
                parent.children.remove(b)
            b.parent = None
            b = parent

    def _branch(self, leaf: _Block, pos: int) -> _Block:
        """A new leaf that shares the first ``pos`` tokens of ``leaf``'s chain (fork semantics)."""
        ps = self.page_size
        aligned = (pos // ps) * ps
        start = 0
        attach: _Block | None = None
        if pos > 0:
            for b in self._chain(leaf):
                end = start + b.num_tokens
                if start < pos <= end:
                    if aligned <= start:
                        attach = b.parent
                    elif aligned == end and b.children:
                        attach = b
                    else:  # split b at the page boundary: its top part becomes a page-aligned parent
                        top = _Block(b.parent, aligned - start)
                        if b.parent is not None:
                            b.parent.children.remove(b)
                        b.parent = top
                        top.children.append(b)
                        b.num_tokens = end - aligned
                        attach = top
                    break
                start = end
        return _Block(attach, pos - aligned)

    # -- sequences --------------------------------------------------------------------------------------
    def _seq(self, seq_id: int) -> _Seq:
        if seq_id not in self.seqs:
            raise ReferenceCacheError(f"unknown sequence id {seq_id}")
        return self.seqs[seq_id]

    def _no_forward(self, what: str) -> None:
        if self.fwd is not None:
            raise ReferenceCacheError(f"{what} inside a forward (begin_forward without end_forward)")

    def _empty_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        z = torch.zeros((0, self.hkv, self.d), dtype=torch.float64)
        zv = torch.zeros((0, self.hkv, self.dv), dtype=torch.float64)
        return [z.clone() for _ in range(self.num_layers)], [zv.clone() for _ in range(self.num_layers)]

    def add_sequence(self, seq_id: int) -> None:
        """Add an empty sequence ``seq_id``."""
        self._no_forward("add_sequence")
        if seq_id in self.seqs:
            raise ReferenceCacheError(f"sequence id {seq_id} already exists")
        self.seqs[seq_id] = _Seq(_Block(None, 0), *self._empty_kv())

    def remove_sequence(self, seq_id: int) -> None:
        """Remove ``seq_id``, freeing pages no other sequence uses."""
        self._no_forward("remove_sequence")
        s = self._seq(seq_id)
        del self.seqs[seq_id]
        self._release(s.leaf)

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> None:
        """New sequence ``child_id`` = the first ``fork_pos`` tokens of ``parent_id`` (-1: all of them)."""
        self._no_forward("fork_sequence")
        parent = self._seq(parent_id)
        if child_id in self.seqs:
            raise ReferenceCacheError(f"sequence id {child_id} already exists")
        length = self.get_sequence_length(parent_id)
        pos = length if fork_pos == -1 else fork_pos
        if not 0 <= pos <= length:
            raise ReferenceCacheError(f"fork_pos {fork_pos} out of range for sequence {parent_id} of length {length}")
        if pos % self.page_size and self.num_available_pages < 1:
            raise ReferenceCacheError(f"out of pages: forking {parent_id} at {pos} needs a page")
        leaf = self._branch(parent.leaf, pos)
        self.seqs[child_id] = _Seq(leaf, [k[:pos].clone() for k in parent.k], [v[:pos].clone() for v in parent.v])

    def popn(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of ``seq_id``."""
        self._no_forward("popn")
        s = self._seq(seq_id)
        length = self.get_sequence_length(seq_id)
        if not 0 <= n <= length:
            raise ReferenceCacheError(f"cannot pop {n} tokens from sequence {seq_id} of length {length}")
        if n <= s.leaf.num_tokens:
            s.leaf.num_tokens -= n
        else:
            new_len = length - n
            if new_len % self.page_size and self.num_available_pages < 1:
                raise ReferenceCacheError(f"out of pages: popn of {seq_id} into a shared page needs a page")
            old = s.leaf
            s.leaf = self._branch(old, new_len)
            self._release(old)
        s.k = [k[:length - n].clone() for k in s.k]
        s.v = [v[:length - n].clone() for v in s.v]

    def clear(self) -> None:
        """Remove every sequence (allowed inside a forward, which it abandons)."""
        self.fwd = None
        self.seqs.clear()

    def get_sequence_length(self, seq_id: int) -> int:
        return sum(b.num_tokens for b in self._chain(self._seq(seq_id).leaf))

    @property
    def total_sequence_length(self) -> int:
        return sum(self.get_sequence_length(s) for s in self.seqs)

    # -- forward ----------------------------------------------------------------------------------------
    def begin_forward(self, seq_ids: Sequence[int], append_lengths: Sequence[int]) -> None:
        """Start a forward appending ``append_lengths[i]`` tokens to ``seq_ids[i]``."""
        if self.fwd is not None:
            raise ReferenceCacheError("begin_forward called twice without end_forward")
        seq_ids, lengths = [int(s) for s in seq_ids], [int(n) for n in append_lengths]
        if len(seq_ids) != len(lengths):
            raise ReferenceCacheError(f"{len(seq_ids)} sequence ids but {len(lengths)} append lengths")
        if not seq_ids:
            raise ReferenceCacheError("empty batch")
        if len(seq_ids) > self.config.max_batch_size:
            raise ReferenceCacheError(f"batch of {len(seq_ids)} > max_batch_size {self.config.max_batch_size}")
        self._check_appends(seq_ids, lengths, "batch ")
        if sum(lengths) > self.config.prefill_chunk_size:
            raise ReferenceCacheError(f"{sum(lengths)} tokens > prefill_chunk_size {self.config.prefill_chunk_size}")
        self._check_pages(seq_ids, lengths)
        prior = [self.get_sequence_length(s) for s in seq_ids]
        for s, n in zip(seq_ids, lengths):
            self.seqs[s].leaf.num_tokens += n
        self.fwd = _Forward(seq_ids, lengths, prior, windowed=bool(self.options["sliding_window"]),
                            mla=bool(self.config.is_mla))

    def _check_pages(self, seq_ids: list[int], lengths: list[int]) -> None:
        need = sum(self._pages(self.seqs[s].leaf.num_tokens + n) - self._pages(self.seqs[s].leaf.num_tokens)
                   for s, n in zip(seq_ids, lengths))
        if need > self.num_available_pages:
            raise ReferenceCacheError(f"out of pages: need {need}, {self.num_available_pages} available")

    def check_append(self, seq_ids: Sequence[int], append_lengths: Sequence[int]) -> None:
        """Raise what ``begin_forward`` would for these appends, without its batch and chunk limits and
        without changing anything."""
        seq_ids, lengths = [int(s) for s in seq_ids], [int(n) for n in append_lengths]
        if len(seq_ids) != len(lengths):
            raise ReferenceCacheError(f"{len(seq_ids)} sequence ids but {len(lengths)} append lengths")
        self._check_appends(seq_ids, lengths, "")
        self._check_pages(seq_ids, lengths)

    def _check_appends(self, seq_ids: list[int], lengths: list[int], where: str) -> None:
        """The checks ``begin_forward`` and ``check_append`` share: no repeated id, known sequences, lengths >= 1."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ReferenceCacheError(f"repeated sequence id in {where}{seq_ids}")
        for sid, n in zip(seq_ids, lengths):
            self._seq(sid)
            if n < 1:
                raise ReferenceCacheError(f"append length {n} of sequence {sid} < 1")

    def end_forward(self) -> None:
        """Close the forward; one in which a layer got no k/v is rolled back (``abort_forward``) and rejected:
        the skipped layer's slots would hold no k/v for the new tokens."""
        if self.fwd is None:
            raise ReferenceCacheError("end_forward without begin_forward")
        missing = set(range(self.num_layers)) - self.fwd.done_layers
        if missing:
            self.abort_forward()
            raise ReferenceCacheError(f"layers {sorted(missing)} got no k/v in this forward; it was rolled back")
        self.fwd = None

    def abort_forward(self) -> None:
        """Abandon the open forward, taking its tokens back (nothing without one)."""
        fwd, self.fwd = self.fwd, None
        if fwd is None:
            return
        for sid, n, prior in zip(fwd.seq_ids, fwd.lengths, fwd.prior):
            seq = self.seqs[sid]
            seq.leaf.num_tokens -= n
            seq.k = [k[:prior] for k in seq.k]
            seq.v = [v[:prior] for v in seq.v]

    def get_query_positions(self) -> torch.Tensor:
        """``[n]`` int32: position of each new token (sequence length before the forward + index)."""
        return torch.tensor(self._fwd().q_pos, dtype=torch.int32)

    def _fwd(self) -> _Forward:
        if self.fwd is None:
            raise ReferenceCacheError("no forward in progress (call begin_forward first)")
        return self.fwd

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ReferenceCacheError(f"layer {layer} out of range [0, {self.num_layers})")

    @staticmethod
    def _check_scale(sm_scale: float) -> None:
        if not math.isfinite(sm_scale) or sm_scale <= 0:
            raise ReferenceCacheError(f"sm_scale must be a finite number > 0, got {sm_scale}")

    def _sinks(self, sinks) -> dict:
        """``attention``'s keyword for ``sinks`` (none: ``{}``); only an ``attention_sinks`` cache takes them."""
        if sinks is None:
            return {}
        if not getattr(self.config, "attention_sinks", False):
            raise ReferenceCacheError("sinks given, but the config has attention_sinks=False")
        if tuple(sinks.shape) != (self.hq,):
            raise ReferenceCacheError(f"sinks must be [{self.hq}], got {list(sinks.shape)}")
        return {"sinks": sinks.to(torch.float64)}

    def _maybe_rope(self, x: torch.Tensor, positions) -> torch.Tensor:
        spec = getattr(self.config, "rope", None)
        if spec is None or spec.is_default:
            return rope(x, positions, self.config.rope_theta, self.config.rope_scale)
        return rope_variant(x, positions, self.config.rope_theta, self.config.rope_scale, spec,
                            long=self._rope_long(spec))

    def _rope_long(self, spec) -> bool:
        """LongRoPE's set of the current forward: the long factors when its longest sequence (largest query
        position + 1) exceeds ``original_max_position_embeddings`` (transformers: per call, from
        ``max(position_ids) + 1``)."""
        pos = self._fwd().q_pos
        return spec.rope_type == "longrope" and bool(pos) and max(pos) + 1 > spec.original_max_position_embeddings

    def split_rotary(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split ``qkv[n, Hq + 2 Hkv, D]`` of the current forward; q and k rotated in "normal" mode.

        Returns float64 ``q[n, Hq, D]``, ``k[n, Hkv, D]``, ``v[n, Hkv, D]`` as the cache sees them after its
        ``split_rotary`` op (what a model passes to :meth:`self_attention`).
        """
        fwd = self._fwd()
        q, k, v = (t.to(torch.float64) for t in split_qkv(qkv, self.hq, self.hkv))
        if q.shape[0] != fwd.q_indptr[-1]:
            raise ReferenceCacheError(f"qkv has {q.shape[0]} tokens, the forward appends {fwd.q_indptr[-1]}")
        if self.rope_mode == "normal":
            q = self._maybe_rope(q, fwd.q_pos)
            k = self._maybe_rope(k, fwd.q_pos)
        return q, k, v

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        fwd = self._fwd()
        ptr = fwd.q_indptr
        for b, sid in enumerate(fwd.seq_ids):
            s = self.seqs[sid]
            s.k[layer] = torch.cat([s.k[layer][:fwd.prior[b]], k[ptr[b]:ptr[b + 1]].to(torch.float64)])
            s.v[layer] = torch.cat([s.v[layer][:fwd.prior[b]], v[ptr[b]:ptr[b + 1]].to(torch.float64)])
        fwd.done_layers.add(layer)

    def _keys(self, layer: int, b: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[0, end)`` of batch entry ``b`` (rotated at their positions in "inline" mode)."""
        s = self.seqs[self._fwd().seq_ids[b]]
        k, v = s.k[layer][:end], s.v[layer][:end]
        if self.rope_mode == "inline":
            k = self._maybe_rope(k, range(end))
        return k, v

    def attention_with_fused_qkv(self, layer: int, qkv: torch.Tensor, sm_scale: float, *,
                                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Split, rotate, append and attend: ``qkv[n, Hq + 2 Hkv, D]`` -> ``o[n, Hq, Dv]`` (float64).

        Each new query attends causally to every token of its sequence up to itself (and to its head's sink,
        ``sinks[Hq]``, when given: ``attention``).
        """
        fwd = self._fwd()
        self._check_layer(layer)
        self._check_scale(sm_scale)
        extra = {**self._options(layer), **self._sinks(sinks)}
        q, k, v = self.split_rotary(qkv)
        self._append(layer, k, v)
        ptr = fwd.q_indptr
        out = torch.empty((q.shape[0], self.hq, self.dv), dtype=torch.float64)
        for b in range(len(fwd.seq_ids)):
            qb = q[ptr[b]:ptr[b + 1]]
            if self.rope_mode == "inline":
                qb = self._maybe_rope(qb, fwd.q_pos[ptr[b]:ptr[b + 1]])
            kb, vb = self._keys(layer, b, fwd.prior[b] + fwd.lengths[b])
            out[ptr[b]:ptr[b + 1]] = attention(qb, kb, vb, sm_scale, causal=True, **extra)[0]
        return out

    def self_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged causal attention of each sequence's new queries over its new keys (no cache read).

        ``q[n, Hq, D]``, ``k[n, Hkv, D]``, ``v[n, Hkv, Dv]`` -> ``o[n, Hq, Dv]``, ``lse[n, Hq]`` (float64).
        In "inline" mode q and k are rotated at the new tokens' positions first. In a decode forward the
        new tokens belong to ``cross_attention``'s view, so this covers no key: o = 0, lse = EMPTY_LSE; the same
        in an MHA cache's continuation forward (every sequence already held tokens) and in every forward of a
        sliding-window cache.
        """
        fwd = self._fwd()
        self._check_layer(layer)
        self._check_scale(sm_scale)
        ptr = fwd.q_indptr
        if q.shape[0] != ptr[-1] or k.shape[0] != ptr[-1] or v.shape[0] != ptr[-1]:
            raise ReferenceCacheError(f"q/k/v must have {ptr[-1]} tokens")
        o = torch.empty((q.shape[0], self.hq, v.shape[2]), dtype=torch.float64)
        lse = torch.empty((q.shape[0], self.hq), dtype=torch.float64)
        if self._through(layer):
            return o.zero_(), lse.fill_(EMPTY_LSE)
        for b in range(len(fwd.seq_ids)):
            sl = slice(ptr[b], ptr[b + 1])
            qb, kb = q[sl], k[sl]
            if self.rope_mode == "inline":
                qb = self._maybe_rope(qb, fwd.q_pos[sl])
                kb = self._maybe_rope(kb, fwd.q_pos[sl])
            o[sl], lse[sl] = attention(qb, kb, v[sl], sm_scale, causal=True, **self._options(layer))
        return o, lse

    def cross_attention(self, layer: int, q: torch.Tensor, sm_scale: float, *,
                        sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the new queries over the cached k/v.

        The cache view is, per sequence, every token including the new ones in a decode batch (every append
        length 1), in an MHA cache's continuation forward (every sequence already held tokens) and in every
        forward of a sliding-window cache (the layer's k/v must have been appended already; causal), and the
        tokens cached before the forward otherwise (no mask needed). ``q[n, Hq, D]`` -> ``o[n, Hq, Dv]``, ``lse[n, Hq]`` (float64).
        ``sinks[Hq]``: the heads' attention sinks join the softmax (``attention``).
        """
        fwd = self._fwd()
        self._check_layer(layer)
        self._check_scale(sm_scale)
        extra = {**self._options(layer), **self._sinks(sinks)}
        through = self._through(layer)
        ptr = fwd.q_indptr
        if q.shape[0] != ptr[-1]:
            raise ReferenceCacheError(f"q must have {ptr[-1]} tokens")
        if through and layer not in fwd.done_layers:
            raise ReferenceCacheError(f"cross_attention of layer {layer} over the new tokens before their k/v "
                                      "were appended")
        o = torch.empty((q.shape[0], self.hq, self.cross_dv), dtype=torch.float64)
        lse = torch.empty((q.shape[0], self.hq), dtype=torch.float64)
        for b in range(len(fwd.seq_ids)):
            sl = slice(ptr[b], ptr[b + 1])
            qb = q[sl]
            if self.rope_mode == "inline":
                qb = self._maybe_rope(qb, fwd.q_pos[sl])
            end = fwd.prior[b] + (fwd.lengths[b] if through else 0)
            kb, vb = self._keys(layer, b, end)
            o[sl], lse[sl] = attention(qb, kb, vb, sm_scale, causal=through, **extra)
        return o, lse

    @staticmethod
    def merge_attn_output_inplace(o_a, lse_a, o_b, lse_b):
        """``merge_states``; returns the merged ``(o, lse)`` (float64; nothing is modified)."""
        return merge_states(o_a, lse_a, o_b, lse_b)

    # -- debugging --------------------------------------------------------------------------------------
    def debug_get_kv(self, seq_id: int, start: int = 0, end: int | None = None):
        """K and V of tokens ``[start, end)``: two float64 ``[L, end - start, Hkv, D]`` tensors.

        K is as stored: rotated in "normal" mode, unrotated otherwise.
        """
        s = self._seq(seq_id)
        length = self.get_sequence_length(seq_id)
        end = length if end is None else end
        if not 0 <= start <= end <= length:
            raise ReferenceCacheError(f"range [{start}, {end}) out of sequence {seq_id} of length {length}")
        return (torch.stack([k[start:end] for k in s.k]), torch.stack([v[start:end] for v in s.v]))

    def debug_set_kv(self, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite tokens ``[start, start + m)`` of every layer with ``k, v[L, m, Hkv, D]``.

        Tokens on pages shared with other sequences change for them too.
        """
        self._no_forward("debug_set_kv")
        self._seq(seq_id)  # raises for an unknown id
        m = k.shape[1]
        length = self.get_sequence_length(seq_id)
        if not (0 <= start and start + m <= length):
            raise ReferenceCacheError(f"range [{start}, {start + m}) out of sequence {seq_id} of length {length}")
        # tokens on full pages shared with another sequence are the same memory: write through to every
        # sequence sharing them.
        sharers = self._sharing(seq_id)
        for other, shared_len in sharers.items():
            lo, hi = start, min(start + m, shared_len)
            if lo >= hi:
                continue
            o = self.seqs[other]
            for layer in range(self.num_layers):
                o.k[layer][lo:hi] = k[layer, lo - start:hi - start].to(torch.float64)
                o.v[layer][lo:hi] = v[layer, lo - start:hi - start].to(torch.float64)

    def _sharing(self, seq_id: int) -> dict[int, int]:
        """``{other seq: number of leading tokens stored in the same pages as seq_id's}`` (incl. itself)."""
        mine = self._chain(self.seqs[seq_id].leaf)
        out = {}
        for other, s in self.seqs.items():
            theirs = self._chain(s.leaf)
            shared = 0
            for a, b in zip(mine, theirs):
                if a is not b:
                    break
                shared += a.num_tokens
            out[other] = shared if other != seq_id else self.get_sequence_length(seq_id)
        return out
