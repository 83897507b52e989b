"""The runtime bundle: what a GPU host with Python and PyTorch but no TVM and no network needs to load
pagedkv's libraries (``python -m pagedkv.apps.gpu_bundle`` writes it to ``OUT/bundle``).

- ``tvm_runtime.tar.xz``: this environment's ``tvm`` package without its compiler (``libtvm_compiler.so``),
  ``3rdparty/``, ``src/`` and ``web/``, so ``import tvm`` runs in runtime-only mode (``TVM_USE_RUNTIME_LIB=1``);
- the ``apache-tvm-ffi`` wheel of this environment's version, for the GPU host's Python (default 3.12);
- ``activate.sh``: sourced on the GPU host, unpacks both into ``/tmp/pagedkv-site`` once and sets
  ``PYTHONPATH``.

The CUDA loader is ``pagedkv.runtime.load_library`` (it loads TVM's CUDA sidecar), so the bundle needs no
loader script of its own.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tarfile
from pathlib import Path

#: Parts of the ``tvm`` package a runtime-only process never reads (the compiler is most of the size).
_EXCLUDED = ("tvm/3rdparty", "tvm/lib/libtvm_compiler.so", "tvm/src", "tvm/web")

#: Wheel platforms the GPU host's pip accepts (manylinux x86-64).
_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64")

_ACTIVATE = """\
# Source me on the GPU host: unpacks the runtime-only TVM and tvm-ffi once, then sets PYTHONPATH.
_b=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -d /tmp/pagedkv-site/tvm ] || [ ! -d /tmp/pagedkv-site/tvm_ffi ]; then
  mkdir -p /tmp/pagedkv-site
  tar -C /tmp/pagedkv-site -xJf "$_b/tvm_runtime.tar.xz"
  python3 -m pip install -q --no-index --no-deps --target /tmp/pagedkv-site "$_b"/apache_tvm_ffi-*.whl
fi
export PYTHONPATH=/tmp/pagedkv-site:$_b${PYTHONPATH:+:$PYTHONPATH} TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
"""


def _excluded(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    name = info.name
    if "__pycache__" in name.split("/") or any(name == e or name.startswith(e + "/") for e in _EXCLUDED):
        return None
    return info


def write_runtime_bundle(out: Path, *, python_version: str = "3.12") -> Path:
    """Write the runtime bundle into ``out`` (created); returns ``out``.

    Raises
    ------
    RuntimeError
        When pip cannot fetch the tvm-ffi wheel for ``python_version`` (the build host needs PyPI).
    """
    import tvm

    out.mkdir(parents=True, exist_ok=True)
    tvm_dir = Path(tvm.__file__).resolve().parent
    with tarfile.open(out / "tvm_runtime.tar.xz", "w:xz") as tar:
        tar.add(tvm_dir, arcname="tvm", filter=_excluded)
    for old in out.glob("apache_tvm_ffi-*.whl"):
        old.unlink()
    ffi_version = importlib.metadata.version("apache-tvm-ffi")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(out),
           f"apache-tvm-ffi=={ffi_version}"]
    for plat in _PLATFORMS:
        cmd += ["--platform", plat]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not list(out.glob("apache_tvm_ffi-*.whl")):
        raise RuntimeError(f"could not fetch apache-tvm-ffi=={ffi_version} for Python {python_version}: "
                           f"{done.stderr.strip()[-2000:]}")
    (out / "activate.sh").write_text(_ACTIVATE)
    return out


__all__ = ["write_runtime_bundle"]
