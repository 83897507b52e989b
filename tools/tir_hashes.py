"""Structural hashes of the TIR kernels over a covering set of specs, targets and forced paths.

A refactor of ``pagedkv.tir_kernels`` that must not change the generated code (issue 43: kernels split into
named stages) records the hashes before and compares after::

    python tools/tir_hashes.py --out /tmp/before.json            # on the old tree
    python tools/tir_hashes.py --compare /tmp/before.json        # on the new tree: exit 1 on a changed hash

``--only SUBSTR`` limits the cases to those whose key contains SUBSTR (for a quick inner loop). Cases whose
forced path no longer exists (a deleted variant) are reported as ``gone``, not as changes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

#: MHA specs: (Hq, Hkv, D, dtype, options). GQA groups 1, 4, 7, 8; head dims 64 / 128 / 96; fp32 (SIMT).
MHA_SPECS = [(32, 8, 128, "float16", {}), (32, 8, 64, "bfloat16", {}), (28, 4, 128, "bfloat16", {}),
             (8, 8, 128, "float16", {"sliding_window": 100, "logits_soft_cap": 30.0}),
             (16, 2, 96, "float16", {}), (8, 2, 64, "float32", {})]
#: MLA specs: (heads, dtype): DeepSeek latents (512 + 64).
MLA_SPECS = [(16, "float16"), (128, "bfloat16"), (64, "float16"), (16, "float32")]
#: Forced paths per family, one switch at a time (auto first).
MHA_PATHS = [{}] + [{"cuda_prefill_kernel": v} for v in ("simt", "tc", "tc2", "tc3", "tc4", "wg", "wg2", "wg2o",
                                                         "wg2k", "wg2p", "wg2t", "wg1t")] + \
            [{"cuda_decode_kernel": v} for v in ("lanes", "staged", "tc")] + \
            [{"cuda_decode_splits": v} for v in ("1", "3")] + \
            [{"cuda_decode_split_ranges": v} for v in ("entry", "chunk")]
MLA_PATHS = [{}] + [{"cuda_mla_decode_kernel": v} for v in ("simt", "tc", "wg", "wgt", "wgq")] + \
            [{"cuda_mla_prefill_kernel": v} for v in ("simt", "tc", "wg", "wgq")] + [{"cuda_decode_splits": "3"}]
CPU_PATHS = [{}, {"cpu_threads": "serial"}, {"cpu_threads": "parallel"}]
CUDA_ARCHS = ("sm_90a", "sm_80")


def _cases():
    from pagedkv.kernel_spec import KernelSpec

    mla = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
    for hq, hkv, d, dtype, opts in MHA_SPECS:
        for arch in ("llvm",) + CUDA_ARCHS:
            for paths in (CPU_PATHS if arch == "llvm" else MHA_PATHS):
                yield (f"mha/{hq}x{hkv}x{d}/{dtype}/{json.dumps(opts, sort_keys=True)}/{arch}/"
                       f"{json.dumps(paths, sort_keys=True)}",
                       lambda hq=hq, hkv=hkv, d=d, dtype=dtype, opts=opts, paths=paths: KernelSpec(
                           hq, hkv, d, dtype=dtype, paths=paths, **opts), arch)
    for heads, dtype in MLA_SPECS:
        for arch in ("llvm",) + CUDA_ARCHS:
            for paths in (CPU_PATHS if arch == "llvm" else MLA_PATHS):
                yield (f"mla/{heads}/{dtype}/{arch}/{json.dumps(paths, sort_keys=True)}",
                       lambda heads=heads, dtype=dtype, paths=paths: KernelSpec(
                           heads, heads, 192, v_head_dim=128, dtype=dtype, paths=paths, **mla), arch)


def _target(arch: str):
    import tvm

    if arch == "llvm":
        return tvm.target.Target("llvm")
    return tvm.target.Target({"kind": "cuda", "arch": arch}, host="llvm")


def hashes(only: str | None = None) -> dict:
    """``{case/op: structural hash}`` (or an ``error: ...`` string for a case that raises)."""
    import tvm_ffi

    from pagedkv import tir_kernels as tk

    out = {}
    for key, make_spec, arch in _cases():
        if only and only not in key:
            continue
        try:
            spec = make_spec()
        except ValueError as err:
            out[key] = f"error: {err}"
            continue
        for op in tk.OPS_BY_KIND["mla" if spec.is_mla else "mha"]:
            try:
                func = tk.make(op, spec, _target(arch))
                out[f"{key}/{op}"] = str(tvm_ffi.structural_hash(func))
            except Exception as err:  # noqa: BLE001 (a refused spec is a recorded outcome)
                out[f"{key}/{op}"] = f"error: {type(err).__name__}: {str(err)[:200]}"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the hashes as JSON here")
    ap.add_argument("--compare", help="compare with a JSON written by --out; exit 1 on a change")
    ap.add_argument("--only", help="cases whose key contains this string")
    a = ap.parse_args(argv)
    t0 = time.time()
    now = hashes(a.only)
    print(f"{len(now)} kernels hashed in {time.time() - t0:.0f} s", file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(now, f, indent=0, sort_keys=True)
    if not a.compare:
        return 0
    with open(a.compare) as f:
        before = {k: v for k, v in json.load(f).items() if not a.only or a.only in k}
    changed = [k for k in before if k in now and now[k] != before[k] and not before[k].startswith("error")]
    gone = [k for k in before if k not in now or (now[k].startswith("error") and not before[k].startswith("error"))]
    for k in changed:
        print(f"CHANGED {k}")
    print(f"{len(before) - len(changed) - len(gone)} same, {len(changed)} changed, {len(gone)} gone (raise now "
          "or not built)", file=sys.stderr)
    for k in gone[:20]:
        print(f"gone {k}: {now.get(k, 'not built')[:120]}", file=sys.stderr)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
