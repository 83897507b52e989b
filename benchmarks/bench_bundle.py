"""``python benchmarks/bench_bundle.py OUT``: what ``bench_gpu.py`` needs on a GPU host without network or
compiler, built here (no GPU needed).

OUT/bundle/      runtime-only TVM + tvm-ffi (``pagedkv.apps.runtime_bundle``)
OUT/lib/         libpagedkv_runtime.so
OUT/kernels/     pagedkv kernel libraries of every benchmark config (the kernel shape of each workload),
                 TIR only and with the FlashInfer backend (its modules linked in)
OUT/upstream/    apache-tvm 0.27's own CUDA attention kernels (fp16, 32/8/128)
OUT/flashinfer/  FlashInfer 0.7.4's Python package, trimmed, and its AOT modules (``_fi_peer.pack``)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _bench_impls as impls  # noqa: E402
import _bench_workloads as W  # noqa: E402
import _fi_peer  # noqa: E402


def kernel_libraries(out: Path, dtypes) -> list[Path]:
    """Every pagedkv column's library of every workload (a label's forced TIR paths, ``PAGEDKV_PATHS``,
    are part of its key), each once."""
    from pagedkv.backends.tir import forced_paths
    from pagedkv.cache import build_kernel_library, kernel_library_path, kernel_shape

    seen = set()
    for w in W.workloads(dtypes):
        cfg = kernel_shape(impls.pagedkv_config(w))
        for label, backend in impls.PAGEDKV_BACKENDS.items():
            if impls.pagedkv_unavailable(label, w):
                continue
            paths = impls.PAGEDKV_PATHS.get(label, {})
            target = impls.cache_target(label)  # TIR: sm_90a; FlashInfer: sm_90
            with forced_paths(paths):
                path = kernel_library_path(cfg, out, target=target, backend=backend)
                if path in seen:
                    continue
                seen.add(path)
                t0 = time.perf_counter()
                try:
                    build_kernel_library(cfg, out, target=target, backend=backend)
                except Exception as e:  # noqa: BLE001 (reported; bench_gpu says the library is missing)
                    print(f"[bench-bundle] FAILED {cfg.to_json()} backend {backend} paths {paths}: {e}", flush=True)
                    continue
            print(f"[bench-bundle] kernels {path.name} ({w.dtype}, {'MLA' if w.mla else 'MHA'} h{w.hq}, "
                  f"{label}): {path.stat().st_size / 1e6:.2f} MB in {time.perf_counter() - t0:.1f} s", flush=True)
    return sorted(seen)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    args = ap.parse_args(argv)
    dtypes = tuple(args.dtypes.split(","))
    from pagedkv._lib import runtime_library_path
    from pagedkv.apps.gpu_bundle import _runtime_bundle, build_upstream_kernels, prune_kernel_libraries

    out: Path = args.out
    (out / "lib").mkdir(parents=True, exist_ok=True)
    _runtime_bundle(out)
    shutil.copy2(runtime_library_path(), out / "lib" / "libpagedkv_runtime.so")
    build_upstream_kernels(out, "sm_90")
    prune_kernel_libraries(out / "kernels", kernel_libraries(out / "kernels", dtypes))
    info = _fi_peer.pack(out / "flashinfer", _fi_peer.peer_specs(dtypes))
    print(f"[bench-bundle] FlashInfer peer: {len(info['modules'])} modules", flush=True)
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"[bench-bundle] {out}: {total / 1e6:.1f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
