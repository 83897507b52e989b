"""One-process GPU attention benchmark: pagedkv (FlashInfer and TIR backends; the TIR one also with each tensor-core prefill tile forced, ``pagedkv-tir-tc*``, and the tensor-core decode, ``pagedkv-tir-tcd``) side by side with FlashInfer
0.7.4's own Python API (every variant), apache-tvm 0.27's own TIR kernels and torch SDPA, against the
device's ceilings, every output checked against a float32 reference in the same run.

Workloads (``_bench_workloads.workloads``): decode 32/8/128 and 64/8/128 at B x L = 1x32K, 16x4K, 32x4K, 64x4K,
64x8K, 256x2K and two skewed batches (32 and 64 entries of 128 ... 16K), and inline-RoPE twins of 32/8/128 fp16 at 64x4K and 1x32K
(TIR backend only; the time ratio inline / plain is printed after the table); causal prefill (ragged and paged peers) at 1x4K, 16x1K,
1x16K and a 512-token chunk over 4K cached; MLA decode (DeepSeek latent) at 128 and 16 heads, B 64/128 x
L 1K/8K, and the MLA prefill's paged pass (1 x 512 new tokens over 4K cached latents, 8 x 128 over 2K; the SIMT,
mma.sync and wgmma kernels forced beside auto: ``pagedkv-tir-mlap{simt,tc,wgq}``); fp16 and bf16. Implementations: ``_bench_impls``. Ceilings: device-to-device copy bandwidth
(decode: KV bytes / time against it) and a bf16 matmul (prefill and MLA: TFLOP/s against it).

Columns: time (median of CUDA-event timings, L2 flushed before each, the calls of a workload's
implementations interleaved one by one in random order: ``time_interleaved``), TB/s (decode: KV bytes read / time) or
TFLOP/s, ratio to FlashInfer's best variant on that workload (its time / this time: >= 1 is as fast; on the
chunk over a cache, the variants that read the cached keys from pages: ``_bench_impls.fi_in_best``), ratio
to the ceiling. A wrong output (relative error >= 1e-2) gets no time, and the run exits non-zero; so does a
pagedkv implementation that fails. Also the host cost of a decode step (``--host-cost``): ``begin_forward``
(with FlashInfer's plans) and the per-layer dispatch of a 32-layer 32/8/128 cache at B = 1, 64, 256.

GPU host (``make bench-gpu`` runs it from the bench bundle built by ``make bench-bundle``)::

    source .gpu-bench/bundle/activate.sh && PYTHONPATH=python:benchmarks:$PYTHONPATH \\
      PAGEDKV_RUNTIME_LIB=.gpu-bench/lib/libpagedkv_runtime.so PAGEDKV_KERNEL_DIR=.gpu-bench/kernels \\
      python3 benchmarks/bench_gpu.py --bundle .gpu-bench --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import _bench_impls as impls
import _bench_workloads as W
from _host_cost import graph_host_cost, host_cost

TOL = 1e-2


def warm(run, calls: int, min_ms: float = 100.0) -> None:
    """At least ``calls`` calls of ``run`` and at least ``min_ms`` of them, so that the clocks have settled
    on this implementation's load (a long kernel timed right after a lighter one runs faster at first)."""
    t0, n = time.perf_counter(), 0
    while n < calls or (time.perf_counter() - t0) * 1e3 < min_ms:
        run()
        n += 1
        if n % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def time_samples(run, iters: int, warmup: int, flush: torch.Tensor) -> list[float]:
    """``iters`` CUDA-event timings (ms) of ``run``, each after an L2 flush, after ``warm``."""
    warm(run, warmup)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def time_ms(run, iters: int, warmup: int, flush: torch.Tensor) -> float:
    return statistics.median(time_samples(run, iters, warmup, flush))


def ceilings(flush) -> dict:
    """Device memory bandwidth (a 1 GiB device-to-device copy: bytes read + written per second; decode only
    reads, so KV bytes / time over this is its share of the memory roof) and bf16 matmul TFLOP/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 20, 3, flush)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm = time_ms(lambda: a @ b, 20, 3, flush)
    return {"copy_TBps": 2 * (1 << 30) / ms / 1e9, "bf16_matmul_TFLOPs": 2 * 8192 ** 3 / mm / 1e9}


def _no_flashinfer():
    raise impls.Unavailable("flashinfer is not importable here")


def _builders(w: W.Workload, x: W.Inputs, fi, upstream: dict) -> dict:
    """impl name -> ``build() -> (run, cache or None)``, in the order they are measured."""
    out = {}
    for v in impls.fi_variants(w):
        out[v] = (lambda v=v: (impls.fi_impl(fi, v, w, x), None)) if fi is not None else _no_flashinfer
    for label in impls.PAGEDKV_BACKENDS:
        out[label] = lambda label=label: impls.pagedkv_impl(label, w, x)
    out["upstream"] = lambda: (impls.upstream_impl(upstream, w, x), None)
    out["torch-sdpa"] = lambda: (impls.sdpa_impl(w, x), None)
    return out


def prepare(w: W.Workload, name: str, build, ref) -> tuple[dict, object, object]:
    """(row, run or None, cache or None): builds the implementation and checks its output; ``run`` is None
    when it does not apply, failed or was wrong (the row's status says which)."""
    row = {"workload": w.name, "kind": w.kind, "dtype": w.dtype, "impl": name}
    cache = None
    try:
        run, cache = build()
        out = run()
        torch.cuda.synchronize()
        row["rel_err"] = W.rel_err(out, ref)
        if not row["rel_err"] < TOL:
            row["status"] = f"WRONG: rel err {row['rel_err']:.2e} >= {TOL}"
            return row, None, cache
        if cache is not None:
            row["served_by"] = dict(cache.op_backends)
        return row, run, cache
    except impls.Unavailable as e:
        row["status"] = f"n/a: {e}"
    except Exception as e:  # noqa: BLE001
        _error(row, name, e)
    return row, None, cache


def _error(row: dict, name: str, e: Exception) -> None:
    if name.startswith("pagedkv"):
        traceback.print_exc()
    row["status"] = f"error: {type(e).__name__}: {e}".replace("\n", " ")[:300]
    print(f"[bench] {row['workload']} {name}: {row['status']}", flush=True)


def time_interleaved(prepared: list, args, flush) -> None:
    """Times every runnable implementation of a workload with their calls interleaved: after each one is
    warmed (``warm``), ``args.rounds`` rounds of ``args.iters`` passes, each pass one CUDA-event sample of
    every implementation (L2 flushed before each) in a fresh random order, and records the median of each
    one's samples.

    Why call by call: clocks and power drift over seconds and a kernel runs faster right after a lighter
    one; timing one implementation's samples as a block (or a block per round) gives every sample of that
    block the same conditions, so two runs of the same kernels differed by 3-4% (the margin the FlashInfer
    ratios are judged by). Interleaved per call, every implementation sees the same mix of conditions and
    predecessors, and its ``rounds * iters`` samples are independent draws."""
    live = [(row, run) for row, run, _ in prepared if run is not None and "status" not in row]
    for row, run in live:
        try:
            warm(run, args.warmup)
        except Exception as e:  # noqa: BLE001
            _error(row, row["impl"], e)
    live = [(row, run) for row, run in live if "status" not in row]
    samples = {id(row): [] for row, _ in live}
    rng = random.Random(0)
    for _ in range(args.rounds):
        events = []
        for _ in range(args.iters):
            for row, run in rng.sample(live, len(live)):
                if "status" in row:
                    continue
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                flush.zero_()
                start.record()
                try:
                    run()
                except Exception as e:  # noqa: BLE001
                    _error(row, row["impl"], e)
                    continue
                end.record()
                events.append((row, start, end))
        torch.cuda.synchronize()
        for row, start, end in events:
            if "status" not in row:
                samples[id(row)].append(start.elapsed_time(end))
    for row, _ in live:
        if "status" not in row:
            row["ms"], row["status"] = statistics.median(samples[id(row)]), "ok"
            row["samples"] = len(samples[id(row)])


def run_workload(w: W.Workload, fi, upstream, args, flush, ceil) -> list[dict]:
    t0 = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(hash(w.name) % (1 << 31))
    x = W.make_inputs(w, gen)
    ref = W.reference(w, x)
    prepared = [prepare(w, name, b, ref) for name, b in _builders(w, x, fi, upstream).items()]
    try:
        time_interleaved(prepared, args, flush)
    finally:
        for _, _, cache in prepared:
            if cache is not None:
                cache.abort_forward()  # the timed forward ran one call, not every layer
    rows = [row for row, _, _ in prepared]
    for r in rows:
        if r["impl"].startswith("fi:") and "ms" in r:
            r["in_fi_best"] = impls.fi_in_best(r["impl"], w)
    best = min((r["ms"] for r in rows if r.get("in_fi_best")), default=math.nan)
    for r in rows:
        if "ms" not in r:
            continue
        if w.kind == "decode":
            r["TBps"] = w.kv_bytes() / r["ms"] / 1e9
            r["vs_ceiling"] = r["TBps"] / ceil["copy_TBps"]
        else:
            r["TFLOPs"] = w.flops() / r["ms"] / 1e9
            r["vs_ceiling"] = r["TFLOPs"] / ceil["bf16_matmul_TFLOPs"]
        r["vs_fi_best"] = best / r["ms"]
        if r.get("in_fi_best") is False:
            r["status"] = "ok (reads a contiguous copy of the cached keys: not in FI best)"
    del x, ref, prepared
    torch.cuda.empty_cache()
    print(f"[bench] {w.name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'workload':34s} {'impl':14s} {'ms':>9s} {'TB/s|TF/s':>9s} {'vs FI best':>10s} {'vs ceil':>8s} "
          f"{'err':>8s}  status")
    for r in rows:
        ms = f"{r['ms']:9.4f}" if "ms" in r else f"{'-':>9s}"
        rate = r.get("TBps", r.get("TFLOPs"))
        rate = f"{rate:9.2f}" if rate is not None else f"{'-':>9s}"
        vs = f"{r['vs_fi_best']:10.3f}" if "vs_fi_best" in r else f"{'-':>10s}"
        vc = f"{r['vs_ceiling']:8.3f}" if "vs_ceiling" in r else f"{'-':>8s}"
        err = f"{r['rel_err']:8.1e}" if "rel_err" in r else f"{'-':>8s}"
        print(f"{r['workload']:34s} {r['impl']:14s} {ms} {rate} {vs} {vc} {err}  {r['status'][:60]}")


def rope_ratios(rows: list[dict], ws: list) -> list[dict]:
    """Per inline-RoPE pair: the TIR backend's time with inline RoPE over its time without (n/a when a side
    has no time)."""
    def ms(w):
        return next((r["ms"] for r in rows if r["workload"] == w.name and r["impl"] == "pagedkv-tir"
                     and "ms" in r), None)

    out = []
    for plain, rope in W.rope_pairs(ws):
        a, b = ms(plain), ms(rope)
        out.append({"plain": plain.name, "rope": rope.name, "plain_ms": a, "rope_ms": b,
                    "ratio": b / a if a and b else None})
    if out:
        print("\ninline RoPE / plain decode, pagedkv-tir:")
    for r in out:
        ratio = f"{r['ratio']:.3f}x" if r["ratio"] else "n/a"
        times = f"({r['rope_ms']:.4f} / {r['plain_ms']:.4f} ms)" if r["ratio"] else ""
        print(f"  {r['rope']:40s} {ratio} {times}")
    return out


def write_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["workload"] for r in rows}, key=[r["workload"] for r in rows].index)
    labels = [*impls.PAGEDKV_BACKENDS, "upstream", "torch-sdpa"]
    width = 0.9 / len(labels)
    fig, ax = plt.subplots(figsize=(max(10, len(names) * 0.35), 4.5))
    for i, label in enumerate(labels):
        vals = [next((r["vs_fi_best"] for r in rows if r["workload"] == n and r["impl"] == label
                      and "vs_fi_best" in r), 0.0) for n in names]
        ax.bar([j + width * i for j in range(len(names))], vals, width, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.45 for j in range(len(names))], names, rotation=90, fontsize=6)
    ax.set_ylabel("speed vs FlashInfer's best variant")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def failures(rows: list[dict]) -> list[str]:
    bad = []
    for r in rows:
        if r["status"].startswith("WRONG") or (r["impl"].startswith("pagedkv") and r["status"].startswith("error")):
            bad.append(f"{r['workload']} {r['impl']}: {r['status']}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path(".gpu-bench"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--iters", type=int, default=8, help="passes per round (one timed call of each implementation)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of --iters passes (a synchronize after each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="substring of the workload names to run")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--host-steps", type=int, default=12)
    ap.add_argument("--no-host-cost", action="store_true")
    args = ap.parse_args(argv)
    import tvm_ffi

    import _fi_peer
    import _gpu_bench_support as sup

    try:
        fi = _fi_peer.activate(args.bundle / "flashinfer")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"[bench] FlashInfer's own API is not available: {e}", flush=True)
        fi = None
    upstream = sup.load_functions(args.bundle)[0]["upstream"]
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    rows, host = [], []
    selected = [w for w in W.workloads(tuple(args.dtypes.split(","))) if args.only in w.name]
    with tvm_ffi.use_torch_stream():
        ceil = ceilings(flush)
        print(f"[bench] ceilings: {ceil}", flush=True)
        for w in selected:
            rows += run_workload(w, fi, upstream, args, flush, ceil)
        if not args.no_host_cost:
            host = host_cost(args) + graph_host_cost(args)
    print_table(rows)
    ratios = rope_ratios(rows, selected)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": torch.cuda.get_device_name(), "ceilings": ceil,
            "torch": torch.__version__, "flashinfer": getattr(fi, "__version__", None), "rows": rows,
            "host_cost": host, "rope_ratios": ratios}
    (args.out / "bench_gpu.json").write_text(json.dumps(meta, indent=1))
    write_plot(rows, args.out / "bench_gpu.png")
    bad = failures(rows)
    for b in bad:
        print(f"[bench] FAILED: {b}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
