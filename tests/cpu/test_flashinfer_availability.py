"""FlashInfer is promised only where its modules can be built or loaded: a fa3 module needs curand's headers
to be built (or to be in the module cache already), and the answer says which is missing and how to get it;
``make install`` installs those headers with the FlashInfer path; a backend list of FlashInfer alone serves
the ops FlashInfer has no code for from TIR and says so, and an op it cannot serve names the spelling that
works. Nothing here builds a module or compiles a kernel: the build prerequisites are stood in for."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pagedkv import KVCacheConfig, backends, ops
from pagedkv.backends import NoBackendError
from pagedkv.backends import flashinfer as fib
from pagedkv.flashinfer import build
from pagedkv.flashinfer.build import FlashInferUnavailable
from pagedkv.support import main as backends_cli
from pagedkv.support import support_matrix

_REPO = Path(__file__).resolve().parents[2]
SM90 = {"kind": "cuda", "arch": "sm_90"}
SM80 = {"kind": "cuda", "arch": "sm_80"}
CFG = KVCacheConfig(num_layers=1, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype="float16")
MLA = KVCacheConfig.mla(num_layers=1, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, dtype="float16")
#: The wheel that has curand_kernel.h for CUDA 13 (written out here, not read from pagedkv).
CURAND_WHEEL = "nvidia-curand==10.4.0.35"
#: On sm_90 these ops run on fa3 modules (FlashInfer's Hopper kernels); decode runs on fa2 ones.
FA3_OPS_SM90 = ("attn_prefill_ragged", "attn_prefill_paged")
ATTENTION = ("attn_decode_paged", "attn_prefill_ragged", "attn_prefill_paged")


@pytest.fixture
def jit(monkeypatch, tmp_path):
    """A build host where flashinfer-python, nvcc and binutils are present (stood in for), with an empty module
    cache; ``jit(curand=True)`` also gives it curand's headers."""
    monkeypatch.setattr(build, "unavailable_reasons", lambda: [])
    monkeypatch.setattr(build, "toolchain", lambda: {"nvcc": "stand-in"})
    cuda = tmp_path / "cuda"
    (cuda / "include").mkdir(parents=True)
    monkeypatch.setattr("pagedkv.cuda_build.cuda_home", lambda: cuda)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDKV_FLASHINFER_FA3", raising=False)
    monkeypatch.delenv("PAGEDKV_FLASHINFER_MODULES", raising=False)

    def setup(*, curand: bool) -> None:
        inc = tmp_path / "curand"
        if curand:
            inc.mkdir(exist_ok=True)
            (inc / "curand_kernel.h").write_text("")
        monkeypatch.setattr(build, "curand_include_dir", lambda: inc if curand else None)

    return setup


def _reasons(op, cfg=CFG, target=SM90):
    return backends.get_backend("flashinfer").validate_configuration(op, cfg, target)


def test_fa3_ops_need_curand_and_the_answer_says_how_to_get_it(jit, capsys):
    jit(curand=False)
    for op in FA3_OPS_SM90:
        why = _reasons(op)
        assert len(why) == 1 and "curand_kernel.h" in why[0] and CURAND_WHEEL in why[0], why
        assert "PAGEDKV_FLASHINFER_FA3=0" in why[0]  # the other way: fa2 modules, which need no curand
    for op in (ops.MLA_ATTN_DECODE_PAGED, ops.MLA_ATTN_PREFILL_PAGED):  # mla_fa3 on sm_90
        assert any(CURAND_WHEEL in r for r in _reasons(op, MLA)), _reasons(op, MLA)
    assert _reasons("attn_decode_paged") == []  # fa2 decode modules build without curand
    assert all(_reasons(op, target=SM80) == [] for op in ATTENTION)  # fa2 everywhere off Hopper
    _, auto = support_matrix(CFG, SM90)
    assert {op: auto[op] for op in ATTENTION} == {"attn_decode_paged": "flashinfer", "attn_prefill_ragged": "tir",
                                                  "attn_prefill_paged": "tir"}
    # pagedkv backends says the same, and still exits 0: TIR serves those ops
    assert backends_cli(["--target", json.dumps(SM90)]) == 0
    out = capsys.readouterr().out
    block = out[out.index("attn_prefill_ragged: automatic selection -> tir"):]
    assert "flashinfer   cannot: module prefill_fa3 needs curand_kernel.h" in block.split("\n\n")[0]
    # with the headers, every attention op is FlashInfer's
    jit(curand=True)
    assert all(_reasons(op) == [] for op in ATTENTION)
    assert {op: support_matrix(CFG, SM90)[1][op] for op in ATTENTION} == dict.fromkeys(ATTENTION, "flashinfer")


def test_a_cached_fa3_module_serves_without_curand(jit):
    jit(curand=False)
    (spec,) = fib.module_specs("attn_prefill_ragged", CFG, "sm_90")
    assert spec.kind == "prefill_fa3"
    entry = Path(build.cache_root()) / spec.content_key({"nvcc": "stand-in"})  # a finished cache entry
    entry.mkdir(parents=True)
    (entry / "module.o").write_bytes(b"\0")
    (entry / "module.json").write_text(json.dumps({"functions": {"plan": "p"}, "seconds": 1.0}))
    assert build.module_unavailable_reasons(spec) == []
    assert all(_reasons(op) == [] for op in FA3_OPS_SM90)  # ragged and paged prefill share the module
    assert any(CURAND_WHEEL in r for r in _reasons(ops.MLA_ATTN_DECODE_PAGED, MLA))  # mla_fa3: not cached


def test_building_fa3_without_curand_says_so_before_any_work(jit):
    jit(curand=False)
    (spec,) = fib.module_specs("attn_prefill_ragged", CFG, "sm_90")
    lines = []
    with pytest.raises(FlashInferUnavailable, match=CURAND_WHEEL.replace(".", r"\.")):
        build.build_module(spec, jobs=1, log=lines.append)
    assert lines and "not in the cache, building" in lines[0] and "minutes" in lines[0]


def test_flashinfer_alone_serves_the_other_ops_from_tir_and_says_so(jit, capsys):
    jit(curand=True)
    res = backends.resolve(CFG, SM90, "flashinfer")
    others = [op for op in ops.ops_for(CFG) if op not in ATTENTION]
    assert res.choice == {**dict.fromkeys(others, "tir"), **dict.fromkeys(ATTENTION, "flashinfer")}
    assert res.filled == dict.fromkeys(others, ("flashinfer",))
    note = capsys.readouterr().out
    assert all(op in note for op in others) and "backend=['flashinfer', 'tir']" in note
    assert backends.resolve(CFG, SM90, ["flashinfer", "tir"]).choice == res.choice  # the explicit spelling
    assert capsys.readouterr().out == ""  # nothing filled, nothing said
    # an op flashinfer implements but cannot serve here is an error naming the spelling that works, not filled
    jit(curand=False)
    with pytest.raises(NoBackendError, match=r"'attn_prefill_ragged'(.|\n)*backend=\['flashinfer', 'tir'\]"):
        backends.resolve(CFG, SM90, "flashinfer")
    with pytest.raises(NoBackendError, match=r"backend=\['flashinfer', 'tir'\]"):
        backends.resolve(CFG, "llvm", "flashinfer")
    # an op a mapping names explicitly is never filled either
    with pytest.raises(NoBackendError, match=r"backend=\{'split_rotary': \['flashinfer', 'tir'\]\}"):
        backends.resolve(CFG, SM90, {"split_rotary": "flashinfer"})


def test_make_install_installs_curand_with_the_flashinfer_path(tmp_path):
    """The deps rule (what `make install` runs first) installs the curand wheel exactly when FLASHINFER is on,
    and `make gpu-bundle`'s own deps rule still installs it. pip is echoed, not run."""
    def pip_lines(target: str, flashinfer: str) -> list[str]:
        venv = tmp_path / f"venv{flashinfer}"
        venv.mkdir(exist_ok=True)
        out = subprocess.run(["make", "-s", "-C", str(_REPO), f"VENV={venv}", "PY=/bin/true", "PIP=echo pip",
                              f"FLASHINFER={flashinfer}", f"{venv}/{target}"],
                             capture_output=True, text=True, check=True).stdout
        return [line for line in out.splitlines() if line.startswith("pip install")]

    assert any(CURAND_WHEEL in line for line in pip_lines(".deps-installed", "1"))
    assert not any("curand" in line for line in pip_lines(".deps-installed", "0"))
    assert any(CURAND_WHEEL in line for line in pip_lines(".gpu-deps-installed", "0"))
    assert build.CURAND_SPEC == CURAND_WHEEL  # what the reasons tell users to install is what make installs
