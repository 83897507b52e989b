"""``python -m pagedkv.flashinfer KIND [...]``: build (or find in the cache) one FlashInfer module."""

from __future__ import annotations

import argparse
import sys

from .build import build_module
from .spec import KINDS, MLA_KINDS, ModuleSpec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--dtype", default="float16", help="q, kv and o dtype")
    ap.add_argument("--head-dim", type=int, default=None, help="qk and vo head dim (mla: ckv dim, 512)")
    ap.add_argument("--head-dim-vo", type=int, default=None, help="vo head dim (mla: kpe dim, 64)")
    ap.add_argument("--pos-encoding-mode", type=int, default=0)
    ap.add_argument("--sliding-window", action="store_true")
    ap.add_argument("--logits-soft-cap", action="store_true")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--force", action="store_true", help="rebuild even when cached")
    a = ap.parse_args(argv)
    qk = a.head_dim or (512 if a.kind in MLA_KINDS else 128)
    vo = a.head_dim_vo or (64 if a.kind in MLA_KINDS else qk)
    spec = ModuleSpec(a.kind, a.dtype, a.dtype, a.dtype, qk, vo, pos_encoding_mode=a.pos_encoding_mode,
                      use_sliding_window=a.sliding_window, use_logits_soft_cap=a.logits_soft_cap, arch=a.arch)
    built = build_module(spec, jobs=a.jobs, force=a.force)
    print(built.object_path)
    for func, name in built.functions.items():
        print(f"  {func} -> {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
