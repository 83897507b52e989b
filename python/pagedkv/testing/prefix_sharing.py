"""Prefix sharing against no sharing: the same forwards on two caches holding the same K/V, one whose sequences
fork a common prefix and one whose sequences hold their own copies, both compared with one float64 reference
(``pagedkv.testing.reference``). Used by ``tests/cpu/test_prefix_precision.py`` and its GPU twin.

A shared forward merges several attention passes (one per shared-prefix depth, the own pass, a fresh prefill's
ragged pass); the unshared one runs one pass (or the ragged pass and one paged pass). ``run`` returns the relative
error of each over every compared output, so a test can bound their ratio.
"""

from __future__ import annotations

import dataclasses

import torch

from .reference_mla import reference_for
from .scenarios import assert_close, random_sm_scale, rel_err

#: Tokens of each shared block: whole pages at page sizes 8 and 16 (a fork copies no page).
BLOCK = 16
#: Shared-prefix depths of the compared forwards (the runtime's most: kMaxPrefixPasses).
DEPTH = 4


def config_for(config):
    """``config`` (a ``KVCacheConfig``) without RoPE before the cache (q / k rotated and rounded to fp16 would add
    an error common to both caches) and with room for the unshared copies; neither changes its kernels."""
    return dataclasses.replace(config, rope_mode="none", max_total_seq_len=512, prefill_chunk_size=256)


class SharedPair:
    """The shared cache, the unshared one and the reference, fed the same inputs.

    Parameters
    ----------
    shared, unshared : pagedkv.cache.KVCache
        Two fresh caches of one config (on any device).
    gen : torch.Generator
        Source of the random inputs (CPU).
    """

    def __init__(self, shared, unshared, gen):
        self.shared, self.unshared, self.cfg, self.gen = shared, unshared, shared.config, gen
        self.ref = reference_for(self.cfg)
        self.sm_scale = random_sm_scale(gen, self.cfg.head_dim)
        self.tokens: dict[int, torch.Tensor] = {}  # every input row each sequence got: [L, len, ...]
        self.errors = {"shared": [], "unshared": []}  # (o - ref, ref) per compared layer call, float64 on the CPU

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(getattr(torch, self.cfg.dtype))

    def inputs(self, n: int) -> torch.Tensor:
        """What ``n`` new tokens write, per layer: MHA ``qkv[L, n, Hq + 2 Hkv, D]``, MLA latents ``kv[L, n, DL]``."""
        c = self.cfg
        if c.is_mla:
            return self.randn(c.num_layers, n, c.latent_dim)
        return self.randn(c.num_layers, n, c.num_qo_heads + 2 * c.num_kv_heads, c.head_dim)

    def _attend(self, cache, layer: int, x: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor | None:
        """One layer of ``cache`` (a cache or the reference), inputs ``x[n, ...]``: MHA ``attention_with_fused_qkv``
        -> ``o[n, Hq, D]``; MLA ``append_mla_kv`` then, given queries ``q[n, H, DL]``, ``cross_attention`` ->
        ``o[n, H, kv_lora_rank]`` (its passes are the merged ones; a model's own self / cross merge is the same
        with or without sharing). Outputs float64 on the CPU."""
        dev = getattr(cache, "device", "cpu")
        if not self.cfg.is_mla:
            o = cache.attention_with_fused_qkv(layer, x.to(dev), self.sm_scale)
        else:
            cache.append_mla_kv(layer, x.to(dev))
            o = None if q is None else cache.cross_attention(layer, q.to(dev), self.sm_scale)[0]
        return None if o is None else o.to("cpu", torch.float64)

    def forward(self, caches, batch: dict[int, int], x: torch.Tensor, *, compare: bool) -> None:
        """One forward of ``batch`` with inputs ``x`` (``inputs``) on ``caches`` (names: "shared", "unshared",
        "ref"); with ``compare``, every layer's output of both caches is checked against the reference."""
        ids, lens, c = list(batch), list(batch.values()), self.cfg
        for name in caches:
            getattr(self, name).begin_forward(ids, lens)
        for layer in range(c.num_layers):
            q = self.randn(x.shape[1], c.num_qo_heads, c.latent_dim) if c.is_mla and compare else None
            ref = self._attend(self.ref, layer, x[layer].clone(), q) if "ref" in caches else None
            for name in ("shared", "unshared"):
                if name in caches:
                    o = self._attend(getattr(self, name), layer, x[layer].clone(), q)
                    if compare:
                        assert_close(o, ref, c.dtype, f"{name} forward {batch} layer {layer}")
                        self.errors[name].append((o - ref, ref))
        for name in caches:
            getattr(self, name).end_forward()
        start = 0
        for sid, n in batch.items():  # what each sequence holds, to give an unshared copy the same tokens
            self.tokens[sid] = torch.cat([self.tokens.get(sid, x[:, :0]), x[:, start:start + n]], dim=1)
            start += n

    def copy_of(self, sid: int, parent: int) -> None:
        """``sid`` becomes a fork of ``parent`` in the shared cache and the reference, and a sequence of its own
        holding the same tokens in the unshared cache."""
        self.shared.fork_sequence(parent, sid)
        self.ref.fork_sequence(parent, sid)
        self.unshared.add_sequence(sid)
        x = self.tokens[parent]
        self.forward(("unshared",), {sid: x.shape[1]}, x, compare=False)
        self.tokens[sid] = x

    def errors_of(self) -> tuple[float, float]:
        """(shared, unshared) relative error over every compared output."""
        out = []
        for name in ("shared", "unshared"):
            diff = torch.cat([d.flatten() for d, _ in self.errors[name]])
            ref = torch.cat([r.flatten() for _, r in self.errors[name]])
            out.append(rel_err(ref + diff, ref))
        return out[0], out[1]


def run(shared, unshared, gen) -> tuple[float, float]:
    """The compared forwards on two fresh caches of a ``config_for`` config; returns (shared, unshared) relative
    errors. A chain of forks (sequence d shares d blocks of ``BLOCK`` tokens with d + 1, ``DEPTH`` deep), then
    a decode and a continuation (``DEPTH`` shared-prefix passes and the own pass, against one pass) and a prefill
    with a fresh sequence (its ragged pass too, against the ragged pass and the own pass)."""
    t = SharedPair(shared, unshared, gen)
    every = ("shared", "unshared", "ref")
    for c in (t.shared, t.unshared, t.ref):
        c.add_sequence(0)
    t.forward(every, {0: BLOCK}, t.inputs(BLOCK), compare=False)
    for sid in range(1, DEPTH + 1):
        t.copy_of(sid, sid - 1)
        if sid < DEPTH:
            t.forward(every, {sid: BLOCK}, t.inputs(BLOCK), compare=False)
    batch = list(range(DEPTH + 1))
    t.forward(every, {sid: 1 for sid in batch}, t.inputs(len(batch)), compare=True)
    t.forward(every, {sid: 3 for sid in batch}, t.inputs(3 * len(batch)), compare=True)
    for c in (t.shared, t.unshared, t.ref):
        c.add_sequence(DEPTH + 1)
    t.forward(every, {DEPTH - 1: 6, DEPTH: 5, DEPTH + 1: 2}, t.inputs(13), compare=True)
    return t.errors_of()


__all__ = ["BLOCK", "DEPTH", "SharedPair", "config_for", "run"]
