"""The GPU benchmark's own plumbing on the CPU (``benchmarks/bench_gpu.py``): its workloads, inputs and
float32 reference, and the pagedkv and torch SDPA implementations it times, on small instances of each
workload kind through a CPU cache (TIR kernels) -- so a wrong fill, reservation or chunk merge in the
benchmark shows up here, not as a WRONG row on the GPU host."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _bench_impls as impls  # noqa: E402
import _bench_workloads as W  # noqa: E402

SMALL = [
    W.Workload("decode", "float16", 32, (40, 37, 3, 16)),
    W.Workload("decode", "float16", 64, (33,) * 2),
    W.Workload("decode", "float16", 32, (40, 37, 3, 16), rope=True),
    W.Workload("prefill", "float16", 32, (0, 0), qlen=24),
    W.Workload("prefill", "float16", 32, (45,), qlen=13),
    W.Workload("mla_decode", "float16", 16, (70, 5)),
    W.Workload("mla_prefill", "float16", 16, (70, 5), qlen=3),
]


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    monkeypatch.setattr(impls, "DEVICE", "cpu")
    monkeypatch.setattr(impls, "TARGET", "llvm")
    monkeypatch.setattr(impls, "FILL_CHUNK", 32)  # several reserving forwards, a sequence split across two


def test_workload_table():
    ws = W.workloads()
    assert len({w.name for w in ws}) == len(ws) == 66
    assert {w.kind for w in ws} == {"decode", "prefill", "mla_decode", "mla_prefill"}
    pairs = [(a.name, b.name) for a, b in W.rope_pairs(ws)]
    assert pairs == [("decode-h32-f16-B1xL32768", "decode-h32-f16-B1xL32768-rope"),
                     ("decode-h32-f16-B64xL4096", "decode-h32-f16-B64xL4096-rope")]
    skews = [w for w in ws if "skew" in w.name]
    assert sorted({w.batch for w in skews}) == [32, 64]
    assert all(min(w.lens) == 128 and max(w.lens) == 16384 for w in skews)
    chunk = next(w for w in ws if w.kind == "prefill" and w.lens[0])
    assert chunk.keys == [4096 + 512]
    assert chunk.flops() == 4.0 * 32 * 128 * (512 * 4096 + 512 * 513 // 2)
    mla = next(w for w in ws if w.kind == "mla_prefill" and w.hq == 128)
    assert mla.name == "mla_prefill-h128-f16-1x512+4096" and mla.keys == [4096]  # the cached latents only
    assert mla.flops() == 2.0 * 128 * (576 + 512) * 4096 * 512


def test_every_workload_fits_its_cache():
    """The cache of each benchmark workload holds its sequences once the forward's tokens are in (the runtime's
    pages: ``KVCacheConfig.num_pages``); the MLA prefill appends ``qlen`` tokens a sequence beyond the cached keys
    its paged pass reads (its 1 x 512 + 4096 rows ran out of pages on the GPU)."""
    for w in W.workloads():
        c = impls.pagedkv_config(w)
        assert sum(-(-n // c.page_size) for n in w.held) <= c.num_pages, w.name
        assert w.held == ([n + w.qlen for n in w.lens] if w.kind == "mla_prefill" else w.keys)


@pytest.mark.parametrize("w", SMALL, ids=[w.name for w in SMALL])
def test_pagedkv_and_sdpa_match_the_reference(w, gen):
    x = W.make_inputs(w, gen, device="cpu")
    ref = W.reference(w, x)
    assert torch.isfinite(ref).all()
    run, cache = impls.pagedkv_impl("pagedkv-tir", w, x)
    out = run()
    assert W.rel_err(out, ref) < 1e-2, W.rel_err(out, ref)
    out2 = run()  # timed runs repeat the call: same result
    assert torch.equal(out, out2)
    cache.abort_forward()  # the timed forward runs one call, not every layer's k/v (end_forward would reject it)
    if w.dense_ok() and w.kind == "decode":
        assert W.rel_err(impls.sdpa_impl(w, x)(), ref) < 1e-2


def test_rope_workloads_are_tir_only(gen):
    """Inline-RoPE rows: pagedkv-tir only, every other column says n/a."""
    w = SMALL[2]
    x = W.make_inputs(w, gen, device="cpu")
    for build in (lambda: impls.fi_impl(None, "fi:decode", w, x), lambda: impls.upstream_impl({}, w, x),
                  lambda: impls.sdpa_impl(w, x), lambda: impls.pagedkv_impl("pagedkv-fi", w, x)):
        with pytest.raises(impls.Unavailable, match="inline RoPE"):
            build()


def test_tc_decode_column_is_plain_mha_decode_only():
    """``pagedkv-tir-tcd`` (the tensor-core decode forced) has a column on the plain MHA decode rows only, and
    on every one of the benchmark's (their shapes are within ``tc_decode_limits``)."""
    label = "pagedkv-tir-tcd"
    assert impls.PAGEDKV_PATHS[label] == {"cuda_decode_kernel": "tc"}
    for w in SMALL:
        why = impls.pagedkv_unavailable(label, w)
        assert (why is None) == (w.kind == "decode" and not w.rope), (w.name, why)
    assert all(impls.pagedkv_unavailable(label, w) is None for w in W.workloads()
               if w.kind == "decode" and not w.rope)


def test_columns_are_decided_without_the_kernels():
    """Which column a workload has is decided without ``pagedkv.tir_kernels`` (TVMScript), which the GPU host's
    runtime-only TVM cannot import: the first H200 run of ``pagedkv-tir-tcd`` failed every row on that import."""
    import subprocess

    code = ("import sys; sys.modules['pagedkv.tir_kernels'] = None; sys.path.insert(0, 'benchmarks'); "
            "import _bench_impls as impls, _bench_workloads as W; "
            "n = sum(impls.pagedkv_unavailable(label, w) is None for w in W.workloads() "
            "for label in impls.PAGEDKV_BACKENDS); print(n)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) > 0


@pytest.mark.parametrize("label,kernel", [("pagedkv-tir-mlatc", "tc"), ("pagedkv-tir-mlawgq", "wgq")])
def test_mla_tc_column_is_mla_decode_only(label, kernel):
    """``pagedkv-tir-mlatc`` / ``-mlawgq`` (the mma.sync / wgmma MLA decode forced) have a column on every MLA
    decode row and no other."""
    assert impls.PAGEDKV_PATHS[label] == {"cuda_mla_decode_kernel": kernel}
    for w in W.workloads():
        why = impls.pagedkv_unavailable(label, w)
        assert (why is None) == (w.kind == "mla_decode"), (w.name, why)


@pytest.mark.parametrize("kernel", ["simt", "tc", "wgq"])
def test_mla_prefill_columns_are_mla_prefill_only(kernel):
    """``pagedkv-tir-mlap<kernel>`` (that MLA prefill kernel forced) has a column on every MLA prefill row and no
    other."""
    label = f"pagedkv-tir-mlap{kernel}"
    assert impls.PAGEDKV_PATHS[label] == {"cuda_mla_prefill_kernel": kernel}
    for w in W.workloads():
        why = impls.pagedkv_unavailable(label, w)
        assert (why is None) == (w.kind == "mla_prefill"), (w.name, why)


def test_rope_reference_rotates(gen):
    """The RoPE reference is not the plain one (its q and k are rotated)."""
    w = SMALL[2]
    x = W.make_inputs(w, gen, device="cpu")
    assert W.rel_err(W.reference(w, x), W.reference(w.plain, x)) > 1e-2


def test_paged_layout_holds_the_dense_kv(gen):
    w = SMALL[0]
    x = W.make_inputs(w, gen, device="cpu")
    for b, n in enumerate(w.keys):
        pages = x.indices[x.indptr[b]:x.indptr[b + 1]].long()
        k = x.pages[pages, 0].transpose(1, 2).reshape(-1, W.HKV, W.D)[:n]
        assert torch.equal(k, x.k[b])
        assert n == (len(pages) - 1) * W.PS + int(x.last[b])


def test_rope_ratio_rows(capsys):
    """bench_gpu prints inline / plain of the TIR rows of each pair (n/a when a side has no time)."""
    import bench_gpu

    ws = [w for w in W.workloads(("float16",)) if "B64xL4096" in w.name and w.hq == 32]
    rows = [{"workload": ws[0].name, "impl": "pagedkv-tir", "ms": 0.2},
            {"workload": ws[1].name, "impl": "pagedkv-tir", "ms": 0.23},
            {"workload": ws[1].name, "impl": "pagedkv-fi", "ms": 9.0}]
    (r,) = bench_gpu.rope_ratios(rows, ws)
    assert (r["plain"], r["rope"]) == ("decode-h32-f16-B64xL4096", "decode-h32-f16-B64xL4096-rope")
    assert abs(r["ratio"] - 1.15) < 1e-9
    assert "1.150x" in capsys.readouterr().out
    assert bench_gpu.rope_ratios(rows[:1], ws)[0]["ratio"] is None


def test_begin_forward_split_runs():
    """The host-cost benchmark's 1-layer ``begin_forward`` timing, with both backend labels (on the CPU the
    FlashInfer label's priority list is served by TIR)."""
    import _host_cost

    times = _host_cost.begin_forward_split(3, 40, steps=4)
    assert set(times) == {"pagedkv-tir", "pagedkv-fi"} and all(t > 0 for t in times.values())


def test_fi_best_reads_the_cached_keys_where_they_are():
    """On a chunk over cached tokens, FlashInfer's ragged variants (over a contiguous copy of every key) are
    timed but are not the yardstick; on whole prompts and decode every variant counts."""
    chunk = next(w for w in W.workloads(("float16",)) if w.kind == "prefill" and any(w.lens))
    prompt = next(w for w in W.workloads(("float16",)) if w.kind == "prefill" and not any(w.lens))
    decode = next(w for w in W.workloads(("float16",)) if w.kind == "decode")
    assert [v for v in impls.fi_variants(chunk) if impls.fi_in_best(v, chunk)] == ["fi:paged-fa2", "fi:paged-fa3"]
    assert all(impls.fi_in_best(v, prompt) for v in impls.fi_variants(prompt))
    assert all(impls.fi_in_best(v, decode) for v in impls.fi_variants(decode))


def test_summary_uses_the_counted_best_and_plots():
    import summarize_gpu

    rows = [{"workload": "c", "impl": "fi:ragged-fa3", "ms": 1.0, "TFLOPs": 9.0, "in_fi_best": False},
            {"workload": "c", "impl": "fi:paged-fa3", "ms": 2.0, "TFLOPs": 4.5, "in_fi_best": True},
            {"workload": "c", "impl": "pagedkv-fi", "ms": 2.0, "vs_fi_best": 1.0},
            {"workload": "c", "impl": "pagedkv-tir", "ms": 4.0, "vs_fi_best": 0.5}]
    table = summarize_gpu.workload_table(rows)
    assert "| c | paged-fa3 2.0000 |" in table and "| 1.000 | 0.500 |" in table
    plot = summarize_gpu.text_plot(rows, width=10).splitlines()
    assert plot[2].endswith("##########| 1.000") and plot[3].endswith("#####     | 0.500")


def test_interleaved_timing_takes_every_sample_call_by_call(monkeypatch):
    """``time_interleaved``: each runnable implementation warmed, then ``rounds * iters`` samples each, its
    calls interleaved with the others' (no implementation runs twice in a row within a pass) in an order that
    changes; one that raises while timed gets an error status and the others go on."""
    import argparse
    import types

    import bench_gpu

    clock, calls = [0.0], []

    class Event:
        def __init__(self, **_):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(bench_gpu.torch, "cuda", types.SimpleNamespace(Event=Event, synchronize=lambda: None))

    def impl(name, ms, fail_after=None):
        def run():
            calls.append(name)
            if fail_after is not None and calls.count(name) > fail_after:
                raise RuntimeError("lost")
            clock[0] += ms
        return {"workload": "w", "impl": name}, run, None

    prepared = [impl("a", 1.0), impl("b", 2.0), impl("c", 3.0, fail_after=6), ({"impl": "d", "status": "n/a"}, None, None)]
    args = argparse.Namespace(rounds=3, iters=4, warmup=2)
    monkeypatch.setattr(bench_gpu, "warm", lambda run, n: [run() for _ in range(n)])
    bench_gpu.time_interleaved(prepared, args, torch.empty(4))
    rows = {row["impl"]: row for row, _, _ in prepared}
    assert rows["a"]["ms"] == 1.0 and rows["a"]["samples"] == 12
    assert rows["b"]["ms"] == 2.0 and rows["b"]["samples"] == 12
    assert rows["c"]["status"].startswith("error: RuntimeError") and "ms" not in rows["c"]
    assert rows["d"] == {"impl": "d", "status": "n/a"}
    timed = [n for n in calls[6:] if n != "c"]  # after the warm-up calls
    passes = [tuple(timed[i:i + 2]) for i in range(0, len(timed), 2)]
    assert all(sorted(p) == ["a", "b"] for p in passes) and len(set(passes)) == 2


def test_cache_targets_on_cuda(monkeypatch):
    """On a CUDA target every column (TIR auto and forced tiles, FlashInfer) builds for the one canonical Hopper
    target; the host-cost rows take the same targets (their libraries are the bundle's)."""
    import inspect

    import _host_cost

    from pagedkv.target import canonical

    monkeypatch.setattr(impls, "TARGET", {"kind": "cuda", "arch": "sm_90"})
    for label in impls.PAGEDKV_BACKENDS:
        assert canonical(impls.cache_target(label))["arch"] == "sm_90a", label
    assert "impls.TARGET" not in inspect.getsource(_host_cost.begin_forward_split)
