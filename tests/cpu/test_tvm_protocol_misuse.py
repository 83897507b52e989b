"""Misuse of a pagedkv cache through TVM's KV-state protocol: test_misuse_property.py's hypothesis state machine
(valid steps against the reference, misuse outside and inside forwards, a rejected call changes nothing) with every
call that has a protocol counterpart made through ``vm.builtin.*`` (``pagedkv.testing.tvm_protocol.protocol_view``),
plus the protocol's own misuse: token trees that are not chains or do not fit, commits without a tree, sliding
windows, the refused features (checkpoints, disaggregation, shared-KV attention) and None where a tensor is due
(TVM's wrappers pass it through). Shares test_misuse_property.py's config and kernels.
"""

from __future__ import annotations

import math
import random

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
import tvm_ffi  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import initialize, rule  # noqa: E402
from test_misuse_property import _SETTINGS, TYPED, UNKNOWN, CacheMisuse  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.testing.scenarios import ScenarioRunner, random_step  # noqa: E402
from pagedkv.testing.tvm_protocol import Builtins, protocol_view, refused_calls, shape  # noqa: E402


class ProtocolMisuse(CacheMisuse):
    """test_misuse_property.py's machine (valid steps against the reference, misuse outside and inside forwards,
    nothing changed by a rejected call), every call with a protocol counterpart made through ``vm.builtin.*``
    (``protocol_view``), plus the protocol's own misuse: token trees, commits, sliding windows, refused features
    and None where a tensor is due."""

    @initialize(seed=st.integers(0, 2**31 - 1))
    def setup(self, seed):
        self.rng = random.Random(seed)
        cache = protocol_view(pagedkv.create(self.config, backend="tir", target="llvm", poison=True))
        self.r = ScenarioRunner(cache, torch.Generator().manual_seed(seed), 0.9 / math.sqrt(self.config.head_dim))
        self.f = Builtins.load()
        self.log = []

    @rule(data=st.data())
    def protocol_misuse(self, data):
        seqs = sorted(self.ref.seqs)
        seq = data.draw(st.sampled_from(seqs)) if seqs else UNKNOWN
        f, h = self.f, self.cache.handle
        tensor = tvm_ffi.from_dlpack(torch.zeros(1))
        calls = refused_calls(f, h, seq, tensor)
        calls = {kind: calls[kind] for kind in sorted(calls)}
        calls.update({
            "tree of the wrong size": lambda: f.begin_forward(h, shape([seq]), shape([2]), shape([-1])),
            "tree with a forward parent": lambda: f.begin_forward(h, shape([seq]), shape([2]), shape([1, 0])),
            "commit without a tree": lambda: f.commit_accepted_token_tree_nodes(h, shape([seq]), shape([0])),
            "commit of mismatched lists": lambda: f.commit_accepted_token_tree_nodes(h, shape([seq]), shape([])),
            "None qkv outside a forward": lambda: f.attention_with_fused_qkv(h, 0, 0.1, None, None),
        })
        kind = data.draw(st.sampled_from(sorted(calls)))
        self._rejects(f"protocol: {kind} on {seq}", calls[kind])

    @rule(data=st.data())
    def protocol_misuse_in_forward(self, data):
        """Inside an open forward: None or refused arguments reach the cache's own checks; then it is aborted."""
        step = random_step(self.ref, self.rng, max_seqs=4)
        if step.kind != "forward":
            return
        seqs, lens = [s for s, _ in step.args], [n for _, n in step.args]
        f, h, cfg = self.f, self.cache.handle, self.config
        n = sum(lens)
        o = torch.zeros((n, cfg.num_qo_heads, cfg.head_dim))
        lse = torch.zeros((n, cfg.num_qo_heads))
        t = tvm_ffi.from_dlpack
        self.ref.begin_forward(seqs, lens)
        self.cache.begin_forward(seqs, lens)
        bad = {"None qkv": lambda: f.attention_with_fused_qkv(h, 0, 0.1, None, t(o)),
               "None o": lambda: f.attention_with_fused_qkv(h, 0, 0.1, t(torch.zeros((n, 8, 64))), None),
               "None q of self_attention": lambda: f.self_attention(h, 0, 0.1, None, None, None, t(o), t(lse)),
               "None lse of cross_attention": lambda: f.cross_attention(h, 0, 0.1, t(o), t(o), None),
               "None in a merge": lambda: f.merge_attn_output_inplace(h, None, t(lse), t(o), t(lse)),
               "shared-KV attention": lambda: f.attention_with_shared_kv(h, 0, 0.1, *[t(o)] * 4),
               "MLA append on an MHA cache": lambda: f.append_mla_kv(h, 0, t(o)),
               "commit inside a forward": lambda: f.commit_accepted_token_tree_nodes(h, shape([seqs[0]]),
                                                                                  shape([0]))}
        for kind in data.draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3)):
            self.log.append(f"protocol, in forward {step}: {kind}")
            with pytest.raises(TYPED):
                bad[kind]()
        self.cache.abort_forward()
        self.ref.abort_forward()


def test_protocol_misuse_sequences():
    hypothesis.stateful.run_state_machine_as_test(ProtocolMisuse, settings=_SETTINGS)
