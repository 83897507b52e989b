"""A property-based misuse battery: random sequences of valid and invalid calls on a cache.

Hypothesis drives a state machine over the cache API and :class:`pagedkv.testing.reference.ReferenceCache`
side by side. Valid steps (add, fork, remove, popn, decode / prefill forwards, drawn by
``scenarios.random_step``) run on both and are compared as in every scenario test. Invalid calls (unknown or
repeated ids, out-of-range fork positions and popn lengths, bad forward batches, and inside an open forward:
wrong layer, shapes, dtypes, scales, calls out of order) run on the cache alone and must raise a typed error
(``ValueError``, ``RuntimeError``, ``TypeError``, ``IndexError``, ``KeyError``) and leave the cache as it
was: the invariant after every step compares lengths, page accounting and every sequence's K/V with the
reference. A crash (a segfault) fails the run; the shrunk call sequence is printed.

The hand-written cases with the messages they must name are ``test_errors.py``; this file looks for the
sequences nobody wrote down. It shares ``test_errors.py``'s float32 config (kernels compiled once) and adds an
fp16 cache with prefix sharing (the partial-state path) on the same small shapes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv import KVCacheConfig  # noqa: E402
from pagedkv.testing.scenarios import ScenarioRunner, assert_close, check_state, random_step  # noqa: E402

#: test_errors.py's config (the same kernels), and its fp16 twin.
CFG32 = KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64, dtype="float32",
                      rope_mode="normal", page_size=8, max_batch_size=2, max_total_seq_len=32,
                      prefill_chunk_size=24)
TYPED = (ValueError, RuntimeError, TypeError, IndexError, KeyError)
UNKNOWN = 10**6


def _snapshot(cache, seqs):
    out = {"pages": cache.num_available_pages, "total": cache.total_sequence_length}
    for s in seqs:
        k, v = cache.debug_get_kv(s)
        out[s] = (cache.get_sequence_length(s), k.clone(), v.clone())
    return out


def _same(a, b) -> bool:
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, tuple):
            if x[0] != y[0] or not (torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])):
                return False
        elif x != y:
            return False
    return True


class CacheMisuse(RuleBasedStateMachine):
    config = CFG32

    @initialize(seed=st.integers(0, 2**31 - 1))
    def setup(self, seed):
        self.rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        cache = pagedkv.create(self.config, backend="tir", target="llvm", poison=True)
        self.r = ScenarioRunner(cache, gen, 0.9 / math.sqrt(self.config.head_dim))
        self.log: list[str] = []

    @property
    def cache(self):
        return self.r.cache

    @property
    def ref(self):
        return self.r.ref

    def _rejects(self, what: str, call) -> None:
        """``call()`` raises a typed error and changes nothing."""
        seqs = sorted(self.ref.seqs)
        before = _snapshot(self.cache, seqs)
        self.log.append(what)
        try:
            call()
        except TYPED:
            pass
        else:
            raise AssertionError(f"accepted: {what}")
        assert _same(before, _snapshot(self.cache, seqs)), f"state changed by the rejected call: {what}"

    # -- valid steps --------------------------------------------------------------------------------
    @rule()
    def valid_step(self):
        step = random_step(self.ref, self.rng, max_seqs=4)
        self.log.append(str(step))
        self.r.run([step], "valid")

    # -- misuse outside a forward -------------------------------------------------------------------
    @rule(kind=st.sampled_from(["remove", "popn_unknown", "fork_unknown", "get_len", "begin_unknown",
                                "debug_get_kv"]))
    def unknown_id(self, kind):
        c = self.cache
        calls = {"remove": lambda: c.remove_sequence(UNKNOWN), "popn_unknown": lambda: c.popn(UNKNOWN, 1),
                 "fork_unknown": lambda: c.fork_sequence(UNKNOWN, UNKNOWN + 1, -1),
                 "get_len": lambda: c.get_sequence_length(UNKNOWN),
                 "begin_unknown": lambda: c.begin_forward([UNKNOWN], [1]),
                 "debug_get_kv": lambda: c.debug_get_kv(UNKNOWN, 0, 0)}
        self._rejects(f"{kind} of unknown id", calls[kind])

    @rule(data=st.data())
    def bad_sequence_op(self, data):
        seqs = sorted(self.ref.seqs)
        if not seqs:
            return
        c = self.cache
        seq = data.draw(st.sampled_from(seqs))
        length = self.ref.get_sequence_length(seq)
        other = data.draw(st.sampled_from(seqs))
        kind = data.draw(st.sampled_from(["add_existing", "fork_to_existing", "fork_past_end", "fork_negative",
                                          "popn_too_many", "popn_negative", "debug_range"]))
        calls = {"add_existing": lambda: c.add_sequence(seq),
                 "fork_to_existing": lambda: c.fork_sequence(seq, other, -1),
                 "fork_past_end": lambda: c.fork_sequence(seq, UNKNOWN, length + 1),
                 "fork_negative": lambda: c.fork_sequence(seq, UNKNOWN, -2 - data.draw(st.integers(0, 5))),
                 "popn_too_many": lambda: c.popn(seq, length + 1 + data.draw(st.integers(0, 9))),
                 "popn_negative": lambda: c.popn(seq, -1 - data.draw(st.integers(0, 9))),
                 "debug_range": lambda: c.debug_get_kv(seq, length, length + 1 + data.draw(st.integers(0, 3)))}
        self._rejects(f"{kind} on {seq} (length {length})", calls[kind])

    @rule(data=st.data())
    def bad_batch(self, data):
        seqs = sorted(self.ref.seqs)
        if not seqs:
            return
        c, cfg = self.cache, self.config
        seq = data.draw(st.sampled_from(seqs))
        kind = data.draw(st.sampled_from(["repeated", "zero_len", "negative_len", "mismatched", "over_chunk",
                                          "over_batch", "empty", "over_capacity"]))
        batches = {"repeated": ([seq, seq], [1, 1]), "zero_len": ([seq], [0]), "negative_len": ([seq], [-3]),
                   "mismatched": ([seq], [1, 1]), "over_chunk": ([seq], [cfg.prefill_chunk_size + 1]),
                   "over_batch": (list(range(cfg.max_batch_size + 1)), [1] * (cfg.max_batch_size + 1)),
                   "empty": ([], []), "over_capacity": ([seq], [cfg.max_total_seq_len * 4])}
        ids, lens = batches[kind]
        self._rejects(f"begin_forward {kind} {ids} {lens}", lambda: c.begin_forward(ids, lens))
        if kind == "over_capacity":
            self._rejects(f"check_append {ids} {lens}", lambda: c.check_append(ids, lens))

    # -- misuse inside a forward --------------------------------------------------------------------
    @rule(data=st.data())
    def misuse_in_forward(self, data):
        """Open a valid forward, make bad calls inside it, then finish it (compared with the reference), skip a
        layer (end_forward rejects and rolls back), abort it or clear the cache."""
        step = random_step(self.ref, self.rng, max_seqs=4)
        if step.kind != "forward":
            return
        seqs = [s for s, _ in step.args]
        lens = [n for _, n in step.args]
        c, cfg = self.cache, self.config
        self.ref.begin_forward(seqs, lens)
        c.begin_forward(seqs, lens)
        n = sum(lens)
        width = cfg.num_qo_heads + 2 * cfg.num_kv_heads
        good = self.r.randn(n, width, cfg.head_dim)
        bad = {"layer_high": lambda: c.attention_with_fused_qkv(cfg.num_layers, good, 0.1),
               "layer_negative": lambda: c.attention_with_fused_qkv(-1, good, 0.1),
               "rows": lambda: c.attention_with_fused_qkv(0, self.r.randn(n + 1, width, cfg.head_dim), 0.1),
               "width": lambda: c.attention_with_fused_qkv(0, self.r.randn(n, width - 1, cfg.head_dim), 0.1),
               "dim": lambda: c.attention_with_fused_qkv(0, self.r.randn(n, width, cfg.head_dim + 1), 0.1),
               "dtype": lambda: c.attention_with_fused_qkv(0, good.to(torch.float64), 0.1),
               "scale_nan": lambda: c.attention_with_fused_qkv(0, good, math.nan),
               "scale_inf": lambda: c.attention_with_fused_qkv(0, good, math.inf),
               "scale_zero": lambda: c.attention_with_fused_qkv(0, good, 0.0),
               "begin_again": lambda: c.begin_forward(seqs, lens),
               "add_in_forward": lambda: c.add_sequence(UNKNOWN),
               "remove_in_forward": lambda: c.remove_sequence(seqs[0]),
               "popn_in_forward": lambda: c.popn(seqs[0], 1),
               "fork_in_forward": lambda: c.fork_sequence(seqs[0], UNKNOWN, -1)}
        kinds = data.draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3))
        for kind in kinds:
            self.log.append(f"in forward {step}: {kind}")
            try:
                bad[kind]()
            except TYPED:
                continue
            raise AssertionError(f"accepted in a forward: {kind}")
        end = data.draw(st.sampled_from(["finish", "abort", "skip_layer", "clear"]))
        self.log.append(f"forward {step}: {end}")
        if end in ("abort", "clear"):  # clear() abandons an open forward (documented)
            getattr(c, f"{end}_forward" if end == "abort" else end)()
            getattr(self.ref, f"{end}_forward" if end == "abort" else end)()
            return
        self._finish(end == "skip_layer", n, width)

    def _finish(self, skip_layer: bool, n: int, width: int) -> None:
        cfg = self.config
        layers = range(cfg.num_layers - 1 if skip_layer else cfg.num_layers)
        for layer in layers:
            qkv = self.r.randn(n, width, cfg.head_dim)
            o = self.cache.attention_with_fused_qkv(layer, qkv, self.r.sm_scale)
            ref_o = self.ref.attention_with_fused_qkv(layer, qkv.cpu(), self.r.sm_scale)
            assert_close(o, ref_o, cfg.dtype, f"forward after misuse, layer {layer}")
        if skip_layer:
            with pytest.raises(RuntimeError, match="layer"):
                self.cache.end_forward()  # rolled back
            self.ref.abort_forward()
            return
        self.cache.end_forward()
        self.ref.end_forward()

    @invariant()
    def matches_reference(self):
        if hasattr(self, "r"):
            check_state(self.cache, self.ref, "after: " + " | ".join(self.log[-4:]))


class CacheMisuseFp16(CacheMisuse):
    config = dataclasses.replace(CFG32, dtype="float16")


#: PAGEDKV_MISUSE_EXAMPLES: a longer search (the suite runs 12 of 12 steps each).
_SETTINGS = settings(max_examples=int(os.environ.get("PAGEDKV_MISUSE_EXAMPLES", "12")), stateful_step_count=12, deadline=None, derandomize=False,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("machine", [CacheMisuse, CacheMisuseFp16], ids=["float32", "float16"])
def test_misuse_sequences(machine):
    hypothesis.stateful.run_state_machine_as_test(machine, settings=_SETTINGS)
