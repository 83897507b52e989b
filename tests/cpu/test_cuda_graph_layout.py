"""CUDA-graph decode forwards (config ``cuda_graph_batch``) on the CPU: the runtime's side of graph replay.

A replayed graph reads the index arrays from the device addresses, with the shapes, that the capture saw, and
runs no host code. So in a cache with ``cuda_graph_batch`` every decode forward of ``b`` sequences must put its
arrays at the same addresses with the same shapes however the page tables changed in between (forks, removals,
new sequences, pages filled), attend each chain in one pass (no shared-prefix passes, whose number varies),
and still compute the right attention. The GPU suite replays real graphs (tests/gpu/test_cuda_graph_gpu.py).
"""

from __future__ import annotations

import pytest

from pagedkv import KVCacheConfig
from pagedkv._lib import get_global
from pagedkv.testing.scenarios import SCENARIOS, ScenarioRunner, random_sm_scale
from pagedkv.testing.shapes import SHAPES

#: Shapes run with cuda_graph_batch = max_batch_size: GQA 1 and 3 / 4, RoPE inline and normal, fp32 / fp16 / bf16.
GRAPH_SHAPES = [s for s in SHAPES if s.id in ("h8x2-d64-f32-p8-inline-t500000s1", "h6x2-d64-f16-p8-normal",
                                              "h7x1-d64-bf16-p16-normal", "h4x1-d64-f32-p8-normal-w13")]


def _graph(cfg: KVCacheConfig) -> KVCacheConfig:
    return cfg.replace(cuda_graph_batch=cfg.max_batch_size)


def test_graph_shapes_are_found():
    assert len(GRAPH_SHAPES) == 4


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("shape", GRAPH_SHAPES, ids=[s.id for s in GRAPH_SHAPES])
def test_graph_cache_scenarios(shape, scenario, make_cache, gen):
    """The whole scenario suite (forks mid-page, shared prefixes, popn, removals, mixed batches) on a graph
    cache, against the reference: its decode forwards use the graph layout and the one-pass plan."""
    cache = make_cache(_graph(shape.config()), "tir")
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    runner.run(SCENARIOS[scenario](shape.ps), scenario)


CFG = KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", page_size=4,
                    max_batch_size=4, max_total_seq_len=96, prefill_chunk_size=32, cuda_graph_batch=4)


def _arrays(cache) -> dict:
    """name -> (address, shape) of the open forward's device index arrays."""
    views = get_global("pagedkv.debug_forward_arrays")(cache.handle)
    return {str(k): (v.data_ptr(), tuple(v.shape)) for k, v in views.items()}


def _forward(cache, ids, lengths, gen):
    import torch

    cache.begin_forward(ids, lengths)
    layout = _arrays(cache)
    n = sum(lengths)
    for layer in range(CFG.num_layers):
        qkv = torch.randn(n, CFG.num_qo_heads + 2 * CFG.num_kv_heads, CFG.head_dim, generator=gen)
        cache.attention_with_fused_qkv(layer, qkv, 0.25)
    cache.end_forward()
    return layout


def test_decode_arrays_depend_on_the_batch_size_only(make_cache, gen):
    cache = make_cache(CFG, "tir")
    num_pages = (CFG.max_total_seq_len - 1) // CFG.page_size + 1 + CFG.max_batch_size
    for s in (0, 1, 2):
        cache.add_sequence(s)
    _forward(cache, [0, 1, 2], [5, 9, 3], gen)
    first = _forward(cache, [0, 1, 2], [1, 1, 1], gen)
    assert sorted(k for k in first if k.startswith("pass")) == [
        f"pass0.{n}" for n in ("k_pos_offset", "last_page_len", "page_indptr", "page_values", "q_indptr")]
    assert first["pass0.page_values"][1] == (3 * num_pages,)  # room for every page of every sequence
    assert first["q_pos"][1] == (3,) and first["pass0.page_indptr"][1] == (4,)
    # page tables change between the decode forwards: pages fill and new ones are taken, a fork shares a
    # prefix (a shared-prefix pass without graphs), a removal frees pages, prefills run in between
    steps = [lambda: None, lambda: cache.fork_sequence(1, 3, 6), lambda: cache.remove_sequence(0),
             lambda: _forward(cache, [3], [4], gen)]
    for i, change in enumerate(steps):
        change()
        ids = [0, 1, 2] if i < 2 else [1, 2, 3]
        for _ in range(3):  # crosses page boundaries (page_size 4)
            assert _forward(cache, ids, [1, 1, 1], gen) == first, f"after change {i}"
    two = _forward(cache, [1, 3], [1, 1], gen)
    assert two["pass0.page_values"][1] == (2 * num_pages,) and two["q_pos"][0] == first["q_pos"][0]


def test_prefill_forward_keeps_its_own_layout(make_cache, gen):
    """Only decode forwards use the graph layout; a prefill forward (uncaptured) has the usual passes."""
    cache = make_cache(CFG, "tir")
    cache.add_sequence(0)
    _forward(cache, [0], [8], gen)
    cache.fork_sequence(0, 1)
    prefill = _forward(cache, [0, 1], [2, 3], gen)
    assert "pass1.page_values" in prefill  # the shared prefix is a pass of its own
    decode = _forward(cache, [0, 1], [1, 1], gen)
    assert "pass1.page_values" not in decode and decode["q_pos"][0] != prefill["q_pos"][0]


def test_attention_calls_are_counted(make_cache, gen):
    cache = make_cache(CFG, "tir")
    calls = get_global("pagedkv.debug_attention_calls")
    cache.add_sequence(0)
    before = calls(cache.handle)
    _forward(cache, [0], [3], gen)
    assert calls(cache.handle) - before == CFG.num_layers


def test_graph_batch_bounds_max_batch_size():
    with pytest.raises(ValueError, match="max_batch_size=4 is larger than cuda_graph_batch=2"):
        CFG.replace(cuda_graph_batch=2)
    with pytest.raises(ValueError, match="not supported for MLA caches"):
        KVCacheConfig.mla(num_layers=1, num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                          v_head_dim=8, cuda_graph_batch=1)
