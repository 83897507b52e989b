"""CUDA-graph decode on the GPU: a small random Llama (``pagedkv.testing.graph_case``) compiled with and without
``cuda_graph_batch`` per backend (``make gpu-bundle`` -> ``.gpu/models/graph-llama-float16[-flashinfer][-graph]
-cuda.so`` + ``graph-llama.npz``), loaded with the TVM runtime only, plays a scenario whose page tables change
between decode steps (pages filled and taken, forks, removals, popn, new sequences), every step's logits
against HF transformers in float32 with the same weights (relative error under 1e-2, the fp16 rule).

With graphs, the first decode step of a batch size captures the step (the cache's attention entry points run
twice: TVM's warm-up and the capture) and every later step of that size replays it: no attention entry point
runs, though the replay reads new page tables, positions and lengths. Without graphs every step calls them
once per layer."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pagedkv.testing import graph_case as G  # noqa: E402

MODEL_DIR = Path(os.environ.get("PAGEDKV_MODEL_DIR", ".gpu/models"))
TOL = 1e-2


def _lib(backend: str, graph: bool) -> Path:
    from pagedkv.apps.gpu_bundle import model_name

    lib = MODEL_DIR / model_name("graph-llama", "float16", backend, graph)
    if not lib.exists():
        pytest.skip(f"no CUDA model library at {lib} (make gpu-bundle builds it)")
    return lib


def _run(lib: Path, seed: int):
    import pagedkv  # noqa: F401 (the runtime's globals)
    from pagedkv.engine import Engine, param_names
    from pagedkv.models.llama_params import params_from_hf

    hf = G.load_hf(MODEL_DIR / "graph-llama.npz", "cuda")
    params = params_from_hf(hf, param_names(lib), "float16")
    engine = Engine(str(lib), params, device="cuda", max_batch_size=G.GRAPH_BATCH, max_total_seq_len=1024,
                    prefill_chunk_size=64, page_size=16)
    return G.run_scenario(engine, hf, seed)


@pytest.mark.parametrize("backend", ["tir", "flashinfer"])
@pytest.mark.parametrize("graph", [False, True], ids=["plain", "graph"])
def test_decode_replays_match_transformers(backend, graph):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    results = _run(_lib(backend, graph), seed)
    layers = G.CONFIG.num_hidden_layers
    bad = [r for r in results if not r.rel_err < TOL]
    assert not bad, f"seed {seed}: steps over {TOL}: " + "; ".join(f"{r.what}: {r.rel_err:.2e}" for r in bad[:6])
    seen: set[int] = set()
    for r in results:
        if not r.what.startswith("decode"):
            continue
        if not graph:
            assert r.attention_calls == layers, f"{r.what}: {r.attention_calls} attention calls"
        elif r.batch in seen:
            assert r.attention_calls == 0, f"{r.what}: a replay ran {r.attention_calls} attention calls"
        else:
            assert r.attention_calls == 2 * layers, f"{r.what}: capture made {r.attention_calls} calls"
        seen.add(r.batch)
    worst = max(r.rel_err for r in results)
    print(f"[graph case] {backend} {'graph' if graph else 'plain'}: {len(results)} steps, worst rel err "
          f"{worst:.2e}, batch sizes {sorted(seen)}")
