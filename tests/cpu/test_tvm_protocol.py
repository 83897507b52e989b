"""TVM's KV-state protocol on a pagedkv cache: the ``vm.builtin.kv_state_*`` / ``attention_kv_cache_*`` globals of
libtvm_runtime drive it unchanged (README, "Drop-in for TVM's KV-state protocol").

- Conformance: the scenarios of apache-tvm 0.27's CPU paged-KV-cache test (``pagedkv.testing.tvm_protocol``:
  add / fork / popn / remove, chunked and batched prefill, decode, token chains with commits), every call through
  ``vm.builtin.*``, every layer's output and every cached K / V against a float64 reference, on four kernel
  shapes of the scenario suite (float32 / float16, RoPE none / normal / inline, head dims 64 / 128: kernels shared).
  The scenarios pagedkv refuses are listed as skips with the reason.
- Refusals: each unsupported method raises NotImplementedError "not supported by pagedkv: <what>" and leaves the
  cache as it was.
- Misuse: test_misuse_property.py's state machine with the cache seen through the protocol (``protocol_view``),
  plus protocol-only misuse (token trees, commits, sliding windows, refused features, None tensors); and every
  protocol global called with a wrong or None argument in a subprocess (no crash).
- Models: a Relax module written for TVM's cache (spec object type and method calls TVM's) compiles with only its
  constructor changed to pagedkv's and runs through ``vm.builtin.*``; SmolLM2 greedy generation by an engine that
  calls only ``vm.builtin.*`` equals transformers' (the library ``test_smollm2.py`` compiles, shared).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.testing.shapes import SHAPES
from pagedkv.testing.tvm_protocol import (TVM_SCENARIOS, UNSUPPORTED_SCENARIOS, Builtins, ConformanceDriver,
                                          conformance_capacity, shape)

#: h4x4-d64-f32-p16-none, h6x2-d64-f16-p8-normal, h7x1-d128-f32-p8-normal, h4x4-d128-f16-p8-inline
CONFORMANCE_SHAPES = [SHAPES[0], SHAPES[2], SHAPES[7], SHAPES[1]]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The reference's tensors are small: torch's worker threads only contend with the TVM runtime's thread pool,
    which spins after each kernel (this module took 50 s on two cores with two torch threads, 5 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def conformance_cache():
    """One cache per shape for the module (TVM's tests also share one per config, clearing it first)."""
    import pagedkv

    made = {}

    def get(s):
        if s not in made:
            made[s] = pagedkv.create(conformance_capacity(s.config()), backend="tir", target="llvm", poison=True)
        return made[s]

    return get


@pytest.mark.parametrize("scenario", list(TVM_SCENARIOS))
@pytest.mark.parametrize("s", CONFORMANCE_SHAPES, ids=[s.id for s in CONFORMANCE_SHAPES])
def test_tvm_scenario(s, scenario, conformance_cache, gen):
    cache = conformance_cache(s)
    driver = ConformanceDriver(cache.handle, cache.config, gen)
    driver.clear()
    TVM_SCENARIOS[scenario](driver)


@pytest.mark.parametrize("scenario", list(UNSUPPORTED_SCENARIOS))
def test_tvm_scenario_not_supported(scenario):
    pytest.skip(f"not supported by pagedkv: {UNSUPPORTED_SCENARIOS[scenario]}")
