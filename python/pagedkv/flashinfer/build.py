"""Layer 2: the cached builder. ``build_module(spec)`` -> ``BuiltModule`` (layer 3: one object file).

Each module is built once per content key (``ModuleSpec.content_key``: spec, flashinfer version, recipe
version, nvcc version and extra flags) into ``<cache>/<key>/``, where ``<cache>`` is
``flashinfer/`` under pagedkv's cache root (``pagedkv.kernel_cache.cache_root``: ``$PAGEDKV_CACHE_DIR``,
``$XDG_CACHE_HOME/pagedkv`` or ``~/.cache/pagedkv``). Every build and every cache hit prints
one line (module, seconds, size); builds longer than ``PROGRESS_AFTER_S`` print progress as ninja finishes
objects, and a heartbeat when nothing finishes for ``HEARTBEAT_S``.

The build runs flashinfer 0.7.4's own generator and ninja rules for the objects in a child process
(``_worker``), then makes the module linkable beside others (``isolate_objects``):

1. ``ld -r --force-group-allocation`` joins the module's objects into one relocatable object and resolves its
   COMDAT groups inside the module;
2. ``objcopy`` renames the exported tvm-ffi functions ``__tvm_ffi_<func>`` to
   ``__tvm_ffi_<prefix><func>`` (prefix unique per content key), and makes every other defined symbol
   local (GNU-unique symbols are weakened first: objcopy does not localize those).

So the only global definitions a module contributes to a library are its own prefixed exports: two modules
(e.g. decode at head dim 64 and 128, whose host functions ``BatchDecodeWithPagedKVCacheRun`` etc. have the
same mangled names, and whose inline/template copies could differ) link side by side and never bind to each
other's code.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .spec import FLASHINFER_VERSION, ModuleSpec

#: Builds longer than this print progress lines.
PROGRESS_AFTER_S = 20.0
#: A progress line at least this often while a build runs.
HEARTBEAT_S = 60.0
#: The symbol prefix tvm-ffi gives exported functions.
FFI_PREFIX = "__tvm_ffi_"
#: Module kinds whose build includes ``curand_kernel.h`` (fa3's CUTLASS utilities include it).
CURAND_KINDS = ("prefill_fa3", "mla_fa3")
#: The wheel that provides ``curand_kernel.h`` where the toolkit lacks it (CUDA 13's compiler-only toolkit):
#: the one matching CUDA 13.0, as the Makefile's ``CURAND_SPEC`` installs it.
CURAND_SPEC = "nvidia-curand==10.4.0.35"


class FlashInferUnavailable(RuntimeError):
    """The FlashInfer JIT path cannot run here; the message lists why."""


def cache_root() -> Path:
    from .. import kernel_cache  # one cache root for kernels, models and FlashInfer modules

    return kernel_cache.cache_root() / "flashinfer"


def _log(msg: str) -> None:
    print(f"[pagedkv] flashinfer {msg}", flush=True)


# -- environment ------------------------------------------------------------------------------------------
def installed_version() -> str | None:
    """The installed flashinfer-python version (without importing it), or None."""
    from importlib import metadata

    try:
        return metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return None


def unavailable_reasons() -> list[str]:
    """Why this process cannot build FlashInfer modules (empty: it can). Imports nothing heavy."""
    out = []
    version = installed_version()
    if version is None:
        out.append(f"flashinfer-python is not installed (pip install 'pagedkv[flashinfer]', or for the JIT "
                   f"build only: pip install --no-deps flashinfer-python=={FLASHINFER_VERSION} and "
                   "'pagedkv[flashinfer-jit]')")
    elif version != FLASHINFER_VERSION:
        out.append(f"flashinfer-python {version} is installed; pagedkv's FlashInfer backend pins "
                   f"{FLASHINFER_VERSION} (its function ABI changes between releases)")
    try:
        from ..cuda_build import cuda_home

        cuda_home()
    except RuntimeError as err:
        out.append(str(err))
    for tool in ("ld", "objcopy", "nm"):
        if shutil.which(tool) is None:
            out.append(f"{tool} (binutils) not found: modules are linked with ld -r and objcopy")
    if shutil.which("ninja") is None and not _venv_ninja():
        out.append("ninja not found (pip install ninja)")
    return out


def _venv_ninja() -> str | None:
    cand = Path(sys.executable).parent / "ninja"
    return str(cand) if cand.exists() else None


@functools.lru_cache(maxsize=None)
def toolchain() -> dict[str, str]:
    """What besides the spec decides the objects: nvcc's version and extra flags from the environment."""
    from ..cuda_build import cuda_home

    home = cuda_home()
    out = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    return {"nvcc": out.strip().splitlines()[-1] if out.strip() else "unknown",
            "extra_cudaflags": os.environ.get("FLASHINFER_EXTRA_CUDAFLAGS", ""),
            "extra_cflags": os.environ.get("FLASHINFER_EXTRA_CFLAGS", "")}


def curand_include_dir() -> Path | None:
    """A folder holding ``curand_kernel.h`` (fa3 includes CUTLASS utilities that need it): the toolkit's
    include folder, else the ``nvidia-curand`` wheel's."""
    from ..cuda_build import cuda_home

    cands = [cuda_home() / "include"]
    for entry in sys.path:
        base = Path(entry) / "nvidia"
        if base.is_dir():
            cands += sorted(base.glob("*/include")) + sorted(base.glob("*/*/include"))
    for c in cands:
        if (c / "curand_kernel.h").exists():
            return c
    return None


def curand_missing(kind: str) -> str:
    """The reason a ``CURAND_KINDS`` module of ``kind`` cannot be built here, and how to fix it."""
    from ..cuda_build import cuda_home

    return (f"module {kind} needs curand_kernel.h to build (fa3 includes CUTLASS utilities that include it); "
            f"neither the CUDA toolkit ({cuda_home() / 'include'}) nor an installed nvidia-curand wheel has it, "
            f"and the module is not in the FlashInfer cache ({cache_root()}): pip install {CURAND_SPEC} "
            "(`make install` does with FLASHINFER=1), or PAGEDKV_FLASHINFER_FA3=0 for the fa2 modules")


def cached_module(spec: ModuleSpec) -> BuiltModule | None:
    """The module of ``spec`` from the cache, or None. Needs nvcc (its version is part of the key)."""
    key = spec.content_key(toolchain())
    return _read_built(spec, key, cache_root() / key, cached=True)


def module_unavailable_reasons(spec: ModuleSpec) -> list[str]:
    """Why the module of ``spec`` can be neither built nor taken from the cache here (empty: it can).

    ``unavailable_reasons`` holds for a cache hit too (``build_module`` checks them first, and the key holds
    nvcc's version); a ``CURAND_KINDS`` module also needs ``curand_kernel.h``, but only to be built: one
    already in the cache serves without it.
    """
    why = unavailable_reasons()
    if why or spec.kind not in CURAND_KINDS or curand_include_dir() is not None:
        return why
    return [] if cached_module(spec) is not None else [curand_missing(spec.kind)]


def _arch_list(arch: str) -> str:
    digits = arch.split("_", 1)[1]
    return f"{digits[:-1]}.{digits[-1]}"


def _worker_env(spec: ModuleSpec, root: Path, jobs: int) -> dict[str, str]:
    from ..cuda_build import cuda_home

    env = dict(os.environ)
    home = cuda_home()
    env["CUDA_HOME"] = str(home)  # flashinfer would otherwise take nvcc's folder, which may be a wrapper's
    env["PATH"] = os.pathsep.join([str(home / "bin"), str(Path(sys.executable).parent), env.get("PATH", "")])
    env["FLASHINFER_CUDA_ARCH_LIST"] = _arch_list(spec.arch)  # no GPU here to detect one from
    env["FLASHINFER_WORKSPACE_BASE"] = str(root / "workspace")
    env["MAX_JOBS"] = str(jobs)
    if spec.kind in CURAND_KINDS:
        inc = curand_include_dir()
        if inc is None:
            raise FlashInferUnavailable(f"cannot build FlashInfer module {spec.name}: {curand_missing(spec.kind)}")
        if str(inc) != str(home / "include"):
            env["FLASHINFER_EXTRA_CUDAFLAGS"] = (env.get("FLASHINFER_EXTRA_CUDAFLAGS", "")
                                                 + f" -isystem {inc}").strip()
    return env


# -- isolation: one relocatable object per module, only its prefixed exports global ------------------------
def _defined_globals(obj: Path) -> list[tuple[str, str]]:
    out = subprocess.run(["nm", "-g", "--defined-only", str(obj)], capture_output=True, text=True,
                         check=True).stdout
    res = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3:
            res.append((parts[1], parts[2]))
    return res


def isolate_objects(objects: list[Path], out: Path, prefix: str) -> dict[str, str]:
    """Join ``objects`` into ``out`` whose only global definitions are the tvm-ffi exports, renamed
    ``__tvm_ffi_<func>`` -> ``__tvm_ffi_<prefix><func>``. Returns ``{func: prefix + func}``."""
    tmp = out.with_suffix(".joined.o")
    subprocess.run(["ld", "-r", "--force-group-allocation", "-o", str(tmp), *map(str, objects)], check=True)
    syms = _defined_globals(tmp)
    exports = {name[len(FFI_PREFIX):]: prefix + name[len(FFI_PREFIX):]
               for typ, name in syms if typ == "T" and name.startswith(FFI_PREFIX)}
    if not exports:
        raise RuntimeError(f"no {FFI_PREFIX}* export in {objects}")
    unique = out.with_suffix(".unique.txt")
    unique.write_text("".join(f"{name}\n" for typ, name in syms if typ == "u"))
    local = out.with_suffix(".local.txt")
    local.write_text("".join(f"{name}\n" for _, name in syms
                             if not (name.startswith(FFI_PREFIX) and name[len(FFI_PREFIX):] in exports)))
    subprocess.run(["objcopy", f"--weaken-symbols={unique}", str(tmp)], check=True)
    rename = [f"--redefine-sym={FFI_PREFIX}{f}={FFI_PREFIX}{s}" for f, s in sorted(exports.items())]
    subprocess.run(["objcopy", f"--localize-symbols={local}", *rename, str(tmp), str(out)], check=True)
    left = {name for _, name in _defined_globals(out)}
    expected = {FFI_PREFIX + s for s in exports.values()}
    if left != expected:
        raise RuntimeError(f"{out}: global definitions {sorted(left - expected)[:5]} left besides the exports")
    for p in (tmp, unique, local):
        p.unlink()
    return exports


# -- the cached build ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BuiltModule:
    """A built module: one relocatable object whose exported tvm-ffi functions are ``functions``
    (``{flashinfer name: exported name}``; the library symbol is ``__tvm_ffi_`` + exported name)."""

    spec: ModuleSpec
    key: str
    object_path: Path
    functions: dict[str, str] = field(compare=False)
    seconds: float = field(compare=False)
    cached: bool = field(compare=False)

    @property
    def size(self) -> int:
        return self.object_path.stat().st_size

    def symbol(self, func: str) -> str:
        """The name a Relax ``ExternFunc`` / library lookup uses for flashinfer function ``func``."""
        return self.functions[func]

    def source_objects(self) -> list[Path]:
        """flashinfer's own objects this module was made from (in flashinfer's workspace under the cache)."""
        info = json.loads(self.object_path.with_name("module.json").read_text())
        return [Path(p) for p in info["objects"]]

    def static_library(self):
        """The object as a TVM static-library module (``IRModule`` attr ``external_mods``, or
        ``Module.import_module``), linked into the exported library by ``export_library``."""
        import tvm

        return tvm.runtime.load_static_library(str(self.object_path), list(self.functions.values()))


def _read_built(spec: ModuleSpec, key: str, d: Path, cached: bool) -> BuiltModule | None:
    meta, obj = d / "module.json", d / "module.o"
    if not (meta.exists() and obj.exists()):
        return None
    info = json.loads(meta.read_text())
    return BuiltModule(spec, key, obj, dict(info["functions"]), float(info["seconds"]), cached)


def _run_worker(spec: ModuleSpec, env: dict[str, str], jobs: int, t0: float) -> dict:
    # Run by path: the worker imports only flashinfer and torch, not pagedkv (nor its runtime library).
    cmd = [sys.executable, str(Path(__file__).with_name("_worker.py")), json.dumps(spec.to_dict()), str(jobs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            bufsize=1)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True)
    reader.start()
    result, other, last_print, done = None, [], time.perf_counter(), (0, 0)
    while True:
        try:
            line = lines.get(timeout=HEARTBEAT_S)
        except queue.Empty:
            now = time.perf_counter()
            _log(f"{spec.name}: compiling, {done[0]}/{done[1] or '?'} objects done, {now - t0:.0f} s")
            last_print = now
            continue
        if line is None:
            break
        now = time.perf_counter()
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            other.append(line)
            continue
        if not isinstance(msg, dict):
            other.append(line)
        elif "progress" in msg:
            done = tuple(msg["progress"])
            if now - t0 >= PROGRESS_AFTER_S or now - last_print >= HEARTBEAT_S:
                _log(f"{spec.name}: {done[0]}/{done[1]} objects compiled, {now - t0:.0f} s")
                last_print = now
        elif "error" in msg:
            other.append(msg["error"])
        else:
            result = msg
    if proc.wait() != 0 or result is None:
        raise RuntimeError(f"building FlashInfer module {spec.name} failed:\n" + "".join(other)[-6000:])
    return result


def build_module(spec: ModuleSpec, *, jobs: int | None = None, force: bool = False,
                 log: Callable[[str], None] = _log) -> BuiltModule:
    """The module of ``spec``, from the cache or built now (see the module docstring)."""
    why = unavailable_reasons()
    if why:
        raise FlashInferUnavailable(f"cannot build FlashInfer module {spec.name}: " + "; ".join(why))
    root = cache_root()
    key = spec.content_key(toolchain())
    final = root / key
    t0 = time.perf_counter()
    if not force:
        hit = _read_built(spec, key, final, cached=True)
        if hit is not None:
            log(f"{spec.name}: cached, {hit.size / 1e6:.2f} MB, {time.perf_counter() - t0:.2f} s ({key})")
            return hit
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per key across processes
        if not force:
            hit = _read_built(spec, key, final, cached=True)
            if hit is not None:
                log(f"{spec.name}: cached (built by another process), {hit.size / 1e6:.2f} MB, "
                    f"{time.perf_counter() - t0:.2f} s ({key})")
                return hit
        jobs = jobs or int(os.environ.get("MAX_JOBS", 0) or 0) or os.cpu_count() or 1
        # Said before the wait, not after: a first fa3 build runs for many minutes with nothing else to show.
        log(f"{spec.name}: not in the cache, building with {jobs} jobs"
            + (" (a first fa3 build takes 7-20 minutes)" if spec.kind in CURAND_KINDS else ""))
        result = _run_worker(spec, _worker_env(spec, root, jobs), jobs, t0)
        staging = root / f"{key}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        objects = [Path(p) for p in result["objects"]]
        functions = isolate_objects(objects, staging / "module.o", spec.symbol_prefix(key))
        seconds = time.perf_counter() - t0
        (staging / "module.json").write_text(json.dumps({
            "spec": spec.to_dict(), "key": key, "flashinfer": FLASHINFER_VERSION, "toolchain": toolchain(),
            "uri": result["uri"], "functions": functions, "seconds": round(seconds, 1),
            "objects": {str(p): p.stat().st_size for p in objects}}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    built = _read_built(spec, key, final, cached=False)
    log(f"{spec.name}: built in {seconds:.1f} s, {built.size / 1e6:.2f} MB ({key})")
    return built


def build_modules(specs, **kwargs) -> list[BuiltModule]:
    """``build_module`` for each distinct spec, in order."""
    seen, out = set(), []
    for s in specs:
        if s not in seen:
            seen.add(s)
            out.append(build_module(s, **kwargs))
    return out


__all__ = ["BuiltModule", "CURAND_KINDS", "CURAND_SPEC", "FlashInferUnavailable", "build_module", "build_modules",
           "cache_root", "cached_module", "curand_include_dir", "curand_missing", "isolate_objects",
           "module_unavailable_reasons", "unavailable_reasons", "installed_version", "toolchain"]
