"""Tensor-core prefill at head dims 96 and 256 (issue 45, item 5) on the GPU host, one process: pagedkv's TIR
ragged prefill in auto's tile for the dim (``tc3`` at 96, ``tcq`` at 256: ``pagedkv.kernel_table``) and in the SIMT
FP32 kernel that served these dims before (forced), against torch SDPA (the backend torch picks: flash / cuDNN /
efficient) and, where ``flashinfer`` imports, FlashInfer's own ragged prefill; causal, at 1x4K and 16x1K tokens.

Shapes: the head dim 96 and 256 ones of ``pagedkv.testing.shapes.PREFILL_TC_SHAPES`` (their forced-tile libraries
are the GPU suite's: ``make gpu-bundle``, or ``tools/gpu_prefill_dims.py`` for these alone). Every output is
checked against SDPA computed in float32 (relative error < 1e-2: a wrong output gets no time and the exit status is
1). Timing: the median of CUDA-event timings after an L2 flush, implementations interleaved call by call.

GPU host (``.gpu`` assembled)::

    source .gpu/bundle/activate.sh && PYTHONPATH=python:benchmarks PAGEDKV_KERNEL_DIR=.gpu/kernels \\
      PAGEDKV_RUNTIME_LIB=.gpu/lib/libpagedkv_runtime.so python3 benchmarks/bench_prefill_dims_gpu.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

TARGET = {"kind": "cuda", "arch": "sm_90"}
#: (batch, tokens a sequence): the issue's 1x4K and 16x1K.
SIZES = ((1, 4096), (16, 1024))
TOL = 1e-2


def _shapes():
    from pagedkv.testing.shapes import PREFILL_TC_SHAPES

    return [s for s in PREFILL_TC_SHAPES if s.d in (96, 256) and not (s.window or s.cap)]


def _tir_prefill(shape, kernel: str):
    """``run(q, k, v, qo_indptr, o, lse, sm_scale)`` of the shape's ragged prefill in ``kernel``'s library."""
    from pagedkv.backends import resolve
    from pagedkv.backends.tir import forced_paths
    from pagedkv.cache import _compile_op_table, _to_ffi

    paths = {"cuda_prefill_kernel": kernel}
    with forced_paths(paths):
        cfg = shape.config()
        module, table = _compile_op_table(cfg, TARGET, tuple(resolve(cfg, TARGET, "tir").choice.items()))
    fn = {entry[0]: entry[-1] for entry in table}["attn_prefill_ragged"]

    def run(q, k, v, indptr, pos, o, lse, sm_scale):
        args = (q, k, v, indptr, indptr, pos, torch.zeros_like(indptr[1:]), o, lse)
        fn(*[_to_ffi(a) for a in args], 1, 0, 1.0, 10000.0, sm_scale)

    run.module = module  # keeps the library loaded
    return run


def _sdpa(q, k, v, b, n, sm_scale, *, f32=False):
    """Causal SDPA of ``b`` equal sequences of ``n`` tokens: ``[b n, H, D]`` in and out (GQA by ``enable_gqa``)."""
    def dense(x):
        return x.view(b, n, x.shape[1], x.shape[2]).transpose(1, 2)
    qd, kd, vd = (dense(x.float() if f32 else x) for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=sm_scale,
                                                         enable_gqa=True)
    return o.transpose(1, 2).reshape(b * n, q.shape[1], q.shape[2])


def _flashinfer(shape, q, k, v, indptr, sm_scale):
    """FlashInfer's ragged prefill (``fa2`` / ``fa3`` as it picks), or None where it does not import or build."""
    try:
        import flashinfer

        wrap = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD")
        wrap.plan(indptr, indptr, shape.hq, shape.hkv, shape.d, causal=True, sm_scale=sm_scale,
                  q_data_type=q.dtype, kv_data_type=k.dtype)
        out = torch.empty_like(q)
        wrap.run(q, k, v, out=out)
        return lambda: wrap.run(q, k, v, out=out)
    except Exception as e:  # noqa: BLE001 (reported as a missing column)
        print(f"  flashinfer: not run ({type(e).__name__}: {str(e)[:120]})", flush=True)
        return None


def _time(runs: dict, iters: int) -> dict:
    """Median ms of each ``run`` (interleaved, an L2 flush before each call)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for run in runs.values():
        for _ in range(3):
            run()
    times = {name: [] for name in runs}
    for _ in range(iters):
        for name, run in runs.items():
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def bench(shape, b: int, n: int, iters: int) -> list[dict]:
    """The rows of one (shape, size): each implementation's time, TFLOP/s and ratio to the best peer."""
    dt = getattr(torch, shape.dtype)
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    q, k, v = (torch.randn(b * n, h, shape.d, generator=gen, device="cuda").to(dt)
               for h in (shape.hq, shape.hkv, shape.hkv))
    indptr = torch.arange(0, b * n + 1, n, dtype=torch.int32, device="cuda")
    pos = (torch.arange(b * n, device="cuda") % n).to(torch.int32)
    sm_scale = float(shape.d) ** -0.5
    ref = _sdpa(q, k, v, b, n, sm_scale, f32=True)
    outs, runs = {}, {}
    for kernel in ("tc3" if shape.d == 96 else "tcq", "simt"):
        fn = _tir_prefill(shape, kernel)
        o = torch.full_like(q, float("nan"))
        lse = torch.empty(b * n, shape.hq, dtype=torch.float32, device="cuda")
        runs[f"pagedkv-{kernel}"] = lambda fn=fn, o=o, lse=lse: fn(q, k, v, indptr, pos, o, lse, sm_scale)
        outs[f"pagedkv-{kernel}"] = o
    sd = torch.empty_like(q)
    runs["torch-sdpa"] = lambda: sd.copy_(_sdpa(q, k, v, b, n, sm_scale))
    outs["torch-sdpa"] = sd
    fi = _flashinfer(shape, q, k, v, indptr, sm_scale)
    if fi is not None:
        runs["flashinfer"], outs["flashinfer"] = fi, None
    rows = []
    for name, run in runs.items():
        out = run() if outs[name] is None else (run(), outs[name])[1]
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        rows.append({"shape": shape.id, "size": f"{b}x{n}", "impl": name, "rel_err": err, "ok": err < TOL})
    ms = _time({r["impl"]: runs[r["impl"]] for r in rows if r["ok"]}, iters)
    flops = 4.0 * shape.hq * shape.d * b * n * (n + 1) / 2
    best_peer = min((ms[p] for p in ("torch-sdpa", "flashinfer") if p in ms), default=None)
    for r in rows:
        t = ms.get(r["impl"])
        r.update(ms=t, tflops=flops / t / 1e9 if t else None,
                 vs_best_peer=best_peer / t if t and best_peer else None)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    rows = []
    for shape in _shapes():
        for b, n in SIZES:
            rows += bench(shape, b, n, args.iters)
    print("| shape | B x L | impl | ms | TFLOP/s | x best peer | rel. err |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['size']} | {r['impl']} | "
              + (f"{r['ms']:.3f} | {r['tflops']:.0f} | " if r["ms"] else "- | - | ")
              + (f"{r['vs_best_peer']:.2f} | " if r["vs_best_peer"] else "- | ") + f"{r['rel_err']:.1e} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
