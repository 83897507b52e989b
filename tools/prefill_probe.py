#!/usr/bin/env python3
"""Time tensor-core prefill tiles alone on the GPU host, and variants of them with one stage left out.

The runtime path (``make bench-gpu``) needs the whole bundle; this probe needs only nvcc and PyTorch there. On the
build host, ``gen`` writes TVM's CUDA source of the ragged prefill kernel (32 q / 8 kv heads, head dim 128, fp16)
for each tile, with a C launcher appended; ``TILE@VARIANT[+VARIANT]`` edits the kernel body first, for timing only
(the outputs are then wrong and not checked):

* ``noexp``: the softmax's ``exp2f`` calls become the identity (what the special-function unit costs);
* ``noload``: the K / V ``cp.async`` copies do nothing (what the copies cost);
* ``nosync``: the kernel's ``__syncthreads`` are gone (what the block barrier's lockstep costs).

On the GPU host, ``build`` compiles each source into a shared library (sm_90a) and ``run`` times each on causal
ragged prefills (CUDA events), checks the plain tiles against PyTorch's float32 attention and times PyTorch's
fp16 SDPA beside them. Profile one tile with ``ncu ... python3 tools/prefill_probe.py run DIR TILE --iters 1``.

    python tools/prefill_probe.py gen .gpu-var/probe wg1t wg1t@noexp wg2t tc3      # build host (TVM)
    PYTHONPATH=$OLD/python python tools/prefill_probe.py gen .gpu-var/probe --prefix base- wg1t   # a baseline
    python3 tools/prefill_probe.py build .gpu-var/probe                             # GPU host (nvcc)
    python3 tools/prefill_probe.py run .gpu-var/probe wg1t,wg1t@noexp,wg2t,tc3      # GPU host (PyTorch)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

HQ, HKV, D = 32, 8, 128
OP = "attn_prefill_ragged"
#: Pointer parameters of the kernel by name (the launcher's argument order).
POINTERS = ("q", "k", "v", "q_indptr", "kv_indptr", "o", "lse")
EDITS = {"noexp": (("exp2f(", "("),),
         "noload": (("pagedkv_cp_async16_pf128(", "pk_noop("), ("pagedkv_cp_async16(", "pk_noop(")),
         "nosync": (("__syncthreads();", ";"),)}


def file_stem(tile: str) -> str:
    return tile.replace("@", "__").replace("+", "-")


def _encode_map(var: str, tensor: str, tmap) -> str:
    """C code encoding the kernel's tensor map ``var`` of ragged ``tensor`` (``P[...]``, n rows) as the PrimFunc's
    host code does (``tmap.encode_args``), through the driver's ``cuTensorMapEncodeTiled``."""
    from pagedkv.tir_kernels._tma_cuda import decode_args

    r, a = tmap.rank, decode_args(tmap.rank, tmap.encode_args(["(cuuint64_t)n"]))

    def arr(xs):
        return "{" + ", ".join(map(str, xs)) + "}"

    return (f"  CUtensorMap {var};\n  {{ cuuint64_t dims[{r}] = {arr(a.dims)}; cuuint64_t str[{r - 1}] = "
            f"{arr(a.strides)};\n    cuuint32_t box[{r}] = {arr(a.box)}, es[{r}] = {arr(a.elem_strides)};\n"
            f"    int r = pk_encode()(&{var}, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, {r}, P[{POINTERS.index(tensor)}], dims, "
            f"str, box, es, (CUtensorMapInterleave){a.interleave}, (CUtensorMapSwizzle){a.swizzle}, "
            f"(CUtensorMapL2promotion){a.l2_promotion}, (CUtensorMapFloatOOBfill){a.oob_fill});\n"
            f"    if (r) return 1000 + r; }}\n")


#: The driver's cuTensorMapEncodeTiled, looked up once (no -lcuda at build time).
_ENCODE = """#include <cuda.h>
#include <dlfcn.h>
typedef CUresult (*pk_encode_fn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static pk_encode_fn pk_encode() {
  static pk_encode_fn f = (pk_encode_fn)dlsym(dlopen("libcuda.so.1", RTLD_NOW), "cuTensorMapEncodeTiled");
  return f;
}
"""


def _launcher(name: str, threads: int, smem: int, params, unused, maps=None) -> str:
    """``pk_launch``: the kernel's arguments by parameter name; 0 for those its body never reads (``unused``)."""
    args, encode = [], ""
    for i, (ty, pname) in enumerate(params):
        if i in unused:
            args.append("0")  # a value TVM's host code computes for the launch only (int cse_v*)
        elif "CUtensorMap" in ty:
            encode += _encode_map(pname, *maps[pname])
            args.append(pname)
        elif ty.endswith("*"):
            args.append(f"({ty})P[{POINTERS.index(pname.removesuffix('_ptr'))}]")
        elif pname in ("B", "causal", "n"):
            args.append(pname)
        elif re.fullmatch(r"v(_\d+)?", pname):
            args.append("0")  # element offsets: every view starts at its buffer
        elif ty == "float":
            args.append("scale2")  # sm_scale * log2(e), hoisted by TVM
        else:
            raise SystemExit(f"unknown kernel parameter {ty} {pname}")
    return ((_ENCODE if encode else "") +
            '\nextern "C" int pk_launch(void** P, int B, int causal, float scale2, int n, int gx, int gy) {\n'
            + encode +
            f"  cudaFuncSetAttribute({name}, cudaFuncAttributeMaxDynamicSharedMemorySize, {max(smem, 1)});\n"
            f"  {name}<<<dim3(gx, gy), dim3({threads}), {smem}>>>({', '.join(args)});\n"
            f"  return (int)cudaGetLastError();\n}}\n")


def gen(out: Path, tiles: list[str], prefix: str = "") -> None:
    import tvm
    from tvm.target import Target

    from pagedkv import tir_kernels as tk
    from pagedkv.tir_kernels.attention_cuda_prefill_tc import TC_TILES, tma_maps

    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    for tile in tiles:
        base, *variants = tile.split("@")
        cfg = tk.KernelSpec(HQ, HKV, D, D, "float16", paths={"cuda_prefill_kernel": base})
        target = Target({"kind": "cuda", "arch": "sm_90a" if TC_TILES[base].wgmma else "sm_90"}, host="llvm")
        func = tk.build_kernels(cfg, target, ops=(OP,))[OP]
        with target:
            exe = tvm.compile(tvm.IRModule({f"pagedkv_{OP}": func}), target=target)
        src = next(s for m in exe.mod.imports for s in [m.inspect_source()] if "__global__" in s)
        from pagedkv.testing.cuda_source import hide_params, tensor_core_kernel, unused_params

        kdef = tensor_core_kernel(src)
        start, end, threads, name, params = kdef.start, kdef.end, kdef.threads, kdef.name, kdef.params
        unused = unused_params(kdef, src)
        body = hide_params(src[start:end], kdef, unused)  # nvcc fails if the kernel read one
        for v in "+".join(variants).split("+") if variants else ():
            for a, b in EDITS[v]:
                body = body.replace(a, b)
        t = TC_TILES[base]
        # Dynamic shared memory, every tile's; 0 for a one-stage tile (static), which a baseline ``gen`` from an older
        # tree (``PYTHONPATH=$OLD/python``) may still name.
        smem = t.smem_bytes(D, D) if t.stages > 1 else 0
        maps = tma_maps(cfg, base) if TC_TILES[base].tma else None
        src = ("__device__ __forceinline__ void pk_noop(void*, const void*) {}\n" + src[:start] + body + src[end:]
               + _launcher(name, threads, smem, params, unused, maps))
        (out / f"{file_stem(prefix + tile)}.cu").write_text(src)
        meta[prefix + tile] = {"threads": threads, "smem": smem, "tq": t.rows // (HQ // HKV), "sm_arch": target.arch}
        print(prefix + tile, meta[prefix + tile])
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def build(d: Path, jobs: int) -> None:
    # TVM 0.27's own nvcc flags (tvm.support.nvcc.compile_cuda): fast math, ptxas register-usage level 10.
    cmds = [["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-w", "-lineinfo", "--use_fast_math",
             "--expt-relaxed-constexpr", "--ptxas-options=--register-usage-level=10",
             "-gencode=arch=compute_90a,code=sm_90a", "-o", str(cu.with_suffix(".so")), str(cu), "-ldl"]
            for cu in sorted(d.glob("*.cu"))]
    for i in range(0, len(cmds), jobs):
        procs = [subprocess.Popen(c) for c in cmds[i:i + jobs]]
        if any(p.wait() for p in procs):
            raise SystemExit("nvcc failed")


def time_calls(fn, iters: int) -> float:
    """Milliseconds a call of ``fn`` (CUDA events over ``iters`` calls after one untimed call)."""
    import torch

    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def run(d: Path, tiles: list[str], iters: int, shapes: list[tuple[int, int]]) -> int:
    import ctypes
    import os

    import torch

    meta = json.loads((d / "meta.json").read_text())
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    bad = 0

    def timeit(fn):
        return time_calls(fn, iters)

    for nb, sl in shapes:
        n, sm = nb * sl, 1 / math.sqrt(D)
        q, k, v = (torch.randn(n, h, D, device="cuda", dtype=torch.float16) for h in (HQ, HKV, HKV))
        ind = torch.arange(0, n + 1, sl, dtype=torch.int32, device="cuda")
        flop = 4 * HQ * D * nb * sl * (sl + 1) / 2
        qb, kb, vb = (x.view(nb, sl, -1, D).transpose(1, 2) for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qb.float(), kb.float(), vb.float(), is_causal=True,
                                                               scale=sm, enable_gqa=True).transpose(1, 2).reshape(n, HQ, D)
        if iters > 1:
            t = timeit(lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=sm,
                                                                                enable_gqa=True))
            print(f"{nb}x{sl} torch-sdpa-f16 {t:.4f} ms {flop / t / 1e9:.0f} TFLOP/s", flush=True)
        for tile in tiles:
            lib = ctypes.CDLL(str(d / f"{file_stem(tile)}.so"))
            o = torch.full_like(q, float("nan"))
            lse = torch.full((n, HQ), float("nan"), device="cuda")
            ptrs = (ctypes.c_void_p * len(POINTERS))(*(x.data_ptr() for x in (q, k, v, ind, ind, o, lse)))
            gx = max(n // meta[tile]["tq"] + nb, 1)

            def launch():
                rc = lib.pk_launch(ptrs, nb, 1, ctypes.c_float(sm * math.log2(math.e)), n, gx, HKV)
                if rc:
                    raise SystemExit(f"{tile}: launch error {rc}")

            launch()
            torch.cuda.synchronize()
            rel = ((o.float() - ref).norm() / ref.norm()).item()
            ok = "@" in tile or rel < 1e-2  # NaN fails the comparison
            bad += not ok
            t = timeit(launch) if iters > 1 and ok else float("nan")
            print(f"{nb}x{sl} {tile} {t:.4f} ms {flop / t / 1e9:.0f} TFLOP/s rel {rel:.2e} "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
    return 1 if bad else 0


def parse(argv, doc: str, item: str, run_args=()):
    """The probes' command line: ``gen OUT ITEM... [--prefix P]``, ``build DIR [--jobs N]``, ``run DIR ITEMS
    [--iters N]`` plus ``run_args`` ((flag, kwargs) pairs) on ``run``; ``ITEMS`` comes back as a list."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen")
    g.add_argument("out", type=Path)
    g.add_argument("items", nargs="+", metavar=item)
    g.add_argument("--prefix", default="", help=f"name the outputs PREFIX + {item} (e.g. a baseline built from "
                                                 "another checkout with PYTHONPATH=it/python)")
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--jobs", type=int, default=16)
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("items", help="comma-separated", metavar=item)
    r.add_argument("--iters", type=int, default=20)
    for flag, kw in run_args:
        r.add_argument(flag, **kw)
    a = ap.parse_args(argv)
    if a.cmd == "run":
        a.items = a.items.split(",")
    return a


def main(argv=None) -> int:
    a = parse(argv, __doc__, "tile", [("--shapes", {"default": "1x4096,16x1024,1x16384",
                                                     "help": "BxL,... (causal, q len = kv len)"})])
    if a.cmd == "gen":
        gen(a.out, a.items, a.prefix)
    elif a.cmd == "build":
        build(a.dir, a.jobs)
    else:
        return run(a.dir, a.items, a.iters, [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
