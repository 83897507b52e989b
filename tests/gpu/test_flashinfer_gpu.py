"""The scenario suite with the FlashInfer backend on CUDA, and FlashInfer vs TIR agreement.

Shapes: ``pagedkv.testing.shapes.flashinfer_gpu_shapes`` (fp16 head dim 128 and the DeepSeek MLA dims, and
the same in bf16 without attention options: the configs ``make gpu-bundle`` prebuilds kernel libraries with
backends ``("flashinfer", "tir")`` for), where FlashInfer serves at least one op (``pagedkv.backends.resolve``
with that priority list). On them:

- the scenarios against the PyTorch reference exactly as in ``test_scenarios_gpu.py``, and fine-grained
  (``self_attention`` / ``cross_attention`` / merge, with rows without keys checked to be ``o = 0``,
  ``lse = -1e30``, which FlashInfer alone writes as ``-inf``);
- the same inputs through a FlashInfer cache and a TIR cache agree within the dtype's tolerance, in prefill
  (ragged + paged passes, shared prefixes) and decode forwards, MHA and MLA.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import backends
from pagedkv.testing.scenarios import SCENARIOS, TOLERANCE, ScenarioRunner, random_sm_scale, rel_err
from pagedkv.testing.shapes import MLAShape, flashinfer_gpu_shapes

FI = ["flashinfer", "tir"]
CUDA = {"kind": "cuda", "arch": "sm_90"}


def _served(shape) -> bool:
    try:
        res = backends.resolve(shape.config(), CUDA, FI)
    except Exception:  # noqa: BLE001 (a config nobody serves is not a FlashInfer shape)
        return False
    return "flashinfer" in res.choice.values()


SHAPES = [s for s in flashinfer_gpu_shapes() if _served(s)]
IDS = [s.id for s in SHAPES]
MHA = [s for s in SHAPES if not isinstance(s, MLAShape)]


def test_flashinfer_serves_some_gpu_shape():
    assert SHAPES, "FlashInfer serves no shape of the GPU suite (is flashinfer-python 0.7.4 installed?)"
    assert any(isinstance(s, MLAShape) for s in SHAPES) and MHA


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_scenario_flashinfer(shape, scenario, make_gpu_cache, gen):
    cache = make_gpu_cache(shape.config(), FI)
    assert "flashinfer" in cache.op_backends.values(), cache.op_backends
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    runner.run(SCENARIOS[scenario](shape.ps), scenario)


@pytest.mark.parametrize("scenario", ["mixed_prefill_decode", "fork_three_deep", "shared_prefix_adjacent",
                                      "edge_cases", "chunked_prefill"])
@pytest.mark.parametrize("shape", MHA, ids=[s.id for s in MHA])
def test_fine_grained_flashinfer(shape, scenario, make_gpu_cache, gen):
    """self + cross + merge through FlashInfer equal the reference, rows without keys included."""
    cache = make_gpu_cache(shape.config(), FI)
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d), fine_grained=True)
    runner.run(SCENARIOS[scenario](shape.ps), scenario)


def _agree(shape, caches, sm_scale, gen, steps):
    """Run ``steps`` (lists of (seq, length)) on every cache with the same inputs; compare every output."""
    cfg = shape.config()
    for step_i, batch in enumerate(steps):
        ids, lens = [s for s, _ in batch], [n for _, n in batch]
        n = sum(lens)
        outs = {}
        dt = getattr(torch, cfg.dtype)  # fp16 or bf16
        if cfg.is_mla:
            kv = [torch.randn(n, cfg.latent_dim, generator=gen).to(dt).cuda() for _ in range(cfg.num_layers)]
            q = [torch.randn(n, cfg.num_qo_heads, cfg.latent_dim, generator=gen).to(dt).cuda()
                 for _ in range(cfg.num_layers)]
        else:
            width = cfg.num_qo_heads + 2 * cfg.num_kv_heads
            qkv = [torch.randn(n, width, cfg.head_dim, generator=gen).to(dt).cuda() for _ in range(cfg.num_layers)]
        for tag, cache in caches.items():
            cache.begin_forward(ids, lens)
            res = []
            for layer in range(cfg.num_layers):
                if cfg.is_mla:
                    cache.append_mla_kv(layer, kv[layer])
                    res.append(cache.cross_attention(layer, q[layer], sm_scale))
                else:
                    res.append((cache.attention_with_fused_qkv(layer, qkv[layer].clone(), sm_scale),))
            cache.end_forward()
            outs[tag] = res
        for layer in range(cfg.num_layers):
            for i, (a, b) in enumerate(zip(outs["flashinfer"][layer], outs["tir"][layer])):
                if i == 1:  # lse: rows without keys must match exactly (-1e30), the rest within tolerance
                    empty = b <= -1e29
                    assert torch.equal(a[empty], b[empty]), f"step {step_i} layer {layer}: empty rows' lse"
                    a, b = a[~empty], b[~empty]
                err = rel_err(a, b)
                assert err < TOLERANCE[cfg.dtype], \
                    f"step {step_i} layer {layer} output {i}: FlashInfer vs TIR {err:.2e} ({batch})"


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_flashinfer_agrees_with_tir(shape, make_gpu_cache, gen):
    """Prefill (ragged + paged, a shared prefix, a fresh sequence beside cached ones) then decode steps (with
    a shared prefix: paged passes in a decode forward): FlashInfer and TIR outputs agree."""
    cfg = shape.config()
    caches = {tag: make_gpu_cache(cfg, FI if tag == "flashinfer" else "tir") for tag in ("flashinfer", "tir")}
    assert "flashinfer" in caches["flashinfer"].op_backends.values()
    sm_scale = random_sm_scale(gen, shape.d)
    P = shape.ps
    for cache in caches.values():
        for seq in (0, 1, 2):
            cache.add_sequence(seq)
    _agree(shape, caches, sm_scale, gen, [[(0, 2 * P + 1), (1, 5)], [(0, P), (2, P)]])  # <= 64 tokens each
    for cache in caches.values():
        cache.fork_sequence(0, 3, -1)
        cache.add_sequence(4)
    _agree(shape, caches, sm_scale, gen, [[(0, 2), (3, 3), (4, 6), (1, 1)]])  # prefill: prefix pass, fresh seq
    _agree(shape, caches, sm_scale, gen, [[(0, 1), (3, 1), (1, 1), (2, 1), (4, 1)]] * 3)  # decode
