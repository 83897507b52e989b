"""Learnable attention sinks in the runtime's orchestration (``src/attention.cc``), on the numpy kernels of
``test_runtime_numpy`` (no compile): each query counts its head's sink exactly once whatever the forward's passes
(one pass; prefix-shared passes merged in float32 or in the storage dtype; a split prefill's ragged pass), through
``attention_with_fused_qkv_sinks`` and ``cross_attention_sinks``; a kernel that drops or doubles the sink fails the
check; the errors name what is wrong and change nothing.

Sinks of +-8 (and +-3): a dropped or doubled sink moves ``o`` by a factor between ``1 + e^-8`` and ``e^8`` of the
rows' softmax mass, far outside the tolerances.
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
from _numpy_runtime import Harness, N, NumpyKernels, T, _fork_tree, attend, config, create, g

#: One sink per query head of the harness config (4 query heads).
SINKS = np.array([8.0, -8.0, 3.0, -3.0], np.float32)


def sink_harness(**kw) -> Harness:
    return Harness(**{"schema_version": 5, "attention_sinks": True, **kw})


def sink_ops(h) -> list:
    return [c for c in h.k.calls if c[0] in ("apply_sinks", "merge_state_partial_sinks")]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_each_attention_merges_its_sinks_once(dtype):
    """The fork tree of ``test_runtime_numpy`` (a prefill from empty, prefix-shared decodes and prefills, a fork
    inside the root's first page) with sinks on every layer: every output equals the reference with the sink, and
    every attention call ran exactly one sink op: ``apply_sinks`` on the output after a storage-dtype forward,
    ``merge_state_partial_sinks`` as the last float32 merge of an fp16 multi-pass forward."""
    h = sink_harness(seed=1, dtype=dtype)
    h.forward = functools.partial(h.forward, sinks=SINKS)
    h.k.calls.clear()
    _fork_tree(h)
    attention_calls = 5 * h.L
    ops = sink_ops(h)
    assert len(ops) == attention_calls, ops
    if dtype == "float32":
        assert set(ops) == {("apply_sinks", "float32")}
    else:
        assert ("merge_state_partial_sinks", ("float32", "float32", "float16")) in ops
        assert set(ops) <= {("apply_sinks", "float16"), ("merge_state_partial_sinks", ("float32", "float32", "float16"))}


def _faulty(h, op: str, fault: str):
    """``op`` of ``h``'s kernels with its sink dropped (the plain merge, or nothing) or merged twice."""

    def run(*args):
        sinks = args[2] if op == "apply_sinks" else args[4]
        if fault == "drop":
            if op == "merge_state_partial_sinks":
                NumpyKernels.merge_state_partial(h.k, *args[:4], args[5])
            return
        getattr(NumpyKernels, op)(h.k, *args)
        NumpyKernels._merge_sinks(args[0], args[1], sinks)
        if op == "merge_state_partial_sinks":
            N(args[5])[...] = N(args[0])

    return run


@pytest.mark.parametrize("structure", ["one_pass", "prefix_shared"])
@pytest.mark.parametrize("fault", ["drop", "double"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_dropped_or_doubled_sink_fails_the_check(dtype, fault, structure):
    """The check above is sharp: with the sink ops dropping or doubling the sink, a one-pass decode and a
    prefix-shared decode (float32: merge_state then apply_sinks; fp16: merge_state_partial_sinks) fail it."""
    h = sink_harness(seed=2, dtype=dtype)
    h.add(0)
    h.forward({0: 9}, sinks=SINKS)
    h.fork(0, 1, 8)
    h.fork(0, 2, 8)
    for op in ("apply_sinks", "merge_state_partial_sinks"):
        setattr(h.k, op, _faulty(h, op, fault))
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        h.forward({0: 1} if structure == "one_pass" else {1: 1, 2: 1}, sinks=SINKS)


def test_cross_attention_sinks_merge_with_self_attention():
    """A split prefill (self over the new tokens, cross with the sinks over the cache before the forward, merged)
    and a decode (cross with the sinks over everything) equal the fused call with the sinks; cross's lse holds the
    sink; on an empty view cross gives o = 0 and lse = the sink."""
    h = sink_harness(seed=7, rope_mode="inline")
    hq, hkv, d = h.hq, h.hkv, h.d
    h.add(0)
    h.add(1)
    h.forward({0: 5}, sinks=SINKS)
    for batch, through in (({0: 3, 1: 4}, False), ({0: 1, 1: 1}, True)):
        n = sum(batch.values())
        h.call("begin_forward", list(batch), list(batch.values()))
        qkv = h.rng.standard_normal((n, hq + 2 * hkv, d)).astype(np.float32)
        q, k, v = (np.ascontiguousarray(x) for x in (qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]))
        o_s, o_c, l_s, l_c = (np.full(shape, np.nan, np.float32) for shape in ((n, hq, d),) * 2 + ((n, hq),) * 2)
        if not through:
            h.call("self_attention", 0, 0.3, T(q), T(k), T(v), T(o_s), T(l_s))
            h.call("cross_attention_sinks", 0, 0.3, T(q), T(SINKS), T(o_c), T(l_c))
            # sequence 1 has no cached token: its cross state is the sink alone
            np.testing.assert_array_equal(o_c[3:], 0)
            np.testing.assert_allclose(l_c[3:], np.broadcast_to(SINKS / math.log(2), (4, hq)), rtol=1e-6)
            h.call("merge_attn_output_inplace", T(o_s), T(l_s), T(o_c), T(l_c))
        o_fused = np.full((n, hq, d), np.nan, np.float32)
        h.call("attention_with_fused_qkv_sinks", 0, 0.3, T(qkv), T(SINKS), T(o_fused))
        if through:
            h.call("cross_attention_sinks", 0, 0.3, T(q), T(SINKS), T(o_s), T(l_s))
        h.call("attention_with_fused_qkv_sinks", 1, 0.3, T(qkv), T(SINKS), T(np.empty_like(o_fused)))
        h.call("end_forward")
        np.testing.assert_allclose(o_s, o_fused, rtol=2e-5, atol=2e-5)
        h._apply_reference(batch, [(qkv.astype(np.float64), o_fused.astype(np.float64))] * 2, 0.3, check=False,
                           tol=None)
    # the lse with the sink, against the reference of the last decode's sequence 0
    k_all, v_all = h.ref[0][0][0], h.ref[0][1][0]
    _o, lse = attend(h.rotate(q[:1], [len(k_all) - 1]), h.rotate(k_all, np.arange(len(k_all))), v_all, 0.3, True,
                     SINKS)
    np.testing.assert_allclose(l_s[:1], lse, rtol=1e-5, atol=1e-5)


def test_sink_errors_name_the_problem_and_change_nothing():
    plain = Harness(seed=3)
    plain.add(0)
    plain.forward({0: 4})
    plain.call("begin_forward", [0], [1])
    qkv, o = np.zeros((1, 8, 8), np.float32), np.zeros((1, 4, 8), np.float32)
    plain.rejects(lambda: plain.call("attention_with_fused_qkv_sinks", 0, 0.3, T(qkv), T(SINKS), T(o)),
                  "attention_sinks = false")
    h = sink_harness(seed=3)
    h.add(0)
    h.forward({0: 4}, sinks=SINKS)
    h.call("begin_forward", [0], [1])
    q, lse = np.zeros((1, 4, 8), np.float32), np.zeros((1, 4), np.float32)
    for sinks, pattern in ((SINKS[:3], r"sinks.*\[4\].*\[3\]"), (SINKS.astype(np.float16), "sinks.*float16")):
        h.rejects(lambda s=sinks: h.call("attention_with_fused_qkv_sinks", 0, 0.3, T(qkv), T(s), T(o)), pattern)
        h.rejects(lambda s=sinks: h.call("cross_attention_sinks", 0, 0.3, T(q), T(s), T(o), T(lse)), pattern)
    h.call("abort_forward")
    assert json.loads(str(g("config_json")(h.cache)))["attention_sinks"] is True


@pytest.mark.parametrize("change, drop, pattern", [
    ({"schema_version": 4}, (), "unknown field 'attention_sinks' for schema_version 4"),
    ({"attention_sinks": 1}, (), "'attention_sinks' must be a bool"),
    ({}, ("apply_sinks",), "attention_sinks = true but the op table has no 'apply_sinks'"),
    ({"dtype": "float16"}, ("merge_state_partial_sinks",), "no 'merge_state_partial_sinks'"),
])
def test_create_rejects_sink_configs_it_cannot_serve(change, drop, pattern):
    with pytest.raises(Exception, match=pattern):
        create(config(**{"schema_version": 5, "attention_sinks": True, **change}), drop=drop)


def test_fp16_table_without_partial_ops_takes_sinks_after_its_merges():
    """A table without the partial-state ops (and so without merge_state_partial_sinks) merges in fp16 and adds
    the sinks with apply_sinks after the last merge."""
    from pagedkv.ops import PARTIAL_OPS

    h = sink_harness(seed=4, dtype="float16", drop=(*PARTIAL_OPS, "merge_state_partial_sinks"))
    h.add(0)
    h.forward({0: 9}, sinks=SINKS)
    h.fork(0, 1, 8)
    h.k.calls.clear()
    h.forward({0: 1, 1: 1}, sinks=SINKS)
    assert sink_ops(h) == [("apply_sinks", "float16")] * h.L
    assert not any(c[0] == "merge_state_partial" for c in h.k.calls)


# -- StreamingLLM sink tokens (config sink_size) ------------------------------------------------------------------
def _sink_token_steps(h, sinks=None):
    """Prefills from empty and continuations whose rows see none, some (a causal sink entry) and all of the sink
    tokens beside their window, decodes, forks mid-page and on a page boundary, a sequence shorter than a window."""
    fwd = functools.partial(h.forward, sinks=sinks)
    h.add(0)
    fwd({0: 13})
    fwd({0: 1})
    h.fork(0, 1, 6)
    h.fork(0, 2, 8)
    h.add(3)
    fwd({1: 4, 2: 1, 3: 2, 0: 2})
    for _ in range(3):
        fwd({0: 1, 1: 1, 2: 1, 3: 1})
    fwd({3: 7})
    h.check_state()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sink_tokens_stay_visible_beside_the_window(dtype):
    """sliding_window 5, sink_size 3 (``src/forward_plan.cc`` AddSinkPasses): every output equals the reference
    in which row p sees keys p - 4 .. p and 0 .. 2; a forward's sink passes are a decode's one, a prefill's causal
    and non-causal ones, skipped where no row misses a sink token."""
    h = sink_harness(seed=5, dtype=dtype, sliding_window=5, sink_size=3, attention_sinks=False)
    h.k.calls.clear()
    _sink_token_steps(h)
    paged = [c for c in h.k.calls if c[0] == "attn_prefill_paged"]
    assert any(len(qi) > 5 for _op, qi in paged), "a prefill's sink pass has entries a row range each"


def test_sink_tokens_with_learnable_sinks():
    """Both kinds of sinks on one cache (fp16: the sink passes' states merged in float32, the last merge with the
    learnable sinks)."""
    h = sink_harness(seed=6, dtype="float16", sliding_window=5, sink_size=3)
    h.k.calls.clear()
    _sink_token_steps(h, SINKS)
    assert any(c[0] == "merge_state_partial_sinks" for c in h.k.calls)


def test_sink_tokens_missing_fail_the_check():
    """The check above is sharp: the same forwards against a reference without the sink tokens fail."""
    h = sink_harness(seed=7, sliding_window=5, sink_size=3, attention_sinks=False)
    h.add(0)
    h.forward({0: 13})
    h.cfg["sink_size"] = 0  # the reference's rows see their window only
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        h.forward({0: 1})


@pytest.mark.parametrize("change, pattern", [
    ({"sink_size": 2}, "sink_size 2 needs a sliding_window"),
    ({"sink_size": 6, "sliding_window": 5}, "sink_size 6 must be <= sliding_window 5"),
    ({"sink_size": -1, "sliding_window": 5}, "sink_size must be >= 0"),
    ({"sink_size": 2, "sliding_window": 5, "schema_version": 4}, "unknown field 'sink_size' for schema_version 4"),
    ({"sink_size": 2, "sliding_window": 5, "cuda_graph_batch": 4}, "sink_size with cuda_graph_batch"),
])
def test_create_rejects_bad_sink_tokens(change, pattern):
    with pytest.raises(Exception, match=pattern):
        create(config(**{"schema_version": 5, **change}))
