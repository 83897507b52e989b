"""``benchmarks/bench_e2e.py``'s plumbing without a model: argument defaults, the CUDA model-library lookup
(pagedkv+graphs included), the token check that keeps a wrong system's time out of the report, the ratio
table and the files written. Fake systems stand in for pagedkv and transformers, so this takes no GPU and
no GGUF file (the real run on the CPU is ``make bench-e2e``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_e2e as B  # noqa: E402
import numpy as np  # noqa: E402
from _e2e_systems import Run, greedy  # noqa: E402

BW = {"read_GBps": 100.0, "copy_GBps": 90.0}


class Tok:
    def decode(self, ids):
        return f"<{ids[0]}>"


class Fake:
    """Greedy tokens ``100 + sequence + step``; ``wrong_at`` changes one token, ``tie_at`` makes the top-2
    margin there 0.1 (1 elsewhere), ``speed`` scales the times."""

    def __init__(self, speed=1.0, wrong_at=None, tie_at=None, raises=False, flaky=False):
        self.speed, self.wrong_at, self.tie_at, self.raises, self.flaky, self.calls = \
            speed, wrong_at, tie_at, raises, flaky, 0

    def run(self, ids, n):
        self.calls += 1
        if self.raises:
            raise RuntimeError("CUDA error: an illegal memory access")
        toks = [[100 + s + k for k in range(n)] for s in range(len(ids))]
        if self.wrong_at is not None:
            toks[0][self.wrong_at] = 7
        if self.flaky and self.calls > 1:
            toks[0][0] = 8
        margins = [[0.1 if k == self.tie_at else 1.0 for k in range(n)] for _ in ids]
        return Run(toks, 0.1 / self.speed, 1.0 / self.speed, margins)


def _args(*argv):
    return B.parse_args(["--rounds", "2", "--new-tokens", "4", *argv])


def test_defaults():
    cpu, cuda = _args(), _args("--device", "cuda")
    assert (cpu.batches, cpu.dtype, cpu.tie_margin, cpu.hf_static) == ([1, 4], "float32", 0.0, False)
    assert (cuda.batches, cuda.dtype, cuda.tie_margin, cuda.hf_static) == ([1, 8, 32], "float16", 0.25, True)
    assert _args("--device", "cuda", "--no-hf-static").hf_static is False
    # half logits tie often: their runs accept a divergence below 0.25, as on CUDA, unless told otherwise
    assert (_args("--dtype", "bfloat16").tie_margin, _args("--dtype", "float16", "--tie-margin", "0").tie_margin) == (
        0.25, 0.0)
    for bad in (["--graph-lib", "g.so"], ["--batches", "1,1"], ["--new-tokens", "1"]):
        with pytest.raises(SystemExit):
            B.parse_args(bad)


def _lib(folder: Path, name: str) -> Path:
    (folder / name).write_bytes(b"")
    (folder / name).with_suffix(".json").write_text('{"param_names": []}')
    return folder / name


def test_model_libraries(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDKV_MODEL_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="smollm2-float16-cuda.so"):
        B.pagedkv_libs(_args("--device", "cuda"))
    lib = _lib(tmp_path, "smollm2-float16-cuda.so")
    assert B.pagedkv_libs(_args("--device", "cuda")) == {"pagedkv": lib}
    assert "pagedkv+graphs left out" in capsys.readouterr().out
    graphs = _lib(tmp_path, "smollm2-float16-graph-cuda.so")
    assert B.pagedkv_libs(_args("--device", "cuda")) == {"pagedkv": lib, "pagedkv+graphs": graphs}
    assert B.pagedkv_libs(_args("--device", "cuda", "--graph-lib", "none")) == {"pagedkv": lib}
    with pytest.raises(SystemExit, match="pagedkv\\+graphs: no .*other.so"):
        B.pagedkv_libs(_args("--device", "cuda", "--graph-lib", str(tmp_path / "other.so")))
    graphs.with_suffix(".json").unlink()  # the parameter order lies beside the library
    with pytest.raises(SystemExit, match="graph-cuda.json"):
        B.pagedkv_libs(_args("--device", "cuda"))
    assert B.pagedkv_libs(_args()) == {"pagedkv": None}  # the CPU compiles its own


def test_wrong_system_gets_no_time():
    systems = {"pagedkv": Fake(2.0), "pagedkv+graphs": Fake(3.0, wrong_at=2), B.REF: Fake(tie_at=1),
               "hf_static_compiled": Fake(1.5, wrong_at=1)}
    broken = set()
    runs, failed = B.measure(systems, [[1]] * 2, _args("--tie-margin", "0.25"), Tok(), broken)
    assert set(runs) == {"pagedkv", B.REF, "hf_static_compiled"}  # a divergence at a near tie is accepted
    assert list(failed) == ["pagedkv+graphs"] and "diverges at new token 2" in failed["pagedkv+graphs"][0]
    assert systems["pagedkv+graphs"].calls == 1 and not broken  # warm-up only: never timed
    assert all(len(rs) == 2 for rs in runs.values())


def test_raising_and_flaky_systems():
    systems = {"pagedkv": Fake(raises=True), B.REF: Fake(), "hf_static_compiled": Fake(flaky=True)}
    broken = set()
    runs, failed = B.measure(systems, [[1]], _args(), Tok(), broken)
    assert broken == {"pagedkv"} and "illegal memory access" in failed["pagedkv"][0]
    assert "other tokens than its warm-up" in failed["hf_static_compiled"][0]
    assert list(runs) == [B.REF]
    with pytest.raises(RuntimeError):  # without the reference nothing can be checked
        B.measure({B.REF: Fake(raises=True)}, [[1]], _args(), Tok())


def test_table_and_ratios():
    args = _args("--device", "cuda")
    runs, _ = B.measure({"pagedkv": Fake(2.0), "pagedkv+graphs": Fake(3.0), B.REF: Fake(),
                         "hf_static_compiled": Fake(1.5)}, [[1]] * 8, args, Tok())
    rows = B.summarize(runs, 8, args)
    assert rows["pagedkv"]["decode_tok_s"] == pytest.approx(8 * 3 / 0.5)
    r = B.ratios(rows)
    assert r["pagedkv+graphs / pagedkv"]["decode"] == pytest.approx(1.5)
    assert r["pagedkv / hf_static_compiled"]["prefill"] == pytest.approx(2 / 1.5)
    assert r["pagedkv+graphs / hf_eager"]["decode"] == pytest.approx(3.0)
    del rows["pagedkv+graphs"]
    failures = {8: {"pagedkv+graphs": ["pagedkv+graphs vs hf_eager: diverges"]}}
    lines = B.table({8: rows}, failures, BW, 10**8)
    text = "\n".join(lines)
    assert "| 8 | pagedkv+graphs | failed | failed | - |" in lines
    assert "pagedkv+graphs /" not in text and "| 8 | pagedkv / hf_static_compiled | 1.33x | 1.33x |" in lines
    assert "FAILED at batch 8: pagedkv+graphs vs hf_eager: diverges" in text


def test_main_writes_outputs_and_fails_on_wrong_tokens(tmp_path, monkeypatch, capsys):
    class Tokenizer(Tok):
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(200))}

    systems = {"pagedkv": Fake(2.0), "pagedkv+graphs": Fake(3.0, wrong_at=0), B.REF: Fake()}
    monkeypatch.setattr(B, "bandwidth", lambda device: BW)
    unset = {}
    monkeypatch.setattr(B, "build_systems", lambda args: (systems, Tokenizer(), 10**8, unset))
    # main sets torch's thread count: keep the session's
    args = _args("--batches", "1,2", "--out", str(tmp_path), "--threads", str(B.torch.get_num_threads()))
    assert B.main(args) == 1
    out = capsys.readouterr().out
    assert "| 1 | pagedkv+graphs | failed" in out and "| 2 | pagedkv+graphs | failed" in out
    doc = json.loads((tmp_path / "bench_e2e_cpu.json").read_text())
    assert set(doc["results"]["2"]) == {"pagedkv", B.REF} and "pagedkv+graphs" in doc["failures"]["1"]
    assert doc["ratios"]["1"]["pagedkv / hf_eager"]["decode"] == pytest.approx(2.0)
    assert (tmp_path / "bench_e2e_cpu.png").stat().st_size > 0
    assert "diverges at new token 0" in (tmp_path / "bench_e2e_cpu.md").read_text()
    del systems["pagedkv+graphs"]
    assert B.main(args) == 0
    unset["pagedkv+graphs"] = ["pagedkv+graphs: setting up g.so raised RuntimeError: no decode"]  # failed to load
    assert B.main(args) == 1
    assert "FAILED at batch 2: pagedkv+graphs: setting up g.so" in capsys.readouterr().out


def test_dtypes_mode_prints_ratios_to_the_first(tmp_path, monkeypatch, capsys):
    """``--dtypes``: one run per dtype (its own files), then pagedkv of the dtypes timed again interleaved and
    its tokens/s over the first dtype's; a dtype whose tokens are wrong gets no ratio and the run exits 1."""
    class Tokenizer(Tok):
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(200))}

    speed = {"float32": Fake(2.0), "float16": Fake(4.0), "bfloat16": Fake(3.0, wrong_at=1)}
    margins = {}

    def build(args):
        margins[args.dtype] = args.tie_margin
        return {"pagedkv": speed[args.dtype], B.REF: Fake()}, Tokenizer(), 10**8, {}

    monkeypatch.setattr(B, "bandwidth", lambda device: BW)
    monkeypatch.setattr(B, "build_systems", build)
    args = _args("--dtypes", "float32,float16,bfloat16", "--out", str(tmp_path), "--threads",
                 str(B.torch.get_num_threads()))
    assert args.dtype == "float32"
    assert B.main(args) == 1
    out = capsys.readouterr().out
    assert "pagedkv float16 / float32 at batch 1: prefill 2.00x, decode 2.00x" in out
    assert "bfloat16 / float32" not in out
    assert margins == {"float32": 0.0, "float16": 0.25, "bfloat16": 0.25}  # each dtype's own default
    doc = json.loads((tmp_path / "bench_e2e_cpu_dtypes.json").read_text())
    assert doc["ratios"]["float16 / float32"]["4"]["decode"] == pytest.approx(2.0)
    assert "bfloat16 / float32" not in doc["ratios"] and set(doc["pagedkv"]) == {"float32", "float16"}
    assert {p.name for p in tmp_path.glob("bench_e2e_cpu_*.json")} == {
        "bench_e2e_cpu_float32.json", "bench_e2e_cpu_float16.json", "bench_e2e_cpu_bfloat16.json",
        "bench_e2e_cpu_dtypes.json"}
    for bad in (["--dtypes", "float16"], ["--dtypes", "float16,float16"], ["--dtype", "float16", "--dtypes", "float32,float16"]):
        with pytest.raises(SystemExit):
            B.parse_args(bad)


def test_greedy_float16_bits_equal_argmax():
    """pagedkv's tokens are picked on the host: float16 through its bits (numpy's own float16 argmax is a
    scalar loop), which must pick what np.argmax picks: negative rows, infinities, ties (the first wins)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 4096)) * 8).astype(np.float16)
    x[1] = -5
    x[1, 100] = -0.5
    x[2] = -np.inf
    x[2, 7] = -60000
    x[3, [3, 9]] = 70
    x[4] = -3
    x[4, 5] = 0
    assert greedy(x) == np.argmax(x, -1).tolist()
    assert greedy(x.astype(np.float32)) == np.argmax(x, -1).tolist()


def test_graph_library_failing_to_load_is_reported(monkeypatch):
    """pagedkv+graphs failing to set up (a new library) costs only its own numbers; pagedkv's failure ends
    the run."""
    from pagedkv.apps import smollm2

    class HF:
        def to(self, device):
            return self

        def forward(self, input_ids=None, past_key_values=None):
            raise AssertionError("not run here")

    class Ours:
        weight_bytes = 10

        @classmethod
        def create(cls, hf, args, lib):
            if lib is not None:
                raise RuntimeError("no function decode")
            return cls()

    monkeypatch.setattr(smollm2, "load_hf", lambda dtype=None: (HF(), Tok()))
    monkeypatch.setattr(B, "pagedkv_libs", lambda args: {"pagedkv": None, "pagedkv+graphs": Path("g.so")})
    monkeypatch.setattr(B, "Ours", Ours)
    systems, _, weight_bytes, unset = B.build_systems(_args())
    assert list(systems) == ["pagedkv", B.REF] and weight_bytes == 10
    assert "setting up g.so raised RuntimeError: no function decode" in unset["pagedkv+graphs"][0]
    monkeypatch.setattr(B, "pagedkv_libs", lambda args: {"pagedkv": Path("p.so")})
    with pytest.raises(RuntimeError):
        B.build_systems(_args())
