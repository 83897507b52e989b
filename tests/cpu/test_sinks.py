"""Learnable attention sinks on the TIR CPU kernels (``tir_kernels/sinks.py``) and through whole caches against the
float64 reference (``pagedkv.testing.reference``: the sink as one more logit of the softmax).

- The two sink kernels against ``reference.apply_sinks`` / ``merge_states``: sinks of +-8, empty rows (they become
  the sink alone), a large lse, two value dims through one kernel (``dv`` is symbolic), and NaN propagation (a NaN
  lse or o stays NaN; NaN never leaks into other rows).
- An fp16 MHA cache (one-pass prefills and decodes, prefix-shared decodes and prefills whose float32 states end in
  ``merge_state_partial_sinks``, a split prefill's ragged pass) and a float32 MLA cache (``cross_attention`` with
  sinks over one and several passes, ``merge_state`` then ``apply_sinks``): every output matches the reference with
  the sinks, and is far from the reference without them and from the one with each sink counted twice (a sink
  ``s`` twice is one sink ``s + ln 2``), so a dropped or doubled sink fails here.

The runtime's orchestration of every pass structure, with kernels that drop or double the sink, is
``test_sinks_runtime.py`` (numpy kernels, no compile).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import pagedkv
from pagedkv import tir_kernels as tk
from pagedkv.testing import reference as R
from pagedkv.testing.sinks import SinkRun, sinks_for

#: Sinks of 4 query heads: +8 / -8 make a dropped sink obvious, +3 (about a row's own softmax mass) a doubled one.
SINKS = sinks_for(4)


# -- the kernels ------------------------------------------------------------------------------------------------
def _compile(op: str, dtype: str):
    import tvm

    func = tk.make(op, tk.KernelSpec(4, 2, 16, 16, dtype, attention_sinks=True), "llvm")
    return tvm.compile(tvm.IRModule({f"pagedkv_{op}": func}), target="llvm")[f"pagedkv_{op}"]


def _state(gen, n: int, dv: int, dtype):
    """A state [n, 4, dv] / [n, 4] with an empty row, a NaN lse (row 1, head 2), a NaN o element (row 2, head 3)
    and a large lse (row 3, head 0)."""
    o = torch.randn(n, 4, dv, generator=gen).to(dtype)
    lse = torch.randn(n, 4, generator=gen) * 4
    o[0], lse[0] = 0, R.EMPTY_LSE
    lse[1, 2], o[2, 3, 5], lse[3, 0] = math.nan, math.nan, 50.0
    return o, lse


def _check_state(o, lse, want_o, want_l, tol):
    """NaN exactly where the reference has NaN (rows 1 and 2 above), values within ``tol`` elsewhere."""
    assert torch.equal(torch.isnan(o.double()), torch.isnan(want_o)), "NaN where the reference has none, or lost"
    assert torch.equal(torch.isnan(lse.double()), torch.isnan(want_l))
    ok = ~torch.isnan(want_o)
    assert torch.allclose(o.double()[ok], want_o[ok], rtol=tol, atol=tol)
    ok = ~torch.isnan(want_l)
    assert torch.allclose(lse.double()[ok], want_l[ok], rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_apply_sinks_kernel(dtype, gen):
    import tvm_ffi

    fn = _compile("apply_sinks", dtype)
    for dv in (16, 40):
        o, lse = _state(gen, 5, dv, getattr(torch, dtype))
        want_o, want_l = R.apply_sinks(o.double(), lse.double(), SINKS)
        fn(*map(tvm_ffi.from_dlpack, (o, lse, SINKS)))
        _check_state(o, lse, want_o, want_l, 1e-2 if dtype == "bfloat16" else 1e-5)
        assert torch.all(o[0] == 0) and torch.allclose(lse[0].double(), SINKS.double() / math.log(2))


def test_merge_state_partial_sinks_kernel(gen):
    import tvm_ffi

    fn = _compile("merge_state_partial_sinks", "float16")
    for dv in (16, 40):
        o_a, l_a = _state(gen, 5, dv, torch.float32)
        o_b, l_b = torch.randn(5, 4, dv, generator=gen), torch.randn(5, 4, generator=gen) * 4
        o_b[0], l_b[0] = 0, R.EMPTY_LSE  # row 0: both states empty
        merged = R.merge_states(o_a.double(), l_a.double(), o_b.double(), l_b.double())
        want_o, want_l = R.apply_sinks(*merged, SINKS)
        o = torch.full((5, 4, dv), math.nan, dtype=torch.float16)
        fn(*map(tvm_ffi.from_dlpack, (o_a, l_a, o_b, l_b, SINKS, o)))
        _check_state(o_a, l_a, want_o, want_l, 1e-5)  # the float32 running state holds the sink
        _check_state(o, l_a, want_o, want_l, 1e-3)     # o: that state rounded once


# -- whole caches -----------------------------------------------------------------------------------------------
def _run(cfg, gen) -> SinkRun:
    return SinkRun(pagedkv.create(cfg, backend="tir", target="llvm", poison=True), gen)


def test_mha_fp16_cache_counts_each_sink_once(gen):
    """One pass (prefill from empty, a lone decode), prefix-shared decodes and prefills (float32 states merged,
    the last merge merge_state_partial_sinks), a split prefill with a fresh sequence beside forked ones (ragged,
    prefix and own passes: three states, two merges)."""
    run = _run(pagedkv.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype="float16",
                                     page_size=4, max_batch_size=4, max_total_seq_len=128, prefill_chunk_size=32,
                                     attention_sinks=True), gen)
    run.each("add_sequence", 0)
    run.fused({0: 9})
    for child in (1, 2):
        run.each("fork_sequence", 0, child, 8)
    run.fused({1: 1, 2: 1})
    run.each("add_sequence", 3)
    run.fused({3: 5, 1: 3, 2: 2})  # ragged, the shared prefix and the own pass: three float32 states
    run.fused({1: 2, 2: 2, 0: 1})
    run.fused({0: 1})


def test_mla_float32_cross_attention_counts_each_sink_once(gen):
    """An empty view (the sink alone: o = 0, lse = sink), one pass, prefix-shared passes (merge_state, then
    apply_sinks), decode and prefill."""
    cfg = pagedkv.KVCacheConfig.mla(num_layers=1, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                                    qk_rope_head_dim=8, v_head_dim=16, dtype="float32", page_size=4,
                                    max_batch_size=4, max_total_seq_len=128, prefill_chunk_size=32,
                                    attention_sinks=True)
    run = _run(cfg, gen)
    run.each("add_sequence", 0)
    run.mla({0: 6})  # a prefill's view of an empty sequence
    run.mla({0: 1})
    run.mla({0: 3})
    for child in (1, 2):
        run.each("fork_sequence", 0, child, 8)
    run.mla({1: 1, 2: 1})
    run.mla({1: 2, 2: 3, 0: 1})


# -- the Relax API --------------------------------------------------------------------------------------------
def _export(dtype: str, sinks_shape=(4,), sinks_dtype="float32"):
    """The IRModule of a module whose methods call the cache's attention with a ``sinks`` parameter."""
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import Tensor

    from pagedkv.relax import PagedKVCache

    class Attention(nn.Module):
        def __init__(self):
            self.sinks = nn.Parameter(sinks_shape, sinks_dtype)

        def fused(self, qkv: Tensor, cache: PagedKVCache):
            return cache.attention_with_fused_qkv(0, qkv, 4, 0.3, sinks=self.sinks), cache

        def cross(self, q: Tensor, cache: PagedKVCache):
            return cache.cross_attention(0, q, 16, 0.3, sinks=self.sinks)

    packed = {"$": {"param_mode": "packed", "effect_mode": "none"}}
    obj = nn.spec.Object(object_type=PagedKVCache)
    return Attention().export_tvm(spec={  # (no create_paged_kv_cache: its kernels are not what is tested here)
        "fused": {"qkv": nn.spec.Tensor([1, "n", 8, 16], dtype), "cache": obj, **packed},
        "cross": {"q": nn.spec.Tensor([1, "n", 4, 16], dtype), "cache": obj, **packed}})[0]


def test_relax_methods_call_the_sink_globals():
    """``sinks=`` of the Relax ``attention_with_fused_qkv`` / ``cross_attention`` calls the ``*_sinks`` globals with
    the sinks after the inputs (DPS: the outputs follow), and refuses sinks that are not float32 ``[Hq]`` when the
    model is built (a cache without ``attention_sinks`` is refused by the runtime at the call:
    test_sinks_runtime.py). (A compiled module of this kind ran against the reference when the API was written;
    whole-model builds are test_relax_model's.)"""
    text = _export("float16").script()
    for name in ("attention_with_fused_qkv_sinks", "cross_attention_sinks"):
        calls = re.findall(rf'call_dps_packed\("pagedkv.{name}", \((.*?)\), out_ty', text)
        assert len(calls) == 1 and re.fullmatch(r"cache, 0, T.float64\(0.29+\d*\), reshape\d*, sinks\d*", calls[0]), calls
    with pytest.raises(ValueError, match=r"sinks must be float32 \[4\].*float16"):
        _export("float16", sinks_dtype="float16")
    with pytest.raises(ValueError, match=r"sinks must be float32 \[4\].*\[8\]"):
        _export("float16", sinks_shape=(8,))


# -- StreamingLLM sink tokens -----------------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", ["mixed_prefill_decode", "fork_three_deep", "chunked_prefill"])
def test_sink_token_scenarios_on_tir(scenario, make_cache, gen):
    """sink_size 4 beside the scenario suite's window of 13 on the TIR CPU kernels (the windowed shape's kernel
    library: sink tokens change no kernel, the runtime reads them in passes of their own), against the reference."""
    from pagedkv.testing.scenarios import SCENARIOS, ScenarioRunner, random_sm_scale
    from pagedkv.testing.shapes import SHAPES

    shape = next(s for s in SHAPES if s.window == 13)
    cfg = shape.config().replace(sink_size=4)
    runner = ScenarioRunner(make_cache(cfg, "tir"), gen, random_sm_scale(gen, shape.d))
    runner.run(SCENARIOS[scenario](shape.ps), scenario)
