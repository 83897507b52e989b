"""The scenario suite on every run-time code path of the CPU kernels (``pagedkv.backends.tir.forced_paths``).

* Every scenario of ``pagedkv.testing.scenarios`` on the plain, windowed and capped scenario shapes with
  the thread path forced each way (``auto`` is ``test_scenarios.py``).
* The batch scenarios (``scenarios_batch``: 20 sequences, long and short, both orders) on
  ``shapes.BATCH_SHAPES`` (16 and 4 kv heads) on every path, auto included.
* The regression of the windowed decode that returned the empty state for every entry after the first one
  when it ran on the thread pool and the first entry's window started past its first key tile, compared
  per sequence with the float64 reference so a wrong short sequence cannot hide behind a long one.

Only the TIR backend takes forced paths; every forced config compiles once (``pagedkv.cache`` keys its
module cache by the forced paths) and serves every scenario.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import KVCacheConfig
from pagedkv.backends.tir import forced_paths
from pagedkv.testing.reference import ReferenceCache
from pagedkv.testing.scenarios import SCENARIOS, TOLERANCE, ScenarioRunner, assert_close, random_sm_scale
from pagedkv.testing.scenarios_batch import BATCH_SCENARIOS
from pagedkv.testing.shapes import BATCH_SHAPES, SHAPES

#: The plain, windowed and capped scenario shapes (1, 4 and 2 kv heads).
PATH_SHAPES = [s for s in SHAPES if s.id in ("h4x4-d64-f32-p16-none", "h4x1-d64-f32-p8-normal-w13",
                                             "h6x2-d128-f16-p16-none-cap2")]
assert len(PATH_SHAPES) == 3


def make_forced_cache(make_cache, config, threads: str):
    """A TIR cache whose kernels run the ``cpu_threads`` path ``threads`` (compiled with it forced)."""
    with forced_paths({"cpu_threads": threads}):
        return make_cache(config, "tir")


def test_forced_paths_key_the_kernels():
    """Each forced path has its own kernel library key (so a forced build never serves another path);
    "auto" is no forcing at all."""
    from pagedkv import ops
    from pagedkv.cache import kernel_library_key

    cfg = PATH_SHAPES[0].config()
    choice = [(op, "tir") for op in ops.ops_for(cfg)]
    keys = {}
    for threads in ("auto", "serial", "parallel"):
        with forced_paths({"cpu_threads": threads}):
            keys[threads] = kernel_library_key(cfg, "llvm", choice)
    assert keys["auto"] == kernel_library_key(cfg, "llvm", choice)
    assert len(set(keys.values())) == 3


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("shape", PATH_SHAPES, ids=lambda s: s.id)
def test_scenario_thread_paths(shape, threads, scenario, make_cache, gen):
    cache = make_forced_cache(make_cache, shape.config(), threads)
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    runner.run(SCENARIOS[scenario](shape.ps), f"{scenario} ({threads})")


@pytest.mark.parametrize("scenario", list(BATCH_SCENARIOS))
@pytest.mark.parametrize("threads", ["auto", "serial", "parallel"])
@pytest.mark.parametrize("shape", BATCH_SHAPES, ids=lambda s: s.id)
def test_batch_scenario_thread_paths(shape, threads, scenario, make_cache, gen):
    cache = make_forced_cache(make_cache, shape.config(), threads)
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    runner.run(BATCH_SCENARIOS[scenario](shape.ps), f"{scenario} ({threads})")


def run_forward_per_sequence(cache, ref, batch: dict[int, int], gen: torch.Generator, sm_scale: float,
                             where: str) -> None:
    """One forward of ``batch`` (seq -> new tokens, in order) on both caches; every layer's output rows of
    every sequence must match the reference on their own (relative error under the dtype's bound)."""
    cfg = cache.config
    dtype = getattr(torch, cfg.dtype)
    seqs, lens = list(batch), list(batch.values())
    ref.begin_forward(seqs, lens)
    cache.begin_forward(seqs, lens)
    width = cfg.num_qo_heads + 2 * cfg.num_kv_heads
    for layer in range(cfg.num_layers):
        qkv = torch.randn(sum(lens), width, cfg.head_dim, generator=gen).to(dtype)
        o = cache.attention_with_fused_qkv(layer, qkv, sm_scale)
        ref_o = ref.attention_with_fused_qkv(layer, qkv, sm_scale)
        start = 0
        for seq, n in batch.items():
            assert_close(o[start:start + n], ref_o[start:start + n], cfg.dtype,
                         f"{where} layer {layer} sequence {seq} ({n} new tokens)")
            start += n
    cache.end_forward()
    ref.end_forward()


#: The reported shape: 16 q / 16 kv heads (enough work for the thread pool), head dim 64, window 13.
WINDOW_REPRO = KVCacheConfig(num_layers=1, num_qo_heads=16, num_kv_heads=16, head_dim=64, dtype="float32",
                             rope_mode="none", page_size=16, max_batch_size=2, max_total_seq_len=128,
                             prefill_chunk_size=96, sliding_window=13)


@pytest.mark.parametrize("threads", ["auto", "serial", "parallel"])
@pytest.mark.parametrize("together", [False, True], ids=["prefill-apart", "prefill-together"])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["long-first", "short-first"])
def test_window_decode_first_window_past_first_tile(order, together, threads, make_cache, gen):
    """Sequence 0 (66 + 1 keys: its window starts in key tile 1) and sequence 1 (27 + 1 keys), decoded in
    both orders; the old kernel returned o = 0 for the second entry when the first was the long one (auto
    takes the thread pool here). The kernels are those of the windowed batch shape (same kernel shape)."""
    assert TOLERANCE[WINDOW_REPRO.dtype] == 1e-5
    cache, ref = make_forced_cache(make_cache, WINDOW_REPRO, threads), ReferenceCache(WINDOW_REPRO)
    sm_scale = random_sm_scale(gen, WINDOW_REPRO.head_dim)
    for seq in (0, 1):
        cache.add_sequence(seq)
        ref.add_sequence(seq)
    prefills = [{0: 66, 1: 27}] if together else [{0: 66}, {1: 27}]
    for i, batch in enumerate(prefills):
        run_forward_per_sequence(cache, ref, batch, gen, sm_scale, f"prefill {i}")
    for step in range(3):
        run_forward_per_sequence(cache, ref, {s: 1 for s in order}, gen, sm_scale, f"decode {step} {order}")
