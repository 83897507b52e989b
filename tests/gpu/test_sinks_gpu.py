"""Learnable attention sinks on CUDA (``tests/cpu/test_sinks.py`` on the GPU, ``pagedkv.testing.sinks``): every
output within tolerance of the float64 reference with the sinks, and far from the references without them and
with each counted twice, so a sink dropped or doubled by any pass structure, backend or layer kind fails.

Configs (``SINK_GPU_CONFIGS``, prebuilt by the GPU bundle): gpt-oss's attention (64 q / 8 kv heads, head dim 64,
window 128, bf16: one causal pass per sequence over more keys than the window, split-KV decodes), the fp16 prefill
shape of FlashInfer (prefix-shared passes on float32 states, the last merge ``merge_state_partial_sinks``) and
DeepSeek-V2-Lite's MLA latent (``cross_attention`` with the sinks). On TIR and, where the bundle holds its
library, on FlashInfer (its attention ops; the sink ops are TIR's: FlashInfer's ops return their lse). And
StreamingLLM sink tokens (``sink_size``) on the window kernels of both backends.
"""

from __future__ import annotations

import pytest

from pagedkv.testing.scenarios import SCENARIOS, ScenarioRunner, random_sm_scale
from pagedkv.testing.shapes import gpu_shapes
from pagedkv.testing.sinks import SINK_FLASHINFER_IDS, SINK_GPU_CONFIGS, SinkRun

GPTOSS = "gptoss-h64x8-d64-bf16-w128"
CASES = [(cid, "tir") for cid in SINK_GPU_CONFIGS]
CASES += [(cid, "flashinfer") for cid in (*SINK_FLASHINFER_IDS, GPTOSS)]


def _backend(tag: str):
    return "tir" if tag == "tir" else [tag, "tir"]


@pytest.mark.parametrize(("config_id", "backend"), CASES, ids=[f"{c}-{b}" for c, b in CASES])
def test_sinks_counted_once_gpu(config_id, backend, make_gpu_cache, gen):
    cfg = SINK_GPU_CONFIGS[config_id]
    run = SinkRun(make_gpu_cache(cfg, _backend(backend)), gen, sm_scale=0.9 / cfg.head_dim ** 0.5)
    step = run.mla if cfg.is_mla else run.fused
    run.each("add_sequence", 0)
    step({0: 100})                 # a prefill from empty (MLA: cross over nothing, the sink alone)
    step({0: 70})                  # a continuation: 170 keys, past gpt-oss's window
    for child in (1, 2):
        run.each("fork_sequence", 0, child, 160)
    step({1: 1, 2: 1})             # decode on a shared prefix (windowed: one pass a sequence, split-KV)
    run.each("add_sequence", 3)
    step({3: 40, 1: 5, 2: 3})      # a split prefill beside prefix-shared continuations
    for _ in range(3):
        step({0: 1, 1: 1, 2: 1, 3: 1})
    step({2: 1})                   # one sequence alone: the split-KV decode's most splits


#: StreamingLLM sink tokens beside the GPU suite's windowed FlashInfer shape (fp16, 32 q / 8 kv heads, head dim 128,
#: window 40, cap 3): sink_size changes no kernel, so the bundle's libraries of that shape serve it.
SINK_TOKEN_SHAPE = next(s for s in gpu_shapes() if s.d == 128 and s.window == 40)


@pytest.mark.parametrize("backend", ["tir", "flashinfer"])
@pytest.mark.parametrize("scenario", ["mixed_prefill_decode", "fork_three_deep"])
def test_sink_tokens_gpu(scenario, backend, make_gpu_cache, gen):
    """sink_size 4: the runtime's sink passes on the window kernels of each backend, against the reference."""
    cfg = SINK_TOKEN_SHAPE.config().replace(sink_size=4)
    runner = ScenarioRunner(make_gpu_cache(cfg, _backend(backend)), gen, random_sm_scale(gen, cfg.head_dim))
    runner.run(SCENARIOS[scenario](cfg.page_size), scenario)
