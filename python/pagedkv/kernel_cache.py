"""The kernel cache on disk: compiled kernel libraries keyed by content, shared by every process of a user.

``pagedkv.create`` compiles a config's kernels once per machine: the library (``kernels-<key>.so``, the op
table beside it in ``kernels-<key>.json``) lands in ``cache_dir()`` and a later process loads it. The key
(``pagedkv.cache.kernel_library_key``) covers the kernel spec, the canonical target, the kernel sources, the
backend choice and the versions of pagedkv, TVM and tvm-ffi, so a stale entry is never taken.

Safety: an entry is built in a private temporary folder and moved into place (json first, the ``.so`` last:
an entry exists once its ``.so`` does), under a per-key file lock, so concurrent processes build it once and
an interrupted build leaves no entry (its temporary folder is removed by the next build of any key).

The folder is ``kernels/`` under pagedkv's cache root (``$PAGEDKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/pagedkv``, else ``~/.cache/pagedkv``; FlashInfer's modules sit beside it in ``flashinfer/``);
``$PAGEDKV_KERNEL_CACHE`` names another folder, or ``off`` to compile in the process as before the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

#: Values of ``$PAGEDKV_KERNEL_CACHE`` that turn the disk cache off.
OFF = ("off", "0", "none", "")
#: Temporary build folders older than this (seconds) belong to a build that died: removed.
STALE_TMP_SECONDS = 3600


def cache_dir() -> Path | None:
    """The kernel cache folder, or None when ``$PAGEDKV_KERNEL_CACHE`` turns the cache off."""
    env = os.environ.get("PAGEDKV_KERNEL_CACHE")
    if env is not None:
        return None if env.strip().lower() in OFF else Path(env).expanduser()
    root = os.environ.get("PAGEDKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"), "pagedkv")
    return Path(root) / "kernels"


def versions() -> dict:
    """The versions a compiled library depends on (part of the key)."""
    import tvm
    import tvm_ffi

    from . import __version__

    return {"pagedkv": __version__, "tvm": getattr(tvm, "__version__", "?"),
            "tvm_ffi": getattr(tvm_ffi, "__version__", "?")}


def entry_path(directory: Path, key: str) -> Path:
    """The library of ``key`` in ``directory`` (its op table: ``.with_suffix(".json")``)."""
    return Path(directory) / f"kernels-{key}.so"


def is_complete(lib: Path) -> bool:
    """An entry exists once its ``.so`` does (moved last); its json is moved before it."""
    return lib.is_file() and lib.with_suffix(".json").is_file()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_stale_tmp(directory: Path) -> None:
    now = time.time()
    for tmp in directory.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)


def load_or_build(directory: Path, key: str, build: Callable[[Path], None], *, what: str = "kernels") -> Path:
    """The library of ``key`` in ``directory``, built by ``build(path)`` when missing.

    Parameters
    ----------
    directory : Path
        The cache folder (created if needed).
    key : str
        The content key.
    build : callable
        Writes a library to ``path`` and its op table to ``path.with_suffix(".json")``.
    what : str
        What is built, for the progress lines.

    Returns
    -------
    Path
        ``kernels-<key>.so`` in ``directory``, complete.
    """
    directory = Path(directory)
    lib = entry_path(directory, key)
    if is_complete(lib):
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / f"kernels-{key}.lock"):
        if is_complete(lib):  # another process built it while this one waited
            return lib
        _remove_stale_tmp(directory)
        tmp = directory / f".tmp-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        t0 = time.perf_counter()
        print(f"[pagedkv] compiling {what} (cache entry {key} in {directory}) ...", file=sys.stderr, flush=True)
        try:
            build(tmp / "kernels.so")
            os.replace(tmp / "kernels.json", lib.with_suffix(".json"))
            os.replace(tmp / "kernels.so", lib)
        except BaseException:
            print(f"[pagedkv] compiling {what} FAILED after {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"[pagedkv] compiled {what} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return lib


__all__ = ["OFF", "cache_dir", "entry_path", "is_complete", "load_or_build", "versions"]
