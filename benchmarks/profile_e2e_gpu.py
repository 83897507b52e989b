"""Where a SmolLM2 step's time goes on the GPU: the CUDA kernels of a few decode steps (and one prefill) of a
model library, from torch's profiler (CUPTI sees every kernel of the process, TVM's and FlashInfer's too),
and the host phases of ``pagedkv.engine.Engine.decode``.

GPU host, from the bundle (as ``make bench-e2e-gpu``)::

    python3 benchmarks/profile_e2e_gpu.py [LIB ...] [--batch 1] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch


def _engine(lib: Path, batch: int, prompt: int, steps: int):
    import pagedkv  # noqa: F401 (the runtime's globals)
    from pagedkv.apps import smollm2
    from pagedkv.engine import Engine, param_names

    hf, _ = smollm2.load_hf(torch.float32)
    params = smollm2.params_from_hf(hf, param_names(lib), "float16")
    return Engine(str(lib), params, device="cuda", max_batch_size=max(batch, 1), prefill_chunk_size=batch * prompt,
                  max_total_seq_len=batch * (prompt + 4 * steps + 32))


def profile(lib: Path, batch: int, steps: int, prompt: int = 64) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    eng = _engine(lib, batch, prompt, steps)
    rng = np.random.default_rng(0)
    seqs = list(range(batch))
    for s in seqs:
        eng.add(s)
    eng.prefill({s: [int(t) for t in rng.integers(0, 40000, prompt)] for s in seqs})
    tok = {s: 1 for s in seqs}
    for _ in range(3):  # warm (CUDA-graph libraries capture here)
        eng.decode(tok)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.decode(tok)
    per_step = (time.perf_counter() - t0) / steps
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.decode(tok)
        torch.cuda.synchronize()
    print(f"\n=== {lib.name} batch {batch}: {per_step * 1e3:.3f} ms per decode step (wall) ===")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    # host phases of one step, synchronized at each boundary
    import tvm

    dev, phases = eng._dev, {"begin_forward": 0.0, "vm call": 0.0, "sync": 0.0, "logits to host": 0.0}
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng._g("begin_forward", tuple(tok), (1,) * batch)
        t1 = time.perf_counter()
        step = tvm.runtime.tensor(np.array([[v] for v in tok.values()], dtype="int32"), dev)
        logits, eng.cache = eng.vm["decode"](step, eng.cache, eng._params)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        logits.numpy()
        t4 = time.perf_counter()
        eng._g("end_forward")
        for k, v in zip(phases, (t1 - t, t2 - t1, t3 - t2, t4 - t3)):
            phases[k] += v / steps
    print("host phases (ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in phases.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("libs", nargs="*", type=Path)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    models = Path(os.environ.get("PAGEDKV_MODEL_DIR", ".gpu/models"))
    libs = args.libs or [models / "smollm2-float16-cuda.so", models / "smollm2-float16-graph-cuda.so"]
    for lib in libs:
        profile(lib, args.batch, args.steps)


if __name__ == "__main__":
    main()
