"""``python -m pagedkv.bundle OUT``: everything a GPU host needs to run pagedkv's GPU tests with the TVM
runtime only, built on a host without a GPU.

OUT/bundle/    runtime-only TVM + tvm-ffi wheel for the GPU host's Python (../shared/gpu-host script)
OUT/lib/       libpagedkv_runtime.so
OUT/kernels/   kernels-<key>.so/.json for every config of the GPU suite (sm_90 fatbins)
OUT/models/    model libraries for the GPU model tests (when their dependencies are installed)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ._lib import runtime_library_path


def _runtime_bundle(out: Path) -> None:
    script = None
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        cand = root.parent / "shared" / "gpu-host" / "make-runtime-bundle.sh"
        if cand.exists():
            script = cand
            break
    if script is None:
        raise FileNotFoundError("../shared/gpu-host/make-runtime-bundle.sh not found beside the checkout")
    subprocess.run(["bash", str(script), str(out / "bundle")], check=True,
                   env={**__import__("os").environ, "PYTHON": sys.executable})


def build_kernels(out: Path, configs, target) -> list[Path]:
    from .cache import build_kernel_library

    paths = []
    for i, cfg in enumerate(configs):
        t0 = time.perf_counter()
        path = build_kernel_library(cfg, out / "kernels", target=target, backend="tir")
        print(f"[pagedkv] kernels {i + 1}/{len(configs)} {path.name}: {path.stat().st_size / 1e6:.2f} MB "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    out: Path = args.out
    (out / "lib").mkdir(parents=True, exist_ok=True)
    _runtime_bundle(out)
    shutil.copy2(runtime_library_path(), out / "lib" / "libpagedkv_runtime.so")
    from .testing.shapes import gpu_configs

    build_kernels(out, gpu_configs(), {"kind": "cuda", "arch": args.arch})
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"[pagedkv] GPU bundle {out}: {total / 1e6:.1f} MB", flush=True)
    if total > 60e6:
        print("[pagedkv] warning: the bundle is over 60 MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
