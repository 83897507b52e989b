"""The kernel cache on disk (``pagedkv.kernel_cache``): a second process loads instead of compiling (in at most
0.5 s, without importing tvm), concurrent builders build once, a killed or failed build leaves no entry (and
its temporary folder is gone after the next build), an unloadable entry is rebuilt, builds print their
progress, and the key moves with what built the library."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedkv import kernel_cache

#: A child process that creates the smallest cache and uses it; it prints how long ``pagedkv.create`` took (the
#: call alone: not the interpreter's start nor ``import torch``) and whether it imported tvm.
_CREATE = textwrap.dedent("""
    import json, sys, time
    import pagedkv, torch
    cfg = pagedkv.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=32, dtype="float32",
                                max_batch_size=2, max_total_seq_len=128, prefill_chunk_size=32)
    t0 = time.perf_counter()
    cache = pagedkv.create(cfg, backend="tir", target="llvm")
    took = time.perf_counter() - t0
    tvm_imported = "tvm" in sys.modules
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    o = cache.attention_with_fused_qkv(0, torch.randn(3, 4 + 2 * 2, 32), sm_scale=0.2)
    cache.end_forward()
    print(json.dumps({"create_s": took, "tvm_imported": tvm_imported, "finite": bool(o.isfinite().all())}))
""")
#: What the progress lines call the kernels of ``_CREATE``'s config.
_WHAT = "the kernels of 4/2 heads x 32 float32 for target llvm, 9 ops"
#: A build-in-progress line, printed when TVM's compile of the kernels starts.
_COMPILING = "TVM compiles 9 kernels for target llvm"


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          check=False)


def test_second_process_loads_instead_of_compiling(tmp_path):
    env = {**os.environ, "PAGEDKV_KERNEL_CACHE": str(tmp_path)}
    first = _run(_CREATE, env)
    assert first.returncode == 0, first.stderr
    # the one compile says what it compiles, each stage, and how long it took
    assert f"[pagedkv] compiling {_WHAT} (once: cached in {tmp_path}) ..." in first.stderr, first.stderr
    for stage in ("generating the kernels of 9 ops", _COMPILING, "writing the library"):
        assert f"[pagedkv]   {stage} (" in first.stderr, first.stderr
    assert re.search(rf"\[pagedkv\] compiling {_WHAT}: done in \d+\.\d s", first.stderr), first.stderr
    libs = sorted(tmp_path.glob("kernels-*.so"))
    assert len(libs) == 1 and libs[0].with_suffix(".json").is_file()
    stamp = libs[0].stat().st_mtime_ns
    second = _run(_CREATE, env)
    assert second.returncode == 0, second.stderr
    assert "compiling" not in second.stderr, second.stderr  # loaded, not compiled
    assert libs[0].stat().st_mtime_ns == stamp
    result = json.loads(second.stdout.strip().splitlines()[-1])
    assert result["finite"]
    print(f"first process: pagedkv.create took {json.loads(first.stdout.strip().splitlines()[-1])['create_s']:.3f} s;"
          f" second process: {result['create_s']:.3f} s")
    # a CPU entry loads with tvm-ffi and TVM's runtime library: importing tvm (its compiler library and every
    # frontend) took about a second, most of a cached create
    assert not result["tvm_imported"]
    assert result["create_s"] <= 0.5, result


def test_cache_off_compiles_in_process(tmp_path):
    env = {**os.environ, "PAGEDKV_KERNEL_CACHE": "off", "PAGEDKV_CACHE_DIR": str(tmp_path)}
    out = _run(_CREATE, env)
    assert out.returncode == 0, out.stderr
    assert not list(tmp_path.rglob("kernels-*"))


def test_killed_compile_leaves_no_entry(tmp_path):
    """A process killed (SIGKILL: no handler runs) while TVM compiles its kernels leaves no entry, only its
    temporary folder; the next process builds the entry, removes that folder, and its cache works."""
    env = {**os.environ, "PAGEDKV_KERNEL_CACHE": str(tmp_path)}
    child = subprocess.Popen([sys.executable, "-c", _CREATE], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in child.stderr:  # the progress lines say when the compile runs
            seen.append(line)
            if _COMPILING in line:
                os.kill(child.pid, signal.SIGKILL)
                break
        else:
            pytest.fail("the build never said it compiles:\n" + "".join(seen))
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert not list(tmp_path.glob("kernels-*.so")) and not list(tmp_path.glob("kernels-*.json"))
    assert list(tmp_path.glob(".tmp-*")), "the kill should have left the build's temporary folder"
    again = _run(_CREATE, env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["finite"]
    libs = list(tmp_path.glob("kernels-*.so"))
    assert len(libs) == 1 and kernel_cache.is_complete(libs[0])
    assert not list(tmp_path.glob(".tmp-*"))  # the killed build's folder is gone (its lock was free)


#: The config of ``_CREATE``, for the tests that create in this process.
_CFG = dict(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=32, dtype="float32", max_batch_size=2,
            max_total_seq_len=128, prefill_chunk_size=32)


@pytest.fixture
def cache_in(tmp_path, monkeypatch):
    """``pagedkv.create`` of this process uses the disk cache in ``tmp_path`` (its in-memory table cleared)."""
    from pagedkv import cache

    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path))
    cache._op_table_cached.cache_clear()
    yield tmp_path
    cache._op_table_cached.cache_clear()


def test_failed_compile_says_failed_and_leaves_no_entry(cache_in, monkeypatch, capfd):
    import tvm

    import pagedkv

    def exploding(*args, **kwargs):
        raise RuntimeError("LLVM codegen exploded")

    monkeypatch.setattr(tvm, "compile", exploding)
    cfg = pagedkv.KVCacheConfig(**_CFG)
    with pytest.raises(RuntimeError, match="LLVM codegen exploded"):
        pagedkv.create(cfg, backend="tir", target="llvm")
    err = capfd.readouterr().err
    assert re.search(rf"compiling {_WHAT}: FAILED after \d+\.\d s \(RuntimeError: LLVM codegen exploded\)", err), err
    assert "done" not in err
    assert not list(cache_in.glob("kernels-*.so")) and not list(cache_in.glob(".tmp-*"))
    # with the cache off the compile runs quietly in the process, and its failure is said as well
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", "off")
    with pytest.raises(RuntimeError, match="LLVM codegen exploded"):
        pagedkv.create(cfg, backend="tir", target="llvm")
    err = capfd.readouterr().err
    assert re.search(rf"compiling {_WHAT}: FAILED after", err) and "done" not in err, err


def test_unloadable_entry_is_rebuilt(cache_in, capfd):
    """An entry that looks complete but does not load (left by a crash of an older pagedkv, a damaged disk) is
    removed and built again, instead of failing every process."""
    import torch

    import pagedkv
    from pagedkv import cache

    cfg = pagedkv.KVCacheConfig(**_CFG)
    lib = cache.kernel_library_path(cfg, cache_in, target="llvm", backend="tir")
    lib.write_bytes(b"\x7fELF half a library")
    lib.with_suffix(".json").write_text(json.dumps({"entries": []}))
    kv = pagedkv.create(cfg, backend="tir", target="llvm")
    err = capfd.readouterr().err
    assert f"the cached kernel library {lib} cannot be loaded" in err and f"compiling {_WHAT}" in err, err
    assert kernel_cache.is_complete(lib) and lib.stat().st_size > 1000
    kv.add_sequence(0)
    kv.begin_forward([0], [3])
    assert kv.attention_with_fused_qkv(0, torch.randn(3, 8, 32), sm_scale=0.2).isfinite().all()
    kv.end_forward()


def test_dead_builds_folders_are_removed_live_ones_kept(tmp_path):
    """A build's temporary folder is removed by the next build once no process holds its key's lock; the
    folder of a build that holds its lock (another process, still compiling) is left alone; a folder with no
    lock file (an older pagedkv's naming) only once it is an hour old."""
    import fcntl

    folders = {name: tmp_path / f".tmp-{name}" for name in ("kernels-dead-1", "kernels-live-2", "young-3", "old-4")}
    for folder in folders.values():
        folder.mkdir()
    (tmp_path / "kernels-dead.lock").touch()
    hour_ago = folders["old-4"].stat().st_mtime - kernel_cache.STALE_TMP_SECONDS - 1
    os.utime(folders["old-4"], (hour_ago, hour_ago))
    with open(tmp_path / "kernels-live.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the live builder holds it
        kernel_cache.load_or_build(tmp_path, "k4", _builder(tmp_path / "count"))
        assert sorted(p.name for p in folders.values() if p.exists()) == [".tmp-kernels-live-2", ".tmp-young-3"]
    assert not (tmp_path / "young.lock").exists()  # looking made no lock files


def _builder(counter: Path, *, die: bool = False):
    def build(path: Path, progress) -> None:
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
        def build(path, progress):
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
    def build(path, progress):
        path.write_bytes(b"x")
        raise RuntimeError("nvcc exploded")

    with pytest.raises(RuntimeError, match="nvcc exploded"):
        kernel_cache.load_or_build(tmp_path, "k2", build, what="test kernels")
    err = capfd.readouterr().err
    assert "compiling test kernels: FAILED after" in err and "done" not in err
    assert not kernel_cache.entry_path(tmp_path, "k2").exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_concurrent_builders_build_once(tmp_path):
    counter = tmp_path / "count"
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pagedkv import kernel_cache
        def build(path, progress):
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
    monkeypatch.delenv("PAGEDKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache.cache_dir() == tmp_path / "home" / ".cache" / "pagedkv" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # not absolute: ignored, as the XDG rule says
    assert kernel_cache.cache_dir() == tmp_path / "home" / ".cache" / "pagedkv" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.cache_dir() == tmp_path / "xdg" / "pagedkv" / "kernels"
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    assert kernel_cache.cache_dir() == tmp_path / "kernels"
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", "off")
    assert kernel_cache.cache_dir() is None
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path / "k"))
    assert kernel_cache.cache_dir() == tmp_path / "k"
