"""Time pagedkv's CUDA attention kernels against apache-tvm 0.27's own CUDA TIR kernels, torch SDPA and the
device-to-device copy bandwidth on one GPU (built for the H200: fp16, 32 q / 8 kv heads, head dim 128, page 16).

Cases:
* ``decode_B64_L4096``, ``decode_B1_L32768``: paged decode (``attn_decode_paged``), one query per sequence,
  pages shuffled in the pool; plus a device-to-device copy of the KV byte count (GB/s counts read + write,
  so a kernel's GB/s = KV bytes / time over the copy's GB/s is its fraction of the copy bandwidth);
* ``prefill_ragged_L4096``: causal ragged prefill of 4096 tokens (TFLOP/s with 2*2*L*L/2*Hq*D FLOPs);
* ``prefill_paged_Lq512_L4096``: 512 queries over 4096 cached tokens, non-causal (``attn_prefill_paged``).

Each output is checked against torch SDPA in float32 (relative error < 1e-2). Times: CUDA events on torch's
current stream (TVM launches on it too: ``tvm_ffi.use_torch_stream``), median of ``--iters`` after
``--warmup``, a 256 MB buffer written between iterations to flush L2. Each case runs in its own process
(a faulting kernel cannot take the other cases down); within a case: copy, SDPA, upstream, ours.

GPU host:  source .gpu/bundle/activate.sh && PYTHONPATH=python:$PYTHONPATH \\
           PAGEDKV_RUNTIME_LIB=.gpu/lib/libpagedkv_runtime.so python3 benchmarks/bench_gpu_kernels.py \\
           --bundle .gpu --out $OUT
Build host: ``--dry-run`` builds every input on the CPU and calls each kernel with tensors that claim to be
on cuda:0, so the compiled host code checks every argument and stops at the first CUDA call.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

import _gpu_bench_support as sup
from _gpu_bench_support import D, HKV, HQ, PS

SM_SCALE = D ** -0.5
TOL = 1e-2
CASES = ("decode_B64_L4096", "decode_B1_L32768", "prefill_ragged_L4096", "prefill_paged_Lq512_L4096")


@dataclass
class Ctx:
    device: str
    dry: bool
    iters: int
    warmup: int
    funcs: dict = field(default_factory=dict)
    keep: list = field(default_factory=list)  # dry run: the fake tensors must outlive the calls
    flush: torch.Tensor | None = None

    def ffi(self, t):
        import tvm_ffi

        if self.dry:
            fake = sup.FakeCudaTensor(t)
            self.keep.append(fake)
            return tvm_ffi.from_dlpack(fake)
        return tvm_ffi.from_dlpack(t)

    def randn(self, *shape):
        return torch.randn(*shape, dtype=torch.float16, device=self.device)

    def ints(self, values):
        return torch.as_tensor(values, dtype=torch.int32).to(self.device)


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------
def paged_kv(ctx: Ctx, batch: int, length: int) -> dict:
    """``batch`` sequences of ``length`` tokens on shuffled pages, and the same K/V dense ``[B, Hkv, L, D]``."""
    per = -(-length // PS)
    pool = batch * per + 1
    pages = ctx.randn(pool, 2, HKV, PS, D)
    values = torch.randperm(pool, device=ctx.device)[: batch * per].to(torch.int32)
    seq = pages[values.long()].view(batch, per, 2, HKV, PS, D).permute(0, 2, 3, 1, 4, 5)
    kv = seq.reshape(batch, 2, HKV, per * PS, D)[:, :, :, :length]
    return {"pages": pages, "values": values, "indptr": ctx.ints([i * per for i in range(batch + 1)]),
            "last": ctx.ints([length - (per - 1) * PS] * batch),
            "k": kv[:, 0].contiguous(), "v": kv[:, 1].contiguous()}


def kernel_impl(ctx: Ctx, who: str, op: str, tensors: list, scalars: tuple, out: torch.Tensor, **facts):
    """A runner calling ``ctx.funcs[who][op]`` with prebuilt FFI arguments, returning ``out`` (rows);
    ``facts``: what the runtime would add for the function's adapter kind (``max_kv_len``)."""
    fn = ctx.funcs.get(who, {}).get(op, KeyError(f"{who}: no function for {op}"))
    if isinstance(fn, Exception):
        return fn
    args = [ctx.ffi(t) for t in tensors] + list(scalars)
    return lambda: (fn(*args, **facts), out)[1]


def sdpa_impl(q4, k4, v4, causal: bool):
    """torch SDPA on dense ``[B, H, L, D]`` tensors; returns rows ``[B * Lq, Hq, D]``."""
    def run():
        o = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, scale=SM_SCALE,
                                                              enable_gqa=True)
        return o.transpose(1, 2).reshape(-1, HQ, D)
    return run


def reference(q4, k4, v4, causal: bool, chunk: int = 8):
    """float32 SDPA, ``chunk`` batch entries at a time, as rows ``[B * Lq, Hq, D]``."""
    outs = [sdpa_impl(q4[i:i + chunk].float(), k4[i:i + chunk].float(), v4[i:i + chunk].float(), causal)()
            for i in range(0, q4.shape[0], chunk)]
    return torch.cat(outs)


def copy_impl(ctx: Ctx, nbytes: int):
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    return lambda: (dst.copy_(src), None)[1]


# --------------------------------------------------------------------------------------------------
# cases: (kv bytes, flops, dense q4/k4/v4 + causal for SDPA and the reference, impls)
# --------------------------------------------------------------------------------------------------
def case_decode(ctx: Ctx, batch: int, length: int):
    kv = paged_kv(ctx, batch, length)
    q = ctx.randn(batch, HQ, D)
    zero = ctx.ints([0] * batch)
    nbytes = 2 * batch * length * HKV * D * 2
    impls = {"copy": copy_impl(ctx, nbytes), "torch_sdpa": sdpa_impl(q.unsqueeze(2), kv["k"], kv["v"], False)}
    for who in ("upstream", "ours"):  # same argument order (ABI of attn_decode_paged)
        o = torch.zeros(batch, HQ, D, dtype=torch.float16, device=ctx.device)
        lse = torch.zeros(batch, HQ, dtype=torch.float32, device=ctx.device)
        impls[who] = kernel_impl(ctx, who, "attn_decode_paged",
                                 [q, kv["pages"], kv["indptr"], kv["values"], kv["last"], zero, zero, o, lse],
                                 (0, 1.0, 1e4, SM_SCALE), o, max_kv_len=length)
    return nbytes, 0.0, (q.unsqueeze(2), kv["k"], kv["v"], False), impls


def case_prefill_ragged(ctx: Ctx, length: int):
    q, k, v = ctx.randn(length, HQ, D), ctx.randn(length, HKV, D), ctx.randn(length, HKV, D)
    indptr, pos, zero = ctx.ints([0, length]), ctx.ints(list(range(length))), ctx.ints([0])
    dense = tuple(x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v)) + (True,)
    impls = {"torch_sdpa": sdpa_impl(*dense)}
    out = {w: (torch.zeros(length, HQ, D, dtype=torch.float16, device=ctx.device),
               torch.zeros(length, HQ, dtype=torch.float32, device=ctx.device)) for w in ("upstream", "ours")}
    scalars = (1, 0, 1.0, 1e4, SM_SCALE)  # causal, no RoPE
    impls["upstream"] = kernel_impl(ctx, "upstream", "attn_prefill_ragged",
                                    [q, indptr, k, v, indptr, pos, zero, *out["upstream"]], scalars,
                                    out["upstream"][0])
    impls["ours"] = kernel_impl(ctx, "ours", "attn_prefill_ragged",
                                [q, k, v, indptr, indptr, pos, zero, *out["ours"]], scalars, out["ours"][0])
    flops = 2 * 2 * length * length / 2 * HQ * D
    return 2 * length * HKV * D * 2, flops, dense, impls


def case_prefill_paged(ctx: Ctx, qlen: int, length: int):
    kv = paged_kv(ctx, 1, length)
    q = ctx.randn(qlen, HQ, D)
    q_indptr, zero = ctx.ints([0, qlen]), ctx.ints([0])
    q_pos = ctx.ints(list(range(length, length + qlen)))
    impls = {"torch_sdpa": sdpa_impl(q.transpose(0, 1).unsqueeze(0).contiguous(), kv["k"], kv["v"], False)}
    for who in ("upstream", "ours"):  # same argument order (ABI of attn_prefill_paged)
        o = torch.zeros(qlen, HQ, D, dtype=torch.float16, device=ctx.device)
        lse = torch.zeros(qlen, HQ, dtype=torch.float32, device=ctx.device)
        impls[who] = kernel_impl(ctx, who, "attn_prefill_paged",
                                 [q, q_indptr, kv["pages"], kv["indptr"], kv["values"], kv["last"], zero, q_pos,
                                  o, lse], (0, 0, 1.0, 1e4, SM_SCALE), o)
    dense = (q.transpose(0, 1).unsqueeze(0).contiguous(), kv["k"], kv["v"], False)
    return 2 * length * HKV * D * 2, 4.0 * qlen * length * HQ * D, dense, impls


def build_case(ctx: Ctx, name: str):
    return {"decode_B64_L4096": lambda: case_decode(ctx, 64, 4096),
            "decode_B1_L32768": lambda: case_decode(ctx, 1, 32768),
            "prefill_ragged_L4096": lambda: case_prefill_ragged(ctx, 4096),
            "prefill_paged_Lq512_L4096": lambda: case_prefill_paged(ctx, 512, 4096)}[name]()


# --------------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------------
def time_ms(ctx: Ctx, run) -> float:
    """Median CUDA-event time of ``run`` (ms), L2 flushed before each iteration."""
    for _ in range(ctx.warmup):
        run()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(ctx.iters)]
    for start, end in events:
        ctx.flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def rel_err(out, ref) -> float:
    return float(torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref))


def dry_probe(run) -> str:
    """Dry run: call a kernel runner with CUDA-looking host tensors; it must fail at the first CUDA call."""
    try:
        run()
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if sup.is_launch_error(e):
            return f"dry-run OK: argument checks passed, stopped at CUDA ({first[:60]})"
        raise
    raise RuntimeError("dry-run: the kernel call returned without touching CUDA (unexpected)")


def measure_impl(ctx: Ctx, impl, ref, nbytes, flops, is_copy: bool, is_kernel: bool) -> dict:
    if isinstance(impl, Exception):
        return {"status": f"load error: {type(impl).__name__}: {impl}".replace("\n", " ")}
    if ctx.dry:
        return {"status": dry_probe(impl) if is_kernel else "dry-run: skipped (torch)"}
    row = {"status": "ok"}
    if not is_copy:
        out = impl()
        torch.cuda.synchronize()
        row["rel_err"] = rel_err(out, ref)
        if not row["rel_err"] < TOL:  # a wrong output gets no time: nobody should read one
            row["status"] = f"WRONG: rel err {row['rel_err']:.2e} >= {TOL}"
            return row
    row["ms"] = time_ms(ctx, impl)
    row["gbps"] = (2 if is_copy else 1) * nbytes / (row["ms"] * 1e6) if (is_copy or not flops) else math.nan
    row["tflops"] = flops / (row["ms"] * 1e9) if flops else math.nan
    return row


def run_case(ctx: Ctx, name: str, sink) -> list[dict]:
    """Build one case and measure every implementation; ``sink(rows)`` after each (partial results)."""
    rows: list[dict] = []
    t0 = time.perf_counter()
    try:
        nbytes, flops, dense, impls = build_case(ctx, name)
        ref = None if ctx.dry else reference(*dense)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rows.append({"case": name, "impl": "inputs", "status": f"error: {type(e).__name__}: {e}"})
        sink(rows)
        return rows
    print(f"[bench] {name}: inputs in {time.perf_counter() - t0:.1f} s", flush=True)
    for impl_name, impl in impls.items():
        try:
            with _stream(ctx):
                row = measure_impl(ctx, impl, ref, nbytes, flops, impl_name == "copy",
                                   impl_name in ("ours", "upstream"))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = {"status": f"run error: {type(e).__name__}: {e}".replace("\n", " ")[:300]}
        rows.append({"case": name, "impl": impl_name, "kv_bytes": nbytes, "flops": flops, **row})
        print(f"[bench] {name} {impl_name}: {_short(rows[-1])}", flush=True)
        sink(rows)
    return rows


def _short(row: dict) -> str:
    ms = row.get("ms")
    return (f"{ms:.4f} ms, " if ms is not None else "") + f"rel err {row.get('rel_err', math.nan):.2e}, " \
        f"{row['status']}"


def _stream(ctx: Ctx):
    import contextlib

    import tvm_ffi

    return contextlib.nullcontext() if ctx.dry else tvm_ffi.use_torch_stream()


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------
def make_ctx(args) -> tuple[Ctx, dict]:
    if args.dry_run:
        if torch.cuda.is_available():
            raise SystemExit("--dry-run is for hosts without a GPU (it hands host memory to kernels)")
        try:  # full TVM + CUDA toolkit (build host): TVM's CUDA runtime with a stub driver, so libraries load
            from pagedkv.cuda_build import enable_cuda_codegen

            print(f"[bench] {enable_cuda_codegen()}")
        except Exception as e:  # noqa: BLE001
            print(f"[bench] dry run without TVM's CUDA runtime ({e}): libraries will not load")
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU (torch.cuda.is_available() is False); use --dry-run on a CPU host")
    ctx = Ctx("cpu" if args.dry_run else "cuda", args.dry_run, args.iters, args.warmup)
    torch.manual_seed(0)
    ctx.funcs, info = sup.load_functions(args.bundle)
    if not args.dry_run:
        ctx.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return ctx, info


def child_main(args) -> int:
    ctx, _ = make_ctx(args)
    run_case(ctx, args.case, lambda rows: args.child_json.write_text(json.dumps(rows)))
    return 0


def run_isolated(args, name: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--bundle", str(args.bundle), "--out", str(args.out),
               "--iters", str(args.iters), "--warmup", str(args.warmup), "--case", name, "--child-json", str(path)]
        rc = subprocess.run(cmd + (["--dry-run"] if args.dry_run else []), timeout=args.case_timeout).returncode
        rows = json.loads(path.read_text()) if path.exists() else []
    if rc != 0:
        rows.append({"case": name, "impl": "process", "status": f"case process exited with {rc}"})
    return rows


def environment(ctx_info: dict, args) -> dict:
    env = {"torch": torch.__version__, "dry_run": args.dry_run, "iters": args.iters, "warmup": args.warmup,
           "shape": {"hq": HQ, "hkv": HKV, "d": D, "page_size": PS, "dtype": sup.DTYPE, "sm_scale": SM_SCALE},
           "libraries": ctx_info, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path(".gpu"), help="the GPU bundle (pagedkv.apps.gpu_bundle OUT)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--dry-run", action="store_true", help="CPU host: check argument plumbing, no launches")
    ap.add_argument("--no-isolate", action="store_true", help="run every case in this process")
    ap.add_argument("--case-timeout", type=int, default=300, help="seconds per case process")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--child-json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        return child_main(args)
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    ctx, info = make_ctx(args)
    print(f"[bench] libraries: {json.dumps(info, indent=1)}")
    for who, fs in ctx.funcs.items():
        for op in sup.ATTN_OPS:
            if isinstance(fs.get(op), Exception):
                print(f"[bench] {who} {op}: {type(fs[op]).__name__}: {fs[op]}")
    rows = []
    for name in cases:
        rows += run_case(ctx, name, lambda r: None) if args.no_isolate else run_isolated(args, name)
    sup.add_ratios(rows)
    print()
    sup.print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_gpu_kernels" + ("_dryrun" if args.dry_run else "")
    (args.out / f"{stem}.json").write_text(json.dumps({"environment": environment(info, args), "rows": rows},
                                                      indent=1, default=str))
    sup.write_plot(rows, args.out / f"{stem}.png")
    print(f"[bench] wrote {args.out / stem}.json and .png")
    return report_failures(rows, dry=args.dry_run)


def report_failures(rows: list[dict], *, dry: bool) -> int:
    """1 when any kernel of ours or a peer gave a wrong output, failed to run or (dry run) failed its
    argument checks, so a benchmark that measured nothing right never exits 0; else 0."""
    bad = [r for r in rows if not str(r.get("status", "")).startswith(("ok", "dry-run"))]
    for r in bad:
        print(f"[bench] FAILED {r.get('case')} {r.get('impl')}: {r.get('status')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
