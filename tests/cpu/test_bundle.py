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
    from pagedkv.apps.runtime_bundle import write_runtime_bundle

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


# ---------------------------------------------------------------------------------------------------------
# the kernel libraries of the GPU suite (forced CUDA paths included) are exactly those the bundle builds
# ---------------------------------------------------------------------------------------------------------
CUDA = {"kind": "cuda", "arch": "sm_90"}


def _gpu_module(name: str):
    """A ``tests/gpu`` module (importable without a GPU: its tests skip, its parametrization is plain data)."""
    import importlib

    sys.path.insert(0, str(_REPO / "tests" / "gpu"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _lookup_key(config, paths: dict) -> str:
    """The key a GPU test looks its kernel library up by: what ``pagedkv.create`` / ``_compile_op_table`` compute
    (``pagedkv.cache._op_table_cached``) under ``forced_paths(paths)``."""
    import json

    from pagedkv import backends
    from pagedkv import target as T
    from pagedkv.backends.tir import forced_paths
    from pagedkv.cache import kernel_library_key, kernel_shape
    from pagedkv.kernel_spec import target_for_paths

    target = target_for_paths(paths, CUDA)  # as test_prefill_tc_gpu: "wg1t" looks up an sm_90a library
    with forced_paths(paths):
        choice = tuple(backends.resolve(config, T.canonical(target), "tir").choice.items())
        return kernel_library_key(kernel_shape(config), json.loads(T.key(target)), choice)


def test_bundle_builds_every_kernel_library_of_the_gpu_suite(tmp_path):
    """Dry (nothing compiled): the TIR libraries the GPU tests load, by the key they look up, forced CUDA
    paths included, equal the libraries ``python -m pagedkv.apps.gpu_bundle`` builds, so a runtime-only GPU run never
    misses one (and the bundle carries none that no test loads)."""
    from pagedkv.apps.gpu_bundle import tir_kernel_libraries, tir_library_path

    scen, mask = _gpu_module("test_scenarios_gpu"), _gpu_module("test_kernels_masking_gpu")
    paths, fi = _gpu_module("test_cuda_paths_gpu"), _gpu_module("test_flashinfer_gpu")
    tc, sinks = _gpu_module("test_prefill_tc_gpu"), _gpu_module("test_sinks_gpu")
    need = [(s.config(), {}) for s in scen.SHAPES + mask.SHAPES + fi.SHAPES]
    need += [(c, {}) for c in sinks.SINK_GPU_CONFIGS.values()]
    groups = _gpu_module("test_layer_groups_gpu").GPU_GROUPS  # its base library and each window's (create looks both up)
    need += [(groups, {})] + [(groups.window_config(w), {}) for w in groups.group_windows]
    need += [(s.config(), p) for s, p in paths.LIBRARIES + tc.LIBRARIES]
    assert any(p for _, p in need), "the GPU suite forces no path"
    want = {f"kernels-{_lookup_key(c, p)}.so" for c, p in need}
    built = {tir_library_path(tmp_path, c, p, CUDA).name for c, p in tir_kernel_libraries()}
    assert want == built, (sorted(want - built), sorted(built - want))
    assert {p["cuda_decode_splits"] for _, p in paths.LIBRARIES} == set(paths.SPLITS) > {"auto"}


def test_forced_paths_select_prebuilt_libraries_runtime_only(tmp_path):
    """With the TVM runtime only (no TVMScript, so no kernel package), ``forced_paths`` still works and the
    lookup asks for the forced library's key (here: missing, so the error names it)."""
    from pagedkv.apps.gpu_bundle import tir_library_path
    from pagedkv.testing.shapes import PATH_SHAPES

    cfg, paths = PATH_SHAPES[1].config(), {"cuda_decode_splits": "3"}
    expected = tir_library_path(tmp_path, cfg, paths, CUDA).name
    assert expected != tir_library_path(tmp_path, cfg, {}, CUDA).name
    code = f"""
import sys
import tvm
assert tvm.base._RUNTIME_ONLY
from pagedkv import backends
from pagedkv.backends.tir import forced_paths
from pagedkv.cache import _compile_op_table
from pagedkv.testing.shapes import PATH_SHAPES
cfg = PATH_SHAPES[1].config()
with forced_paths({paths!r}):
    choice = tuple(backends.resolve(cfg, {CUDA!r}, "tir").choice.items())
    try:
        _compile_op_table(cfg, {CUDA!r}, choice)
    except FileNotFoundError as err:
        print(err)
print("kernels imported:", "pagedkv.tir_kernels" in sys.modules)
"""
    env = {k: v for k, v in __import__("os").environ.items()}
    env.update(TVM_USE_RUNTIME_LIB="1", PAGEDKV_KERNEL_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected in proc.stdout, proc.stdout
    assert "kernels imported: False" in proc.stdout, proc.stdout


def test_bundle_prunes_kernel_libraries_of_old_keys(tmp_path):
    """A rebuilt bundle keeps the kernel libraries (``.so`` + ``.json``) of this run only: files of keys it
    did not build are removed, other files are left alone."""
    from pagedkv.apps.gpu_bundle import prune_kernel_libraries

    for key in ("aaa", "bbb", "ccc"):
        for ext in (".so", ".json"):
            (tmp_path / f"kernels-{key}{ext}").write_text(key)
    (tmp_path / "notes.txt").write_text("not a kernel library")
    gone = prune_kernel_libraries(tmp_path, [tmp_path / "kernels-aaa.so", tmp_path / "kernels-ccc.so"])
    assert sorted(p.name for p in gone) == ["kernels-bbb.json", "kernels-bbb.so"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kernels-aaa.json", "kernels-aaa.so", "kernels-ccc.json", "kernels-ccc.so", "notes.txt"]


def test_bundle_builds_kernel_libraries_in_worker_processes(tmp_path):
    """``build_kernels`` with jobs > 1 (spawned workers): each key once, every library on disk with its op
    table, in the order of the list; a second call finds them built (the workers' files are the serial
    build's: same keys)."""
    from pagedkv.apps.gpu_bundle import build_kernels, tir_library_path
    from pagedkv.testing.shapes import SHAPES

    a, b = SHAPES[0].config(), SHAPES[-1].config()
    libs = [(a, {}), (b, {}), (a, {})]
    built = build_kernels(tmp_path, libs, "llvm", jobs=2)
    assert built == [tir_library_path(tmp_path / "kernels", c, {}, "llvm") for c in (a, b)]
    for lib in built:
        assert lib.stat().st_size > 0
        assert json.loads(lib.with_suffix(".json").read_text())["entries"]
    mtimes = [p.stat().st_mtime_ns for p in built]
    assert build_kernels(tmp_path, libs, "llvm", jobs=1) == built
    assert [p.stat().st_mtime_ns for p in built] == mtimes
