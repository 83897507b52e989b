"""The scenario suite with the FlashInfer backend on CUDA, and FlashInfer vs TIR agreement.

For every GPU-suite shape where FlashInfer serves an op (``pagedkv.backends.resolve`` with the priority list
``("flashinfer", "tir")``, the list ``make gpu-bundle`` builds kernel libraries for), the scenarios run
against the PyTorch reference exactly as in ``test_scenarios_gpu.py``; then the same inputs go through a
FlashInfer cache and a TIR cache and their outputs must agree within the dtype's tolerance.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import backends
from pagedkv.testing.scenarios import (SCENARIOS, TOLERANCE, ScenarioRunner, add, forward, random_sm_scale,
                                       rel_err)
from pagedkv.testing.shapes import gpu_shapes

FI = ["flashinfer", "tir"]
CUDA = {"kind": "cuda", "arch": "sm_90"}


def _served(shape) -> bool:
    try:
        res = backends.resolve(shape.config(), CUDA, FI)
    except Exception:  # noqa: BLE001 (a config nobody serves is not a FlashInfer shape)
        return False
    return "flashinfer" in res.choice.values()


SHAPES = [s for s in gpu_shapes() if _served(s)]
IDS = [s.id for s in SHAPES]


def test_flashinfer_serves_some_gpu_shape():
    assert SHAPES, "FlashInfer serves no shape of the GPU suite (is flashinfer-python 0.7.4 installed?)"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_scenario_flashinfer(shape, scenario, make_gpu_cache, gen):
    cache = make_gpu_cache(shape.config(), FI)
    assert "flashinfer" in cache.op_backends.values(), cache.op_backends
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    runner.run(SCENARIOS[scenario](shape.ps), scenario)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_flashinfer_agrees_with_tir(shape, make_gpu_cache, gen):
    """The same steps and inputs through both backends: decode outputs agree within the dtype's bound."""
    cfg = shape.config()
    caches = {tag: make_gpu_cache(cfg, [tag, "tir"] if tag != "tir" else "tir") for tag in ("flashinfer", "tir")}
    sm_scale = random_sm_scale(gen, shape.d)
    P = shape.ps
    setup = [add(0), add(1), add(2), forward({0: 2 * P + 1, 1: 5}), forward({0: P, 2: P})]  # <= 64 tokens each
    for cache in caches.values():
        ScenarioRunner(cache, torch.Generator().manual_seed(7), sm_scale).run(setup, "setup")
    width = cfg.num_qo_heads + 2 * cfg.num_kv_heads
    for step in range(4):
        qkv = torch.randn(3, width, cfg.head_dim, generator=gen).to(getattr(torch, cfg.dtype)).cuda()
        outs = {}
        for tag, cache in caches.items():
            cache.begin_forward([0, 1, 2], [1, 1, 1])
            outs[tag] = [cache.attention_with_fused_qkv(layer, qkv.clone(), sm_scale)
                         for layer in range(cfg.num_layers)]
            cache.end_forward()
        for layer in range(cfg.num_layers):
            err = rel_err(outs["flashinfer"][layer], outs["tir"][layer])
            assert err < TOLERANCE[cfg.dtype], f"decode step {step} layer {layer}: FlashInfer vs TIR {err:.2e}"
