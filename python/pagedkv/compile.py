"""Compile an nn model that uses ``pagedkv.relax.PagedKVCache`` into a deployable library."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import tvm
from tvm.relax.frontend import nn


def export_model(model: nn.Module) -> tuple[tvm.IRModule, list[tuple[str, Any]]]:
    """Export ``model`` with its default spec; returns the IRModule and the named parameter specs."""
    mod, named_params = model.export_tvm(spec=model.get_default_spec())
    return mod, named_params


def _cuda_pipeline(target):
    """TVM's CUDA pipeline with dlight's GEMV/reduction/fallback schedules but not its tensor-core
    ``Matmul`` rule, which segfaults in ``Tensorize`` on float16 matmuls in apache-tvm 0.27.

    Known gap (seen on the H200, 2026-11-30): without ``Matmul`` the prefill GEMM fused with RMSNorm
    (``matmul5`` of SmolLM2 in float16) is left unscheduled and ends up as host code, which crashes when
    prefill runs; decode-only GEMVs are scheduled. A GEMM schedule for fused matmuls is still needed.
    """
    from tvm.relax.backend.cuda import pipeline as cp
    from tvm.s_tir import dlight as dl

    passes = [p for p in cp.legalize_passes(target) if not isinstance(p, type(dl.ApplyDefaultSchedule()))]
    schedule = dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(), dl.gpu.Reduction(),
                                       dl.gpu.GeneralReduction(), dl.gpu.Fallback())

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod, _ctx):
        with target:
            seq = tvm.transform.Sequential(cp.library_dispatch_passes(target) + passes + [schedule]
                                           + cp.dataflow_lower_passes(target) + cp.finalize_passes(target))
            return seq(mod)

    return _pipeline


def build_library(model: nn.Module, target: Any, out_path: str | Path, *,
                  verbose: bool = False) -> tuple[Path, list[tuple[str, Any]]]:
    """Export, compile for ``target`` and write a shared library to ``out_path``.

    The library holds the model's functions and the cache's kernels; a process loads it with the TVM
    runtime after ``import pagedkv`` (which registers the ``pagedkv.*`` globals it calls). Returns the path
    and the named parameter specs, in the order the library's functions take them.
    """
    t0 = time.perf_counter()
    mod, named_params = export_model(model)
    if verbose:
        print(f"[pagedkv] exported Relax module in {time.perf_counter() - t0:.1f} s", flush=True)
    tgt = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    t1 = time.perf_counter()
    if tgt.kind.name == "cuda":
        from .cuda_build import enable_cuda_codegen

        enable_cuda_codegen()
    pipeline = _cuda_pipeline(tgt) if tgt.kind.name == "cuda" else "default"
    with tgt:
        executable = tvm.compile(mod, target=tgt, relax_pipeline=pipeline)
    if verbose:
        print(f"[pagedkv] compiled for {tgt.kind.name} in {time.perf_counter() - t1:.1f} s", flush=True)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    executable.export_library(str(out_path))
    return out_path, named_params
