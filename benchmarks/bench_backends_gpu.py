"""Time each attention op of a pagedkv cache per backend on one GPU: TIR vs FlashInfer, same shapes.

The ops run through the runtime (``pagedkv.create`` with ``backend="tir"`` or ``["flashinfer", "tir"]``),
so a FlashInfer time includes its adapter (the per-forward plan is done in ``begin_forward`` and not
timed, as in a model; the per-layer run is). Shapes: fp16, 32 q / 8 kv heads, head dim 128, page 16.

Cases (each times one runtime call that issues exactly one attention kernel):
* ``decode_B64_L4096``: ``cross_attention`` in a decode forward of 64 sequences of 4096 cached tokens
  (``attn_decode_paged``); GB/s = KV bytes read / time;
* ``prefill_ragged_L4096``: ``self_attention`` of a 4096-token prefill (``attn_prefill_ragged``, causal);
* ``prefill_paged_Lq512_L4096``: ``cross_attention`` of a 512-token chunk over 4096 cached tokens
  (``attn_prefill_paged``, non-causal);
* ``..._w1024_cap30`` (decode and paged prefill): the same with a sliding window of 1024 and a logits soft-cap
  of 30 (``pagedkv.testing.shapes.BENCH_OPTIONS``). A windowed cache's forwards are through forwards (new
  tokens appended first, one causal pass per sequence), so the prefill case times ``cross_attention`` of
  the 512-token chunk over 4096 + 512 keys, each query reading at most 1024; GB/s counts the keys read.
Outputs of the two backends are compared (relative error < 1e-2). Times: CUDA events, median of
``--iters`` after ``--warmup``, a 256 MB buffer written between iterations to flush L2.

GPU host:  source .gpu/bundle/activate.sh && PYTHONPATH=python:$PYTHONPATH \\
           PAGEDKV_RUNTIME_LIB=.gpu/lib/libpagedkv_runtime.so PAGEDKV_KERNEL_DIR=.gpu/kernels \\
           python3 benchmarks/bench_backends_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

HQ, HKV, D, PS = 32, 8, 128, 16
BACKENDS = {"tir": "tir", "flashinfer": ["flashinfer", "tir"]}


def make_cache(backend, batch: int, length: int, chunk: int, options: dict):
    import pagedkv

    cfg = pagedkv.KVCacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype="float16",
                                rope_mode="none", page_size=PS, max_batch_size=batch,
                                max_total_seq_len=batch * (length + chunk), prefill_chunk_size=chunk, **options)
    return pagedkv.create(cfg, backend=backend, target="cuda", device="cuda")


def fill(cache, seqs: list[int], length: int, gen) -> None:
    """Append ``length`` random tokens to each sequence (one forward per sequence)."""
    for s in seqs:
        cache.add_sequence(s)
        cache.begin_forward([s], [length])
        qkv = torch.randn(length, HQ + 2 * HKV, D, generator=gen, device="cuda", dtype=torch.float16)
        cache.attention_with_fused_qkv(0, qkv, D ** -0.5)
        cache.end_forward()


def dps(cache, name: str, inputs: list, n: int, dv: int):
    """``run()`` calling ``pagedkv.<name>`` on preallocated outputs (no allocation inside the timing);
    returns ``(o, lse)``."""
    from pagedkv.cache import _to_ffi

    o = torch.empty(n, HQ, dv, device="cuda", dtype=torch.float16)
    lse = torch.empty(n, HQ, device="cuda", dtype=torch.float32)
    args = [_to_ffi(t) for t in (*inputs, o, lse)]

    def run():
        cache._call(name, 0, D ** -0.5, *args)  # pylint: disable=protected-access
        return o, lse

    return run


def time_ms(run, iters: int, warmup: int, flush: torch.Tensor) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        flush.fill_(1.0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def case(name: str, backend, args, flush) -> dict:
    """Set up ``name`` on a cache of ``backend``; returns the timing row and the output."""
    from pagedkv.testing.shapes import BENCH_OPTIONS

    gen = torch.Generator(device="cuda").manual_seed(1234)  # same data for every backend
    sm = D ** -0.5
    options = BENCH_OPTIONS if name.endswith("_w1024_cap30") else {}
    window = options.get("sliding_window", 0)
    if name.startswith("decode_B64_L4096"):
        batch, length = 64, 4096
        cache = make_cache(backend, batch, length, 4096, options)
        fill(cache, list(range(batch)), length, gen)
        cache.begin_forward(list(range(batch)), [1] * batch)
        cache.attention_with_fused_qkv(0, torch.randn(batch, HQ + 2 * HKV, D, generator=gen, device="cuda",
                                                      dtype=torch.float16), sm)
        q = torch.randn(batch, HQ, D, generator=gen, device="cuda", dtype=torch.float16)
        op, run = "attn_decode_paged", dps(cache, "cross_attention", [q], batch, D)
        keys = min(length + 1, window) if window else length + 1
        nbytes, flops = batch * keys * HKV * D * 2 * 2, 4 * batch * keys * HQ * D
    elif name == "prefill_ragged_L4096":
        length = 4096
        cache = make_cache(backend, 1, length, length, options)
        cache.add_sequence(0)
        cache.begin_forward([0], [length])
        q, k, v = (torch.randn(length, h, D, generator=gen, device="cuda", dtype=torch.float16)
                   for h in (HQ, HKV, HKV))
        op, run = "attn_prefill_ragged", dps(cache, "self_attention", [q, k, v], length, D)
        nbytes, flops = 0, 2 * 2 * length * length // 2 * HQ * D
    else:  # prefill_paged_Lq512_L4096[_w1024_cap30]
        qlen, length = 512, 4096
        cache = make_cache(backend, 1, length, length, options)
        fill(cache, [0], length, gen)
        cache.begin_forward([0], [qlen])
        # A continuation is a through forward (with or without a window): cross_attention reads the chunk's own
        # k/v, appended by the fused call (the runtime rejects cross_attention over unwritten new tokens).
        cache.attention_with_fused_qkv(0, torch.randn(qlen, HQ + 2 * HKV, D, generator=gen, device="cuda",
                                                      dtype=torch.float16), sm)
        q = torch.randn(qlen, HQ, D, generator=gen, device="cuda", dtype=torch.float16)
        op, run = "attn_prefill_paged", dps(cache, "cross_attention", [q], qlen, D)
        if window:
            nbytes, flops = (window + qlen) * HKV * D * 2 * 2, 4 * qlen * window * HQ * D
        else:
            nbytes, flops = length * HKV * D * 2 * 2, 4 * qlen * length * HQ * D
    out = run()[0].float().clone()
    ms = time_ms(run, args.iters, args.warmup, flush)
    row = {"case": name, "op": op, "served_by": cache.op_backends[op], "ms": ms,
           "TFLOP/s": flops / ms / 1e9, "GB/s": nbytes / ms / 1e6 if nbytes else None}
    return row, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cases", nargs="*", default=["decode_B64_L4096", "prefill_ragged_L4096",
                                                   "prefill_paged_Lq512_L4096", "decode_B64_L4096_w1024_cap30",
                                                   "prefill_paged_Lq512_L4096_w1024_cap30"])
    args = ap.parse_args(argv)
    import tvm_ffi

    flush = torch.empty(64 * 1024 * 1024, dtype=torch.float32, device="cuda")
    rows = []
    with tvm_ffi.use_torch_stream():
        for name in args.cases:
            outs = {}
            for label, backend in BACKENDS.items():
                row, outs[label] = case(name, backend, args, flush)
                rows.append({**row, "backend": label})
                torch.cuda.empty_cache()
            err = float((outs["flashinfer"] - outs["tir"]).norm() / outs["tir"].norm())
            for r in rows[-2:]:
                r["rel_err_vs_tir"] = err
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["backend"]] = r
    print(f"{'case':28s} {'op':22s} {'backend':10s} {'served by':10s} {'ms':>8s} {'TFLOP/s':>8s} {'GB/s':>8s} "
          f"{'tir/this':>8s} {'err':>8s}")
    for name, per in by_case.items():
        for label, r in per.items():
            speedup = per["tir"]["ms"] / r["ms"]
            gbs = f"{r['GB/s']:8.0f}" if r["GB/s"] else f"{'-':>8s}"
            print(f"{name:28s} {r['op']:22s} {label:10s} {r['served_by']:10s} {r['ms']:8.3f} "
                  f"{r['TFLOP/s']:8.1f} {gbs} {speedup:8.2f} {r['rel_err_vs_tir']:8.1e}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "rows": rows}
    (args.out / "bench_backends_gpu.json").write_text(json.dumps(meta, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = list(by_case)
        for i, label in enumerate(BACKENDS):
            ax.bar([j + 0.4 * i for j in range(len(names))], [by_case[n][label]["ms"] for n in names], 0.4,
                   label=label)
        ax.set_xticks([j + 0.2 for j in range(len(names))], names, fontsize=7)
        ax.set_ylabel("ms (lower is better)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "bench_backends_gpu.png", dpi=120)
    except ImportError:
        print("(matplotlib not installed: no plot)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
