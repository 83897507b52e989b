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
    _step_floor(prof, steps, per_step)
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


def _step_floor(prof, steps: int, per_step: float) -> None:
    """The GPU operations of a step, their summed time, and the floor of replaying that many dependent
    kernels from one CUDA graph: a step's time in a graph cannot go below it however short each kernel is."""
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    n = round(len(gpu) / steps)
    busy = sum(getattr(e, "device_time", 0.0) or getattr(e, "cuda_time", 0.0) for e in gpu) / steps / 1e3
    floor = graph_floor(n)
    print(f"GPU ops a step: {n}, their time {busy:.3f} ms; a CUDA graph of {n} dependent one-element kernels "
          f"replays in {floor:.3f} ms ({floor / max(n, 1) * 1e3:.2f} us a node); this step {per_step * 1e3:.3f} ms "
          f"= {per_step * 1e3 / floor:.2f}x that floor")


def graph_floor(nodes: int, iters: int = 50) -> float:
    """Milliseconds of one replay of a CUDA graph of ``nodes`` dependent one-element kernels (``x += 1``)."""
    x = torch.ones(1, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm the kernel outside capture
        x.add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    want = 2 + nodes * (iters + 1)  # 1, the warm-up's +1, a node's +1 a replay
    if x.item() != want:  # every node ran
        raise SystemExit(f"graph floor: x = {x.item()}, expected {want}")
    return start.elapsed_time(end) / iters


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
