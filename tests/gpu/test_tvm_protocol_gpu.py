"""TVM's KV-state protocol on CUDA: the conformance scenarios of ``tests/cpu/test_tvm_protocol.py`` (apache-tvm 0.27's
paged-KV-cache test re-written on ``vm.builtin.*``, ``pagedkv.testing.tvm_protocol``) on CUDA caches, with the same
reference and TVM's tolerance. Kernels come from the prebuilt bundle (``make gpu-bundle``: the shapes of
``pagedkv.testing.shapes.gpu_shapes``, which serve every capacity), caches from ``make_gpu_cache``.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.testing.shapes import GPU_EXTRA, SHAPES
from pagedkv.testing.tvm_protocol import (TVM_SCENARIOS, UNSUPPORTED_SCENARIOS, Builtins, ConformanceDriver,
                                          conformance_capacity, shape)

#: The CPU suite's four (RoPE none / normal / inline, float32 / float16, head dims 64 / 128) and TVM's GPU shape
#: class (32 / 8 heads of 128, float16).
CONFORMANCE_SHAPES = [SHAPES[0], SHAPES[2], SHAPES[7], SHAPES[1], GPU_EXTRA[0]]
#: (backend, shape): TIR on every shape, FlashInfer (with TIR for the ops it leaves) on its fp16 / d128 shape.
CASES = [("tir", s) for s in CONFORMANCE_SHAPES] + [(["flashinfer", "tir"], GPU_EXTRA[0])]


def _id(case) -> str:
    backend, s = case
    return f"{backend if isinstance(backend, str) else '+'.join(backend)}-{s.id}"


@pytest.fixture(scope="module")
def gpu_conformance_cache(make_gpu_cache):
    made = {}

    def get(backend, s):
        key = (str(backend), s)
        if key not in made:
            made[key] = make_gpu_cache(conformance_capacity(s.config()), backend=backend)
        return made[key]

    return get


@pytest.mark.parametrize("scenario", list(TVM_SCENARIOS))
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_tvm_scenario_gpu(case, scenario, gpu_conformance_cache, gen):
    cache = gpu_conformance_cache(*case)
    driver = ConformanceDriver(cache.handle, cache.config, gen, device="cuda")
    driver.clear()
    TVM_SCENARIOS[scenario](driver)
    torch.cuda.synchronize()


@pytest.mark.parametrize("scenario", list(UNSUPPORTED_SCENARIOS))
def test_tvm_scenario_not_supported_gpu(scenario):
    pytest.skip(f"not supported by pagedkv: {UNSUPPORTED_SCENARIOS[scenario]}")


def test_refusals_leave_the_cuda_cache_usable(gpu_conformance_cache, gen):
    """A refused token tree and a refused sliding window raise NotImplementedError and change nothing."""
    cache = gpu_conformance_cache("tir", SHAPES[2])
    d = ConformanceDriver(cache.handle, cache.config, gen, device="cuda")
    d.clear()
    d.apply([(0, 9), (1, 17)])
    f, h = Builtins.load(), cache.handle
    with pytest.raises(NotImplementedError, match="not supported by pagedkv: tree attention"):
        f.begin_forward(h, shape([0]), shape([3]), shape([-1, 0, 0]))
    with pytest.raises(NotImplementedError, match="not supported by pagedkv: per-sequence sliding windows"):
        f.enable_sliding_window_for_seq(h, 1, 8, 0)
    d.verify()
    d.apply([(0, 1), (1, 1)])
