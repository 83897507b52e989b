"""The kernel cache on disk (``pagedkv.kernel_cache``): a second process loads instead of compiling, concurrent
builders build once, a killed build leaves no entry, and the key moves with what built the library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedkv import kernel_cache

_CREATE = textwrap.dedent("""
    import json, sys, time
    import pagedkv, tvm, torch
    cfg = pagedkv.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=32, dtype="float32",
                                max_batch_size=2, max_total_seq_len=128, prefill_chunk_size=32)
    t0 = time.perf_counter()
    cache = pagedkv.create(cfg, backend="tir", target="llvm")
    took = time.perf_counter() - t0
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    o = cache.attention_with_fused_qkv(0, torch.randn(3, 4 + 2 * 2, 32), sm_scale=0.2)
    cache.end_forward()
    print(json.dumps({"create_s": took, "finite": bool(o.isfinite().all())}))
""")


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          check=False)


def test_second_process_loads_instead_of_compiling(tmp_path):
    env = {**os.environ, "PAGEDKV_KERNEL_CACHE": str(tmp_path)}
    first = _run(_CREATE, env)
    assert first.returncode == 0, first.stderr
    assert "[pagedkv] compiling" in first.stderr and "[pagedkv] compiled" in first.stderr
    libs = sorted(tmp_path.glob("kernels-*.so"))
    assert len(libs) == 1 and libs[0].with_suffix(".json").is_file()
    stamp = libs[0].stat().st_mtime_ns
    second = _run(_CREATE, env)
    assert second.returncode == 0, second.stderr
    assert "compiling" not in second.stderr, second.stderr  # loaded, not compiled
    assert libs[0].stat().st_mtime_ns == stamp
    result = json.loads(second.stdout.strip().splitlines()[-1])
    assert result["finite"]
    print(f"second process: pagedkv.create took {result['create_s']:.3f} s")


def test_cache_off_compiles_in_process(tmp_path):
    env = {**os.environ, "PAGEDKV_KERNEL_CACHE": "off", "PAGEDKV_CACHE_DIR": str(tmp_path)}
    out = _run(_CREATE, env)
    assert out.returncode == 0, out.stderr
    assert not list(tmp_path.rglob("kernels-*"))


def _builder(counter: Path, *, die: bool = False):
    def build(path: Path) -> None:
        with open(counter, "a") as fh:
            fh.write("x")
        path.write_bytes(b"half a library")
        if die:
            os._exit(9)  # killed mid-build: nothing after this runs
        path.with_suffix(".json").write_text("{}")

    return build


def test_killed_build_leaves_no_entry(tmp_path):
    code = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from pagedkv import kernel_cache
        def build(path):
            path.write_bytes(b"half a library")
            os._exit(9)
        kernel_cache.load_or_build(Path({str(tmp_path)!r}), "k1", build)
    """)
    assert _run(code, dict(os.environ)).returncode == 9
    assert not kernel_cache.is_complete(kernel_cache.entry_path(tmp_path, "k1"))
    assert not list(tmp_path.glob("kernels-k1.so"))
    counter = tmp_path / "count"
    lib = kernel_cache.load_or_build(tmp_path, "k1", _builder(counter))
    assert kernel_cache.is_complete(lib) and counter.read_text() == "x"


def test_failed_build_raises_and_leaves_no_entry(tmp_path, capfd):
    def build(path):
        path.write_bytes(b"x")
        raise RuntimeError("nvcc exploded")

    with pytest.raises(RuntimeError, match="nvcc exploded"):
        kernel_cache.load_or_build(tmp_path, "k2", build, what="test kernels")
    assert "compiling test kernels FAILED" in capfd.readouterr().err
    assert not kernel_cache.entry_path(tmp_path, "k2").exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_concurrent_builders_build_once(tmp_path):
    counter = tmp_path / "count"
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pagedkv import kernel_cache
        def build(path):
            with open({str(counter)!r}, "a") as fh:
                fh.write("x")
            time.sleep(1.0)
            path.write_bytes(b"lib")
            path.with_suffix(".json").write_text("{{}}")
        kernel_cache.load_or_build(Path({str(tmp_path)!r}), "k3", build)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert counter.read_text() == "x"
    assert kernel_cache.is_complete(kernel_cache.entry_path(tmp_path, "k3"))


def test_key_covers_versions_and_sources(monkeypatch):
    import pagedkv
    from pagedkv import cache

    cfg = pagedkv.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=32, dtype="float32",
                                max_batch_size=2, max_total_seq_len=128, prefill_chunk_size=32)
    choice = (("attn_decode_paged", "tir"),)
    base = cache.kernel_library_key(cfg, "llvm", choice)
    monkeypatch.setattr(kernel_cache, "versions", lambda: {"pagedkv": "9.9"})
    assert cache.kernel_library_key(cfg, "llvm", choice) != base
    monkeypatch.undo()
    monkeypatch.setattr(cache, "kernel_source_digest", lambda: "0" * 16)
    assert cache.kernel_library_key(cfg, "llvm", choice) != base
    assert "kernel_spec.py" in cache.KERNEL_SOURCE_MODULES


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDKV_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    assert kernel_cache.cache_dir() == tmp_path / "kernels"
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", "off")
    assert kernel_cache.cache_dir() is None
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path / "k"))
    assert kernel_cache.cache_dir() == tmp_path / "k"
