"""The GPU bundle's pieces that run on the build host: the runtime bundle (runtime-only TVM + tvm-ffi wheel,
made by the project itself, nothing from outside the checkout) and the kernel benchmark's library choice
(exactly the config it names, never another library of the bundle)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]


def test_runtime_bundle_is_runtime_only(tmp_path):
    from pagedkv.runtime_bundle import write_runtime_bundle

    try:
        out = write_runtime_bundle(tmp_path / "bundle")
    except RuntimeError as err:  # pip could not reach PyPI: say so rather than fail on the network
        pytest.skip(f"no PyPI: {err}")
    names = tarfile.open(out / "tvm_runtime.tar.xz").getnames()
    assert "tvm/lib/libtvm_runtime.so" in names and "tvm/lib/libtvm_runtime_cuda.so" in names
    assert not any(n.endswith("libtvm_compiler.so") or n.startswith(("tvm/3rdparty", "tvm/src"))
                   for n in names)
    assert len(list(out.glob("apache_tvm_ffi-*cp312*.whl"))) == 1
    site = tmp_path / "site"
    site.mkdir()
    tarfile.open(out / "tvm_runtime.tar.xz").extractall(site)
    probe = subprocess.run([sys.executable, "-c", "import tvm; print(tvm.base._RUNTIME_ONLY)"],
                           env={"PYTHONPATH": str(site), "TVM_USE_RUNTIME_LIB": "1", "PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "True"
    assert "/tmp/pagedkv-site" in (out / "activate.sh").read_text()


def test_bundle_uses_nothing_beside_the_checkout():
    for path in list((_REPO / "python").rglob("*.py")) + [_REPO / "Makefile"]:
        assert "shared/gpu-host" not in path.read_text(), f"{path} reaches outside the checkout"


def _fake_library(kernels: Path, config, target) -> Path:
    from pagedkv.cache import kernel_library_path

    lib = kernel_library_path(config, kernels, target=target, backend="tir")
    lib.parent.mkdir(parents=True, exist_ok=True)
    lib.write_bytes(b"")
    lib.with_suffix(".json").write_text(json.dumps({"config": config.to_dict(), "entries": []}))
    return lib


def test_kernel_benchmark_picks_the_config_it_names(tmp_path):
    sys.path.insert(0, str(_REPO / "benchmarks"))
    try:
        import _gpu_bench_support as sup
    finally:
        sys.path.pop(0)
    from pagedkv.testing.shapes import BENCH_WINDOWED, gpu_configs

    plain = sup.bench_config()
    assert plain.sliding_window == 0 and plain.logits_soft_cap == 0.0
    # the bundle builds the benchmark's config (same kernel shape as one of the GPU suite's configs)
    from pagedkv.cache import kernel_library_path

    want = kernel_library_path(plain, tmp_path, target=sup.TARGET, backend="tir")
    assert want in {kernel_library_path(c, tmp_path, target=sup.TARGET, backend="tir") for c in gpu_configs()}
    windowed = _fake_library(tmp_path / "kernels", BENCH_WINDOWED.config(), sup.TARGET)
    with pytest.raises(FileNotFoundError, match="no TIR kernel library"):
        sup.find_our_library(tmp_path / "kernels")  # only the windowed library: refuse, never take it
    lib = _fake_library(tmp_path / "kernels", plain, sup.TARGET)
    assert lib != windowed
    assert sup.find_our_library(tmp_path / "kernels")[0] == lib


def test_kernel_benchmark_fails_on_a_wrong_output():
    sys.path.insert(0, str(_REPO / "benchmarks"))
    try:
        import bench_gpu_kernels as bench
    finally:
        sys.path.pop(0)
    ok = [{"case": "c", "impl": "ours", "status": "ok", "ms": 1.0}]
    assert bench.report_failures(ok, dry=False) == 0
    wrong = ok + [{"case": "c", "impl": "upstream", "status": "WRONG: rel err 5.0e-01 >= 1e-2"}]
    assert bench.report_failures(wrong, dry=False) == 1
