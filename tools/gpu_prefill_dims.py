"""Build the TIR kernel libraries of the head dim 96 and 256 prefill shapes alone (the tensor-core prefill's
``PREFILL_TC_SHAPES`` at those dims under every forced tile that serves them: what ``tests/gpu/test_prefill_tc_gpu.py``
and ``benchmarks/bench_prefill_dims_gpu.py`` load) into ``OUT/kernels``, beside a bundle's runtime, when the rest of
a GPU bundle is current (a full ``make gpu-bundle`` builds these too)::

    .venv/bin/python tools/gpu_prefill_dims.py .gpu [--dims 96,256] [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dims", default="96,256")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    from pagedkv.apps.gpu_bundle import build_kernels
    from pagedkv.testing.shapes import PREFILL_KERNEL_PATHS, PREFILL_TC_SHAPES, prefill_kernel_refusal

    dims = {int(d) for d in args.dims.split(",")}
    libraries = [(s.config(), dict(p)) for s in PREFILL_TC_SHAPES if s.d in dims for p in PREFILL_KERNEL_PATHS
                 if not prefill_kernel_refusal(s, p["cuda_prefill_kernel"])]
    built = build_kernels(args.out, libraries, {"kind": "cuda", "arch": args.arch}, jobs=args.jobs)
    print(f"{len(built)} libraries in {args.out / 'kernels'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
