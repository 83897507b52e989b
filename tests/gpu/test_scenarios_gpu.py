"""The scenario suite (``pagedkv.testing.scenarios``) on CUDA against the PyTorch reference.

Same scenarios, reference and tolerances as ``tests/cpu/test_scenarios.py``; shapes add GQA group 8 and
the H200 benchmark shape (``pagedkv.testing.shapes.gpu_shapes``).
"""

from __future__ import annotations

import pytest

from pagedkv.testing.scenarios import SCENARIOS, ScenarioRunner, clear, random_sm_scale, random_step
from pagedkv.testing.shapes import gpu_shapes

SHAPES = gpu_shapes()



@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("shape", SHAPES, ids=[s.id for s in SHAPES])
def test_scenario_gpu(shape, scenario, make_gpu_cache, gen):
    cache = make_gpu_cache(shape.config())
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    runner.run(SCENARIOS[scenario](shape.ps), scenario)


@pytest.mark.parametrize("shape", SHAPES[:4], ids=[s.id for s in SHAPES[:4]])
def test_fine_grained_gpu(shape, make_gpu_cache, gen):
    """self_attention + cross_attention + merge on CUDA equal the reference and the fused call."""
    cache = make_gpu_cache(shape.config())
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d), fine_grained=True)
    runner.run(SCENARIOS["mixed_prefill_decode"](shape.ps), "mixed_prefill_decode")
    runner.run([clear()] + SCENARIOS["fork_three_deep"](shape.ps), "fork_three_deep")


@pytest.mark.parametrize("shape", SHAPES[::3], ids=[s.id for s in SHAPES[::3]])
def test_random_scenario_gpu(shape, make_gpu_cache, gen, seed):
    import random

    cache = make_gpu_cache(shape.config())
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    rng = random.Random(seed)
    for i in range(60):
        step = random_step(runner.ref, rng)
        runner.run([step], f"random step {i}")
