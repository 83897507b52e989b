"""The kernel cache on disk: compiled kernel libraries keyed by content, shared by every process of a user.

``pagedkv.create`` compiles a config's kernels once per machine: the library (``kernels-<key>.so``, the op
table beside it in ``kernels-<key>.json``) lands in ``cache_dir()`` and a later process loads it (a CPU
library without importing ``tvm``: tens of milliseconds). The key (``pagedkv.cache.kernel_library_key``)
covers the kernel spec, the canonical target, the kernel sources, the backend choice and the versions of
pagedkv, TVM and tvm-ffi, so a stale entry is never taken.

Safety: an entry is built in a private temporary folder, flushed to disk and renamed into place (json first,
the ``.so`` last: an entry exists once its ``.so`` does), under a per-key file lock, so concurrent processes
build it once, and a build that is killed, fails or loses power leaves no entry. A killed build's temporary
folder is removed by the next build: of its key at once (the lock says its builder is gone), of another key
once no process holds that key's lock.

The folder is ``kernels/`` under pagedkv's cache root (``cache_root()``: ``$PAGEDKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/pagedkv``, else ``~/.cache/pagedkv``; FlashInfer's modules sit beside it in
``flashinfer/``); ``$PAGEDKV_KERNEL_CACHE`` names another folder, or ``off`` to compile in the process as
before the cache.
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

from .progress import Progress

#: Values of ``$PAGEDKV_KERNEL_CACHE`` that turn the disk cache off.
OFF = ("off", "0", "none", "")
#: Name prefix of the kernel libraries' entries.
KERNELS = "kernels"
#: A temporary build folder without a lock file (not this module's naming) older than this (seconds) is removed.
STALE_TMP_SECONDS = 3600


def cache_root() -> Path:
    """pagedkv's cache folder: ``$PAGEDKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedkv``, else
    ``~/.cache/pagedkv`` (the XDG base directory rule: an empty or relative ``$XDG_CACHE_HOME`` is ignored)."""
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "pagedkv"


def cache_dir() -> Path | None:
    """The kernel cache folder (``kernels/`` under ``cache_root()``, or ``$PAGEDKV_KERNEL_CACHE``), or None
    when ``$PAGEDKV_KERNEL_CACHE`` turns the cache off."""
    env = os.environ.get("PAGEDKV_KERNEL_CACHE")
    if env is not None:
        return None if env.strip().lower() in OFF else Path(env).expanduser()
    return cache_root() / "kernels"


def versions() -> dict:
    """The versions a compiled library depends on (part of the key); TVM's read without importing it."""
    import tvm_ffi

    from . import __version__
    from .runtime import tvm_version

    return {"pagedkv": __version__, "tvm": tvm_version(), "tvm_ffi": getattr(tvm_ffi, "__version__", "?")}


def entry_path(directory: Path, key: str, *, prefix: str = KERNELS) -> Path:
    """The library of ``key`` in ``directory`` (its json: ``.with_suffix(".json")``)."""
    return Path(directory) / f"{prefix}-{key}.so"


def is_complete(lib: Path) -> bool:
    """An entry exists once its ``.so`` does (moved last); its json is moved before it."""
    return lib.is_file() and lib.with_suffix(".json").is_file()


def lookup(directory: Path, key: str, *, prefix: str = KERNELS) -> Path | None:
    """The complete entry of ``key`` in ``directory``, or None. Takes no lock: entries appear by rename."""
    lib = entry_path(directory, key, prefix=prefix)
    return lib if is_complete(lib) else None


def _say(line: str) -> None:
    print(f"[pagedkv] {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path, *, waiting: str = "") -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (released by the kernel when the holder dies, so a killed build
    never blocks the next); says so when another process holds it."""
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                _say(f"waiting for another process {waiting} (lock {path}) ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _holder_is_gone(lock: Path) -> bool:
    """No process holds ``lock`` (it could be taken without waiting; released at once)."""
    try:
        with open(lock, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fh, fcntl.LOCK_UN)
            return True
    except OSError:
        return False


def _remove_dead_builds(directory: Path, own_stem: str) -> None:
    """Removes the temporary folders of builds that died (``.tmp-<stem>-<pid>``): a build holds its stem's
    lock while its folder exists, so the folders of ``own_stem`` (whose lock the caller holds) and of any
    stem whose lock is free are left over from a killed process. A folder without a lock file (another
    naming, an older pagedkv) is removed once it is ``STALE_TMP_SECONDS`` old."""
    now = time.time()
    for tmp in directory.glob(".tmp-*"):
        stem = tmp.name[len(".tmp-"):].rpartition("-")[0]
        lock = directory / f"{stem}.lock"
        with contextlib.suppress(OSError):
            dead = (stem == own_stem or _holder_is_gone(lock) if lock.exists()
                    else now - tmp.stat().st_mtime > STALE_TMP_SECONDS)
            if dead:
                shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(built: Path, lib: Path) -> None:
    """Moves a built library and its json into place: both flushed to disk first (a power loss after the
    rename must not leave a complete-looking entry of empty files), json first, the ``.so`` last."""
    for f in (built.with_suffix(".json"), built):
        _fsync(f)
    os.replace(built.with_suffix(".json"), lib.with_suffix(".json"))
    os.replace(built, lib)
    with contextlib.suppress(OSError):  # some file systems cannot sync a folder; the renames are done
        _fsync(lib.parent)


def load_or_build(directory: Path, key: str, build: Callable[[Path, Progress], None], *, what: str = "kernels",
                  prefix: str = KERNELS) -> Path:
    """The library of ``key`` in ``directory``, built by ``build(path, progress)`` when missing.

    Parameters
    ----------
    directory : Path
        The cache folder (created if needed).
    key : str
        The content key.
    build : callable
        Writes a library to ``path`` and its json to ``path.with_suffix(".json")``; reports its stages to
        ``progress`` (``Progress.stage``).
    what : str
        What is built, for the progress lines ("the kernels of ... for target llvm").
    prefix : str
        The entry's name prefix (``<prefix>-<key>.so``).

    Returns
    -------
    Path
        ``<prefix>-<key>.so`` in ``directory``, complete.
    """
    directory = Path(directory)
    lib = entry_path(directory, key, prefix=prefix)
    if is_complete(lib):
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    stem = lib.stem
    with _locked(directory / f"{stem}.lock", waiting=f"compiling {what}"):
        if is_complete(lib):  # another process built it while this one waited
            return lib
        _remove_dead_builds(directory, stem)
        tmp = directory / f".tmp-{stem}-{os.getpid()}"
        tmp.mkdir()
        try:
            with Progress(f"compiling {what}", detail=f"once: cached in {directory}") as progress:
                build(tmp / f"{prefix}.so", progress)
                _publish(tmp / f"{prefix}.so", lib)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return lib


def discard(directory: Path, key: str, *, prefix: str = KERNELS) -> None:
    """Removes the entry of ``key`` (one that exists but cannot be loaded), under its lock; a process that
    has it loaded keeps its mapping."""
    lib = entry_path(directory, key, prefix=prefix)
    with _locked(Path(directory) / f"{lib.stem}.lock"):
        for f in (lib, lib.with_suffix(".json")):  # the .so first: the entry is gone at once
            with contextlib.suppress(FileNotFoundError):
                f.unlink()


__all__ = ["KERNELS", "OFF", "cache_dir", "cache_root", "discard", "entry_path", "is_complete", "load_or_build",
           "lookup", "versions"]
