"""``python -m pagedkv.apps.gpu_bundle OUT``: everything a GPU host needs to run pagedkv's GPU tests with the TVM
runtime only, built on a host without a GPU.

OUT/bundle/    runtime-only TVM + tvm-ffi wheel for the GPU host's Python (``pagedkv.apps.runtime_bundle``)
OUT/lib/       libpagedkv_runtime.so
OUT/kernels/   kernels-<key>.so/.json for every config of the GPU suite (sm_90 fatbins), and for the CUDA
               path tests' configs under each forced path (``tir_kernel_libraries``); with
               flashinfer-python 0.7.4 installed also with backends ("flashinfer", "tir") for the FlashInfer
               suite's configs (``pagedkv.testing.shapes.flashinfer_gpu_shapes``: fp16 head dim 128 and the
               DeepSeek MLA dims; its modules linked in, from the FlashInfer build cache)
OUT/models/    model libraries for the GPU model tests (when their dependencies are installed): SmolLM2 and
               DeepSeek-V3 (float32, and bfloat16 for its own layout) with their cases
OUT/upstream/  apache-tvm 0.27's own CUDA attention kernels for the benchmark shape (``--no-upstream`` skips)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from .._lib import runtime_library_path


def _runtime_bundle(out: Path) -> None:
    from .runtime_bundle import write_runtime_bundle

    t0 = time.perf_counter()
    path = write_runtime_bundle(out / "bundle")
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"[pagedkv] runtime bundle {path}: {size / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s", flush=True)


def tir_kernel_libraries() -> list[tuple]:
    """(config, forced paths) of every TIR kernel library of the bundle: the GPU suite's configs, the attention-sink
    ones (``pagedkv.testing.sinks.SINK_GPU_CONFIGS``) and the benchmark's windowed one without forced paths
    (``{}``), and those of the CUDA path tests (``pagedkv.testing.shapes.gpu_path_libraries``, built under
    ``pagedkv.backends.tir.forced_paths``)."""
    from ..testing.layer_groups import GPU_GROUPS
    from ..testing.shapes import BENCH_WINDOWED, gpu_configs, gpu_path_libraries
    from ..testing.sinks import SINK_GPU_CONFIGS

    # GPU_GROUPS (layer groups): its base library and each window's, listed apart (the build dedups by the base key)
    windows = [GPU_GROUPS.window_config(w) for w in GPU_GROUPS.group_windows]
    configs = gpu_configs() + list(SINK_GPU_CONFIGS.values()) + [BENCH_WINDOWED.config(), GPU_GROUPS, *windows]
    return [(cfg, {}) for cfg in configs] + gpu_path_libraries()


def tir_library_path(kernels: Path, config, paths: dict, target) -> Path:
    """Where the TIR kernel library of ``config`` under forced ``paths`` lies in ``kernels`` (its key), for
    ``target`` with the arch the paths need (``pagedkv.kernel_spec.target_for_paths``: "wgq" is sm_90a)."""
    from ..backends.tir import forced_paths
    from ..cache import kernel_library_path
    from ..kernel_spec import target_for_paths

    with forced_paths(paths):
        return kernel_library_path(config, kernels, target=target_for_paths(paths, target), backend="tir")


def _build_one(kernels: Path, cfg, paths: dict, target) -> tuple[Path, float]:
    """Build one TIR kernel library (in this process or a worker of ``build_kernels``): (path, seconds); for
    the arch the paths need, as ``tir_library_path``."""
    from ..backends.tir import forced_paths
    from ..cache import build_kernel_library
    from ..kernel_spec import target_for_paths

    t0 = time.perf_counter()
    with forced_paths(paths):
        path = build_kernel_library(cfg, kernels, target=target_for_paths(paths, target), backend="tir")
    return path, time.perf_counter() - t0


def default_jobs() -> int:
    """Worker processes of a kernel build: ``$PAGEDKV_BUILD_JOBS``, else the host's cores (a library is one
    TVM compile + one nvcc run, single-threaded, about 20 s at sm_90)."""
    return max(1, int(os.environ.get("PAGEDKV_BUILD_JOBS") or os.cpu_count() or 1))


def build_kernels(out: Path, libraries, target, *, jobs: int = 1) -> list[Path]:
    """Build ``(config, forced paths)`` TIR kernel libraries into ``out/kernels`` (each key once), in ``jobs``
    worker processes (spawned: each enables TVM's CUDA codegen for itself) when ``jobs > 1``. Returns the
    library paths in the order of ``libraries``' first occurrence of each key."""
    todo: dict[Path, tuple] = {}
    for cfg, paths in libraries:
        todo.setdefault(tir_library_path(out / "kernels", cfg, paths, target), (cfg, paths))
    items = list(todo.items())

    def report(i: int, path: Path, seconds: float, paths: dict) -> None:
        forced = f" paths {paths}" if paths else ""
        print(f"[pagedkv] kernels {i}/{len(items)} {path.name}{forced}: {path.stat().st_size / 1e6:.2f} MB "
              f"in {seconds:.1f} s", flush=True)

    if jobs <= 1 or len(items) <= 1:
        for i, (_, (cfg, paths)) in enumerate(items):
            report(i + 1, *_build_one(out / "kernels", cfg, paths, target), paths)
        return [p for p, _ in items]
    import concurrent.futures as cf
    import multiprocessing

    with cf.ProcessPoolExecutor(min(jobs, len(items)), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_build_one, out / "kernels", cfg, paths, target): paths
                   for _, (cfg, paths) in items}
        for i, fut in enumerate(cf.as_completed(futures)):
            path, seconds = fut.result()  # a failed build raises here and cancels the rest
            report(i + 1, path, seconds, futures[fut])
    missing = [p.name for p, _ in items if not p.exists()]
    if missing:
        raise RuntimeError(f"kernel libraries not built: {missing}")
    return [p for p, _ in items]


def prune_kernel_libraries(kernels: Path, keep) -> list[Path]:
    """Delete the kernel libraries (``kernels-<key>.so`` + ``.json``) in ``kernels`` that are not in ``keep``
    (the libraries this run built or found): a rebuilt tree leaves libraries of old keys behind, and the
    bundle must hold only what its tests and benchmarks load (one carry of the GPU tool is 64 MiB)."""
    keep = {Path(p).resolve().with_suffix("") for p in keep}
    gone = []
    for f in sorted(kernels.glob("kernels-*")):
        if f.suffix in (".so", ".json") and f.resolve().with_suffix("") not in keep:
            f.unlink()
            gone.append(f)
    if gone:
        print(f"[pagedkv] removed {len(gone)} stale kernel files of old keys from {kernels}", flush=True)
    return gone


#: The backend priority list of the FlashInfer kernel libraries (the GPU suite asks for the same list).
FLASHINFER_BACKENDS = ("flashinfer", "tir")


def build_flashinfer_kernels(out: Path, configs, target) -> list[Path]:
    """Kernel libraries with FlashInfer modules (cached builds, see ``pagedkv.flashinfer``) for the configs
    where FlashInfer serves an op; skipped, saying why, when flashinfer-python 0.7.4 is not installed."""
    from ..backends import flashinfer as fib
    from ..backends import resolve
    from ..cache import build_kernel_library
    from ..flashinfer import unavailable_reasons

    why = unavailable_reasons()
    if why:
        print(f"[pagedkv] skipping FlashInfer kernels: {'; '.join(why)}", flush=True)
        return []
    paths = []
    for cfg in configs:
        res = resolve(cfg, target, list(FLASHINFER_BACKENDS))
        for op, passed in res.reasons.items():  # e.g. a fa3 module that cannot build here: TIR serves, said
            if "flashinfer" in passed and op in fib.CHOICES:
                print(f"[pagedkv] flashinfer does not serve {op} here: {'; '.join(passed['flashinfer'])}", flush=True)
        if "flashinfer" not in res.choice.values():
            continue
        t0 = time.perf_counter()
        path = build_kernel_library(cfg, out / "kernels", target=target, backend=list(FLASHINFER_BACKENDS))
        print(f"[pagedkv] flashinfer kernels {path.name} ({res.report()}): {path.stat().st_size / 1e6:.2f} MB "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
        paths.append(path)
    return paths


#: The H200 benchmark shape (``benchmarks/bench_gpu_kernels.py``): fp16, 32 q / 8 kv heads, head dim 128.
UPSTREAM_SHAPE = {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16", "page_size": 16}


def _upstream_funcs(target) -> dict:
    """name -> (factory path, PrimFunc) of apache-tvm's CUDA attention kernels for ``UPSTREAM_SHAPE``."""
    from tvm.relax.frontend.nn.llm import kv_cache as kc

    s = UPSTREAM_SHAPE
    hkv, hq, d, dt = s["num_kv_heads"], s["num_qo_heads"], s["head_dim"], s["dtype"]
    base = "tvm.relax.frontend.nn.llm.kv_cache."
    return {  # sliding_window=False, no RoPE scaling
        "upstream_attn_decode_paged": (base + "_attention_decode",
                                       kc._attention_decode(hkv, hq, d, dt, False, {}, target,
                                                            page_size=s["page_size"])),
        "upstream_attn_prefill_paged": (base + "_attention_prefill",
                                        kc._attention_prefill(hkv, hq, d, dt, False, {}, target,
                                                              page_size=s["page_size"])),
        "upstream_attn_prefill_ragged": (base + "_attention_prefill_ragged",
                                         kc._attention_prefill_ragged(hkv, hq, d, d, dt, {}, target)),
    }


def _describe_params(func) -> list[dict]:
    """The argument list of a PrimFunc: tensors with dtype and shape, scalars with dtype."""
    from tvm.tirx.buffer import is_buffer_var  # 0.27: tensor params are Vars of BufferType

    out = []
    for p in func.params:
        if is_buffer_var(p):
            out.append({"name": str(p.name), "kind": "tensor", "dtype": str(p.dtype),
                        "shape": [str(x) for x in p.shape]})
        else:
            out.append({"name": str(p.name), "kind": "scalar", "dtype": str(p.ty)})
    return out


def build_upstream_kernels(out: Path, arch: str) -> Path:
    """Compile apache-tvm 0.27's CUDA TIR attention kernels (decode, paged prefill, ragged prefill) for the
    benchmark shape into ``out/upstream/upstream-kernels.so`` (real fatbins) + ``.json`` (symbol and
    argument order of each). Returns the library path."""
    import tvm

    from ..cuda_build import compile_for_cuda, has_device_code

    t0 = time.perf_counter()
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host="llvm")
    funcs = _upstream_funcs(target)
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, (_, f) in funcs.items()})
    lib_path = out / "upstream" / "upstream-kernels.so"
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    compile_for_cuda(mod, target).export_library(str(lib_path))
    if not has_device_code(lib_path):
        raise RuntimeError(f"{lib_path} holds no CUDA fatbin (TVM fell back to CUDA source)")
    meta = {"tvm_version": tvm.__version__, "target": {"kind": "cuda", "arch": arch}, "shape": UPSTREAM_SHAPE,
            "functions": {name: {"symbol": name, "factory": factory, "args": _describe_params(f)}
                          for name, (factory, f) in funcs.items()}}
    lib_path.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    print(f"[pagedkv] upstream kernels {lib_path.name}: {lib_path.stat().st_size / 1e6:.2f} MB "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return lib_path


#: SmolLM2 model libraries per backend choice: TIR, and FlashInfer's decode module linked into the model
#: library (head dim 64: FlashInfer's prefill modules for it would be long cold builds, so prefill stays TIR).
SMOLLM2_BACKENDS = {"tir": "tir", "flashinfer": {"attn_decode_paged": "flashinfer", "*": "tir"}}


#: Batch bound of the CUDA-graph model libraries (the end-to-end benchmark's largest batch).
GRAPH_BATCH = 32


def model_name(model: str, dtype: str, backend: str, graph: bool) -> str:
    """File name of a CUDA model library: ``smollm2-float16[-flashinfer][-graph]-cuda.so``."""
    return f"{model}-{dtype}" + ("" if backend == "tir" else f"-{backend}") + ("-graph" if graph else "") + "-cuda.so"


def _model_library(model, arch: str, path: Path) -> tuple[Path, list]:
    """``pagedkv.compile.build_library`` of ``model`` for sm ``arch`` at ``path``, checked to hold device code
    (a CUDA fatbin, not CUDA source), with its size and time printed; returns (path, named params)."""
    from ..compile import build_library
    from ..cuda_build import enable_cuda_codegen, has_device_code

    enable_cuda_codegen()
    t0 = time.perf_counter()
    lib, named = build_library(model, cuda_target(arch), path)
    if not has_device_code(lib):
        raise RuntimeError(f"{lib} holds no CUDA fatbin")
    print(f"[pagedkv] model {lib.name}: {lib.stat().st_size / 1e6:.2f} MB in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return lib, named


def cuda_target(arch: str):
    """The CUDA target the bundle's model libraries are compiled for (host code for x86-64 LLVM)."""
    import tvm

    return tvm.target.Target({"kind": "cuda", "arch": arch}, host="llvm")


def build_smollm2(out: Path, arch: str, dtype: str = "float16", backend: str = "tir", *,
                  graph: bool = False) -> Path | None:
    """SmolLM2's model library for CUDA (weights are not in it: the GPU host reads the GGUF file) and the
    parameter names in the order its functions take them; ``backend`` names an entry of
    ``SMOLLM2_BACKENDS``; ``graph``: decode steps of up to ``GRAPH_BATCH`` sequences in CUDA graphs."""
    try:
        from . import smollm2
        smollm2.gguf_path()
    except (ImportError, FileNotFoundError) as err:
        print(f"[pagedkv] skipping the SmolLM2 model library: {err}", flush=True)
        return None
    from ..models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(smollm2.SMOLLM2_135M, dtype=dtype, target=cuda_target(arch),
                             backend=SMOLLM2_BACKENDS[backend], cuda_graph_batch=GRAPH_BATCH if graph else 0)
    return _model_library(model, arch, out / "models" / model_name("smollm2", dtype, backend, graph))[0]


def build_graph_case(out: Path, arch: str, backends) -> list[Path]:
    """The CUDA-graph replay case (tests/gpu/test_cuda_graph_gpu.py, ``pagedkv.testing.graph_case``): a small
    random Llama in float16, its model library per backend with and without CUDA graphs, and its weights
    (``graph-llama.npz``: HF's state dict, for the reference on the GPU host)."""
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        print(f"[pagedkv] skipping the CUDA-graph case: {err}", flush=True)
        return []
    from ..models.llama import LlamaForCausalLM
    from ..testing import graph_case as G

    G.write_weights(out / "models" / "graph-llama.npz")
    paths = []
    for backend in backends:
        for graph in (False, True):
            model = LlamaForCausalLM(G.CONFIG, dtype="float16", target=cuda_target(arch),
                                     backend=SMOLLM2_BACKENDS[backend], cuda_graph_batch=G.GRAPH_BATCH if graph else 0)
            path = out / "models" / model_name("graph-llama", "float16", backend, graph)
            paths.append(_model_library(model, arch, path)[0])
    return paths


def build_deepseek(out: Path, arch: str) -> list[Path]:
    """The DeepSeek-V3 (MLA) end-to-end cases for the GPU: per (config, dtype) of
    ``pagedkv.testing.deepseek.GPU_CASES`` a CUDA model library and a ``.npz`` with fresh random weights
    (rounded to the dtype), the scenario and HF's float64 logits of those weights (computed here: the GPU
    host need not have a DeepseekV3-capable transformers)."""
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        print(f"[pagedkv] skipping the DeepSeek-V3 case: {err}", flush=True)
        return []
    import numpy as np

    from ..models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, params_from_hf
    from ..testing import deepseek as D

    paths = []
    for name, dtype in D.GPU_CASES:
        seed = int(np.random.SeedSequence().entropy % 2**31)
        hf = D.round_weights(D.hf_model(name, seed), dtype)
        cfg = DeepseekV3Config.from_hf(hf.config)
        model = DeepseekV3ForCausalLM(cfg, dtype=dtype, target=cuda_target(arch), backend="tir")
        lib, named = _model_library(model, arch, out / "models" / f"deepseek-{name}-{dtype}-cuda.so")
        steps, rows, history = D.scenario(np.random.default_rng(seed), cfg.vocab_size)
        D.write_case(lib.with_suffix(".npz"), name, seed, params_from_hf(hf, named, dtype), steps, rows,
                     D.hf_logits(hf, history), dtype)
        paths.append(lib)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", default="sm_90a", help="the CUDA arch (sm_90 and sm_90a are one machine, Hopper)")
    ap.add_argument("--jobs", type=int, default=default_jobs(),
                    help="worker processes of the TIR kernel builds (default: $PAGEDKV_BUILD_JOBS or the cores)")
    ap.add_argument("--no-upstream", action="store_true",
                    help="skip apache-tvm's own CUDA kernels (the kernel benchmark's baseline)")
    ap.add_argument("--no-path-libraries", action="store_true",
                    help="leave out the CUDA path tests' libraries (every code path forced: about 100 of the 135): a "
                         "bundle of the default kernels in about a fifth of the time (the path tests then fail: "
                         "deselect test_cuda_paths_gpu.py and test_prefill_tc_gpu.py)")
    ap.add_argument("--no-flashinfer", action="store_true",
                    help="a TIR-only bundle: no FlashInfer modules (their cold builds take minutes each, fa3's "
                         "about 7; the FlashInfer GPU tests then skip)")
    args = ap.parse_args(argv)
    out: Path = args.out
    (out / "lib").mkdir(parents=True, exist_ok=True)
    _runtime_bundle(out)
    shutil.copy2(runtime_library_path(), out / "lib" / "libpagedkv_runtime.so")
    if not args.no_upstream:
        build_upstream_kernels(out, args.arch)
    from ..testing.shapes import BENCH_WINDOWED, flashinfer_gpu_shapes

    target = {"kind": "cuda", "arch": args.arch}
    libraries = tir_kernel_libraries()
    if args.no_path_libraries:
        libraries = [(cfg, paths) for cfg, paths in libraries if not paths]
    built = build_kernels(out, libraries, target, jobs=args.jobs)
    if args.no_flashinfer:
        print("[pagedkv] skipping FlashInfer kernels: --no-flashinfer", flush=True)
    else:
        from ..testing.sinks import SINK_FLASHINFER_IDS, SINK_GPU_CONFIGS

        configs = [s.config() for s in flashinfer_gpu_shapes() + [BENCH_WINDOWED]]
        built += build_flashinfer_kernels(out, configs + [SINK_GPU_CONFIGS[i] for i in SINK_FLASHINFER_IDS], target)
    prune_kernel_libraries(out / "kernels", built)
    from ..flashinfer import unavailable_reasons

    backends = ["tir"] + ([] if unavailable_reasons() or args.no_flashinfer else ["flashinfer"])
    for backend in backends:
        for graph in (False, True):
            build_smollm2(out, args.arch, backend=backend, graph=graph)
    build_graph_case(out, args.arch, backends)
    build_deepseek(out, args.arch)
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"[pagedkv] GPU bundle {out}: {total / 1e6:.1f} MB", flush=True)
    if total > 60e6:
        print("[pagedkv] warning: the bundle is over 60 MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
