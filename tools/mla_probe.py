#!/usr/bin/env python3
"""Time the CUDA MLA decode kernels alone on the GPU host, and variants of them with one stage left out.

``tools/prefill_probe.py``'s method for ``mla_attn_decode_paged`` (DeepSeek's latent 512 + 64, fp16, pages of
64): on the build host ``gen`` writes TVM's CUDA source of the op for each kernel choice
(``cuda_mla_decode_kernel``), with a C launcher per shape appended that makes the launches TVM's host code makes
for that shape (the split kernel and the merge, their grids and scalar arguments evaluated from the lowered host
function, the pool's tensor map encoded through the driver). ``KERNEL@VARIANT[+VARIANT]`` edits the wgmma
kernel's body first, for timing only (the outputs are then wrong and not checked):

* ``noexp``: the softmax's ``exp2f`` calls become the identity (what the special-function unit costs);
* ``nosync``: the kernel's ``__syncthreads`` are gone (what the block barrier's lockstep costs);
* ``noqs`` / ``noqpv``: wgq's S / all its P V wgmma's are gone (what the tensor cores' time of each is).

On the GPU host, ``build`` compiles each source into a shared library (sm_90a) and ``run`` times each (CUDA
events), checks the plain kernels against a float32 PyTorch reference and prints TFLOP/s. Profile one with
``ncu ... python3 tools/mla_probe.py run DIR KERNEL --iters 1``.

    python tools/mla_probe.py gen .gpu-var/mla wgq wgq@noexp wgq@noqs tc     # build host (TVM)
    PYTHONPATH=$OTHER/python python tools/mla_probe.py gen .gpu-var/mla --prefix new- wgq   # another checkout
    python3 tools/mla_probe.py build .gpu-var/mla                            # GPU host (nvcc)
    python3 tools/mla_probe.py run .gpu-var/mla wgq,wgq@noexp,tc             # GPU host (PyTorch)
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from prefill_probe import build, parse, time_calls  # the same nvcc build (TVM's flags), command line, timing

H, R, ROPE, PS = 128, 512, 64, 64
DL = R + ROPE
OP = "mla_attn_decode_paged"
#: (batch, keys an entry) the launchers are generated for.
SHAPES = ((64, 8192), (128, 1024))
#: Pointer parameters by name (the launcher's ``P[]`` order).
POINTERS = ("q", "pages", "page_indptr", "page_values", "last_page_len", "o", "lse", "ws_o", "ws_l")
_WG_CALL = r"pagedkv_wgmma_n{n}_f16_t{t}\("
EDITS = {"noexp": (("exp2f(", "("),),
         "nosync": (("__syncthreads();", ";"),),
         # wgq: its S (both operands in shared memory), and all its P V's (either form).
         "noqs": ((re.compile(r"pagedkv_wgmma_ss_n(32|64)_f16_t0\("), "pk_noop_ss("),),
         "noqpv": ((re.compile(r"pagedkv_wgmma_ss_n256_f16_t1\("), "pk_noop_ss("),
                   (re.compile(_WG_CALL.format(n=R // 2, t=1)), "pk_noop_wg("))}
_NOOP = ("__device__ __forceinline__ void pk_noop_wg(float*, const void*, const void*, unsigned, unsigned, unsigned, "
         "int, int) {}\n__device__ __forceinline__ void pk_noop_ss(float*, const void*, unsigned, unsigned, unsigned, "
         "int, const void*, unsigned, unsigned, unsigned, int, int) {}\n")


def file_stem(name: str) -> str:
    return name.replace("@", "__").replace("+", "-")


def _host_env(b: int, n: int) -> dict:
    pages = b * (n // PS) + 1
    return {"B": b, "_p": pages, "ps": PS, "nnz": b * (n // PS), "sm_scale": 1 / math.sqrt(192), "max_kv_len": n,
            "dev_id": 0, "aligned16": True}


def _launcher(tag: str, kernels: dict, calls: list, launch_params: dict) -> str:
    """``pk_launch_TAG(P)``: the host code's launches of one shape, the pool's tensor map encoded first."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pagedkv.tir_kernels._tma_cuda import LatentPageMap, decode_args

    lines = [f'extern "C" int pk_launch_{tag}(void** P, long long pool_pages) {{']
    for kname, args in calls:
        params = kernels[kname]
        vals = []
        for i, (ty, pname) in enumerate(params):
            if "CUtensorMap" in ty:
                from pagedkv.tir_kernels import mla_cuda_wgq

                m = LatentPageMap(DL, mla_cuda_wgq.box_rows(PS))  # the host code's box
                # The pool's page count is the launcher's argument (a C expression); the rank-2 map counts rows.
                shape = ([f"(cuuint64_t)pool_pages * {PS}", 1, 1, 1, DL] if m.rank == 2 else
                         ["(cuuint64_t)pool_pages", 1, 1, PS, DL])
                a = decode_args(m.rank, m.encode_args(shape))
                r = m.rank
                lines.append(f"  CUtensorMap {pname};\n  {{ cuuint64_t dims[{r}] = {{{', '.join(map(str, a.dims))}}}; "
                             f"cuuint64_t str[{r - 1}] = {{{', '.join(map(str, a.strides))}}};\n    cuuint32_t "
                             f"box[{r}] = {{{', '.join(map(str, a.box))}}}, es[{r}] = "
                             f"{{{', '.join(map(str, a.elem_strides))}}};\n    int rc = pk_encode()(&{pname}, "
                             f"CU_TENSOR_MAP_DATA_TYPE_FLOAT16, {r}, P[1], dims, str, box, es, "
                             f"(CUtensorMapInterleave){a.interleave}, (CUtensorMapSwizzle){a.swizzle}, "
                             f"(CUtensorMapL2promotion){a.l2_promotion}, (CUtensorMapFloatOOBfill){a.oob_fill});\n"
                             f"    if (rc) return 1000 + rc; }}")
                vals.append(pname)
            elif ty.endswith("*"):
                vals.append(f"({ty})P[{POINTERS.index(re.sub(r'_ptr(_[0-9]+)?$', '', pname))}]")
            else:
                if args[i] is None:
                    raise SystemExit(f"{kname}: argument {pname} not evaluated")
                vals.append(repr(float(args[i])) + "f" if ty == "float" else str(int(args[i])))
        dims = dict(zip(launch_params[kname], args[len(params):]))
        grid = ", ".join(str(int(dims.get(k, 1))) for k in ("blockIdx.x", "blockIdx.y", "blockIdx.z"))
        smem = int(dims.get("tirx.use_dyn_shared_memory", 0))
        lines.append(f"  cudaFuncSetAttribute({kname}, cudaFuncAttributeMaxDynamicSharedMemorySize, {max(smem, 1)});")
        lines.append(f"  {kname}<<<dim3({grid}), dim3({int(dims['threadIdx.x'])}), {smem}>>>({', '.join(vals)});")
    lines.append("  return (int)cudaGetLastError();\n}\n")
    return "\n".join(lines)


def gen(out: Path, names: list[str], prefix: str = "") -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cpu"))
    import tvm
    from _decode_emu import host_main, launches  # the emulated tests' host-code evaluation
    from prefill_probe import _ENCODE  # the driver's encode, looked up once
    from tvm.target import Target

    from pagedkv import tir_kernels as tk
    from pagedkv.testing.cuda_source import kernel_defs

    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    target = Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    for name in names:
        base, *variants = name.split("@")
        cfg = tk.KernelSpec(H, H, 64, 64, "float16", kv_lora_rank=R, qk_rope_head_dim=ROPE,
                              paths={"cuda_mla_decode_kernel": base})
        func = tk.build_kernels(cfg, target, ops=(OP,))[OP]
        with target:
            exe = tvm.compile(tvm.IRModule({f"pagedkv_{OP}": func}), target=target)
        src = next(s for m in exe.mod.imports for s in [m.inspect_source()] if "__global__" in s)
        main, launch_params = host_main(func)
        kdefs = kernel_defs(src)
        first = kdefs[0]  # the split kernel TVM emits first (wgq: the TMA one, before its fallback)
        body = first.text(src)
        for v in "+".join(variants).split("+") if variants else ():
            for a, b in EDITS[v]:
                body = a.sub(b, body) if isinstance(a, re.Pattern) else body.replace(a, b)
        src = _NOOP + src[:first.start] + body + src[first.end:]
        launchers, splits = [], {}
        for b, n in SHAPES:
            env = _host_env(b, n)
            calls = launches(main, env)
            splits[f"{b}x{n}"] = env["S"]
            launchers.append(_launcher(f"{b}x{n}", {k.name: k.params for k in kdefs}, calls, launch_params))
        (out / f"{file_stem(prefix + name)}.cu").write_text("#include <cuda.h>\n" + src + _ENCODE + "\n".join(launchers))
        meta[prefix + name] = {"splits": splits}
        print(prefix + name, meta[prefix + name], flush=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def run(d: Path, names: list[str], iters: int) -> int:
    import ctypes
    import os

    import torch

    meta = json.loads((d / "meta.json").read_text())
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    bad = 0
    for b, n in SHAPES:
        tag, pages_n = f"{b}x{n}", b * (n // PS)
        q = torch.randn(b, H, DL, device="cuda", dtype=torch.float16)
        kv = torch.randn(b, n, DL, device="cuda", dtype=torch.float16)
        order = torch.randperm(pages_n, device="cuda").to(torch.int32)
        pages = torch.full((pages_n + 1, 1, 1, PS, DL), float("nan"), device="cuda", dtype=torch.float16)
        pages[order.long(), 0, 0] = kv.reshape(pages_n, PS, DL)
        indptr = torch.arange(0, pages_n + 1, n // PS, device="cuda", dtype=torch.int32)
        last = torch.full((b,), PS, device="cuda", dtype=torch.int32)
        sm = 1 / math.sqrt(192)
        s = torch.einsum("bhd,bnd->bhn", q.float(), kv.float()) * sm
        ref = torch.einsum("bhn,bnd->bhd", s.softmax(-1), kv[..., :R].float())
        flop = 2.0 * H * (DL + R) * b * n
        for name in names:
            lib = ctypes.CDLL(str(d / f"{file_stem(name)}.so"))
            sp = meta[name]["splits"][tag]
            o = torch.full((b, H, R), float("nan"), device="cuda", dtype=torch.float16)
            lse = torch.full((b, H), float("nan"), device="cuda")
            ws_o = torch.empty(b * H * sp, R, device="cuda")
            ws_l = torch.empty(b * H * sp, device="cuda")
            ptrs = (ctypes.c_void_p * len(POINTERS))(*(x.data_ptr() for x in (q, pages, indptr, order, last, o, lse,
                                                                                ws_o, ws_l)))
            fn = getattr(lib, f"pk_launch_{tag}")

            def launch():
                rc = fn(ptrs, ctypes.c_longlong(pages_n + 1))
                if rc:
                    raise SystemExit(f"{name}: launch error {rc}")

            launch()
            torch.cuda.synchronize()
            rel = ((o.float() - ref).norm() / ref.norm()).item()
            ok = "@" in name or rel < 1e-2  # NaN fails the comparison
            bad += not ok
            t = time_calls(launch, iters) if iters > 1 and ok else float("nan")
            print(f"B{b}xL{n} {name:24s} S={sp} {t:.4f} ms {flop / t / 1e9:.0f} TFLOP/s rel {rel:.2e} "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    a = parse(argv, __doc__, "kernel")
    if a.cmd == "gen":
        gen(a.out, a.items, a.prefix)
    elif a.cmd == "build":
        build(a.dir, a.jobs)
    else:
        return run(a.dir, a.items, a.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
