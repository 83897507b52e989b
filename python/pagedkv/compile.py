"""Compile an nn model that uses ``pagedkv.relax.PagedKVCache`` into a deployable library."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import tvm
from tvm.relax.frontend import nn

from . import target as _target
from .progress import Progress


def export_model(model: nn.Module) -> tuple[tvm.IRModule, list[tuple[str, Any]], list[str]]:
    """Export ``model`` with its default spec; returns the IRModule, the named parameter specs and the
    ``export_library`` options its caches' backends need (``OpBuild.export_options``). Prebuilt objects the
    backends registered (FlashInfer modules) go into ``external_mods``."""
    from .relax import collect_export_options

    with collect_export_options() as options:
        mod, named_params, ext_mods = model.export_tvm(spec=model.get_default_spec(), allow_extern=True)
    if ext_mods:
        mod = tvm.relax.transform.AttachExternModules(ext_mods)(mod)
    return _mark_cuda_graph_functions(model, mod), named_params, options


def cuda_graph_batch(model: nn.Module) -> int:
    """The batch bound of ``model``'s CUDA-graph functions (0: none; ``models._common.CausalLMExports``)."""
    batch = getattr(model, "cuda_graph_batch", 0)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"cuda_graph_batch must be an int >= 0 (0: off), got {batch!r}")
    return batch


def check_captured(mod: tvm.IRModule, functions) -> None:
    """Raises ``ValueError`` unless every cache call of each of ``functions`` (after the pipeline) is inside
    the CUDA graph that TVM's ``RewriteCUDAGraph`` captures: a step asked to run in a graph must never run
    partly outside it without saying so."""
    for name in functions:
        # check_indices reads the input ids (the one argument that changes between replays) before the
        # embedding: it belongs outside the graph, like the embedding's gather
        outside = sorted(set(re.findall(r'"(pagedkv\.[a-z_]+)"', mod[name].script())) - {"pagedkv.check_indices"})
        captured = [gv.name_hint for gv in mod.functions if gv.name_hint.startswith(f"{name}_cuda_graph_capture")]
        if outside or not captured:
            raise ValueError(f"{name}: cuda_graph_batch was asked for, but TVM's RewriteCUDAGraph left "
                             + (f"the cache calls {outside} outside the captured graph" if outside else
                                "no captured region") + " (every argument after the input ids must be fixed "
                             "across calls and the batch size the only symbolic shape)")


def _then_check_captured(pipeline, functions):
    @tvm.transform.module_pass(opt_level=0, name="CheckCUDAGraphCaptured")
    def _run(mod, _ctx):
        mod = pipeline(mod)
        check_captured(mod, functions)
        return mod

    return _run


def _mark_cuda_graph_functions(model: nn.Module, mod: tvm.IRModule) -> tvm.IRModule:
    """Annotates the functions ``model`` runs in CUDA graphs for TVM's ``RewriteCUDAGraph`` pass (enabled by
    ``build_library``): ``num_input = 1`` marks every argument after the input ids (the cache object and the
    weights) as fixed across calls, so the whole step from the embedding's output to the final norm, the
    cache's attention calls included, is one static region; the batch-size variable is captured (one graph
    per batch size) and bounded, so memory planning gives the region storage of constant size, which the
    pass allocates once and keeps."""
    batch = cuda_graph_batch(model)
    if not batch:
        return mod
    for name, var in model.CUDA_GRAPH_FUNCTIONS.items():
        gv = mod.get_global_var(name)
        func = mod[gv]
        if len(func.params) < 2:
            raise ValueError(f"{name}: a CUDA-graph function takes the input ids, then the fixed arguments")
        mod[gv] = (func.with_attr("num_input", 1)
                   .with_attr("relax.rewrite_cuda_graph.capture_symbolic_vars", [var])
                   .with_attr("tir_var_upper_bound", {var: batch}))
    return mod


def _simt_matmul_rule():
    """dlight's GPU ``Matmul`` rule kept off its tensor-core path: in apache-tvm 0.27 that path segfaults in
    ``Tensorize`` for float16 GEMMs (any fp16 ``nn.Linear`` with a dynamic row count, sm_80 and sm_90 alike).
    The rule picks tensor cores from the target's arch, so it is shown an sm_60 CUDA target; the SIMT
    schedule it then writes is valid on every newer GPU."""
    from tvm.s_tir import dlight as dl

    simt_target = tvm.target.Target({"kind": "cuda", "arch": "sm_60"})

    class SimtMatmul(dl.gpu.Matmul):
        def apply(self, func, target, tunable):  # noqa: D102
            return super().apply(func, simt_target, tunable)

    return SimtMatmul()


#: Symbolic row counts of the exported functions (``models._common.CausalLMExports.get_default_spec``): ``b``
#: stays small (a decode step's batch, the rows whose logits a prefill returns), ``n`` (prefill tokens) not.
SMALL_ROW_VARS, ROW_VARS = frozenset({"b"}), frozenset({"b", "n"})


def _row_vars(func) -> set[str]:
    """The row-count variables (``ROW_VARS``) that ``func`` refers to."""
    from tvm import tirx

    return {v.name for v in tirx.analysis.undefined_vars(func.body) if v.name in ROW_VARS}


def _one_warp(target):
    """``target`` with ``max_num_threads`` 32: ``LowBatchGEMV`` then gives each block one warp. With its
    default (64 reduction threads) SmolLM2's K = 576 (no factor of 128 x 4) splits into scalar loads; one
    warp reads it as vector-2 loads and makes 4x the blocks. Measured on the H200 (benchmarks/HISTORY.md): a batch-1
    SmolLM2 graph step 1.55 -> 1.14 ms, batch 8 1.77 -> 1.35 ms; a half warp (16) was slower than both."""
    spec = dict(target.export())
    spec["max_num_threads"] = 32
    return tvm.target.Target(spec)


def _small_rows_gemv_rule():
    """dlight's ``LowBatchGEMV`` for the projections of a few rows (decode steps, the logits of a prefill),
    ``None`` otherwise (then the SIMT ``Matmul`` rule schedules it). The ``Matmul`` rule tiles 32 rows x 64
    columns per block and walks K serially: with a few rows that leaves 9 to 48 blocks per SmolLM2 projection,
    each latency-bound (about 6 ms per decode step in all); the GEMV schedule splits K over threads."""
    from tvm import tirx
    from tvm.s_tir import dlight as dl

    class SmallRowsGEMV(dl.gpu.LowBatchGEMV):
        def apply(self, func, target, tunable):  # noqa: D102
            if not isinstance(func, tirx.PrimFunc):
                return None
            rows = _row_vars(func)
            if not rows or not rows <= SMALL_ROW_VARS:
                return None
            return super().apply(func, _one_warp(target), tunable)

    return SmallRowsGEMV()


def _cuda_pipeline(target):
    """TVM's CUDA pipeline, with dlight's GPU rules, but the GEMM rule on SIMT (see ``_simt_matmul_rule``)."""
    from tvm.relax.backend.cuda import pipeline as cp
    from tvm.s_tir import dlight as dl

    # FuseTransposeMatmul: nn.Linear's x @ W.T becomes one NT matmul kernel; without it every step (a decode
    # step too) transposes every weight into a temporary first, reading and writing all weights once more
    passes = [tvm.relax.transform.FuseTransposeMatmul()]
    passes += [p for p in cp.legalize_passes(target) if not isinstance(p, type(dl.ApplyDefaultSchedule()))]
    schedule = dl.ApplyDefaultSchedule(_small_rows_gemv_rule(), _simt_matmul_rule(), dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(),
                                       dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod, _ctx):
        with target:
            seq = tvm.transform.Sequential(cp.library_dispatch_passes(target) + passes + [schedule]
                                           + cp.dataflow_lower_passes(target) + cp.finalize_passes(target))
            return seq(mod)

    return _pipeline


def relax_pipeline(target: tvm.target.Target, report: dict | None = None):
    """The Relax pipeline for ``target``: ``_cuda_pipeline`` for CUDA, ``pagedkv.cpu_pipeline`` for llvm (TVM's
    default leaves every CPU matmul unscheduled), TVM's default otherwise. ``report`` (CPU) collects what was
    done to each PrimFunc."""
    if target.kind.name == "cuda":
        return _cuda_pipeline(target)
    if target.kind.name == "llvm":
        from .cpu_pipeline import cpu_pipeline

        return cpu_pipeline(target, report)
    return "default"


def _compile_model(model: nn.Module, mod: tvm.IRModule, tgt: tvm.target.Target, report: dict):
    """``tvm.compile`` of the exported ``mod`` for ``tgt`` with pagedkv's pipeline (``report``: what the CPU
    pipeline did to each PrimFunc); CUDA graphs when the model asks for them, checked after the pipeline."""
    if tgt.kind.name == "cuda":
        from .cuda_build import enable_cuda_codegen

        enable_cuda_codegen()
    pipeline = relax_pipeline(tgt, report)
    graphs = cuda_graph_batch(model) > 0
    if graphs:
        pipeline = _then_check_captured(pipeline, tuple(model.CUDA_GRAPH_FUNCTIONS))
    with tgt, tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": graphs}):
        return tvm.compile(mod, target=tgt, relax_pipeline=pipeline)


def _report_line(report: dict) -> str:
    """What the CPU pipeline did to the model's functions, counted per kind ("12 scheduled, 3 fallback")."""
    kinds = sorted(set(report.values()))
    return ", ".join(f"{sum(v == k for v in report.values())} {k}" for k in kinds)


def build_library(model: nn.Module, target: Any, out_path: str | Path, *, verbose: bool = False,
                  progress: Progress | None = None) -> tuple[Path, list[tuple[str, Any]]]:
    """Export, compile for ``target`` and write a shared library to ``out_path``.

    The library holds the model's functions and the cache's kernels; a process loads it with the TVM
    runtime after ``import pagedkv`` (which registers the ``pagedkv.*`` globals it calls).

    Parameters
    ----------
    model : nn.Module
        The model (its caches ``pagedkv.relax.PagedKVCache``).
    target : Any
        Any spelling of the target (``pagedkv.target``); compiled for its canonical value.
    out_path : str or Path
        The library; the parameter names go beside it (``.json``).
    verbose : bool
        Also report what the CPU pipeline did to the model's functions.
    progress : Progress, optional
        Where the stages go (a caller's build, e.g. a disk cache entry); else the build prints its own
        progress lines on stderr (a header, each stage, ticks while TVM compiles, ``done`` or ``FAILED``).

    Returns
    -------
    tuple
        The path and the named parameter specs, in the order the library's functions take them.
    """
    # Every spelling of the target compiles for its canonical value (pagedkv.target: sm_90 is sm_90a), the one
    # the cache's kernels were chosen for; the lines say which arch a CUDA build is for.
    tgt = _target.to_tvm(target)
    if cuda_graph_batch(model) and tgt.kind.name != "cuda":
        raise ValueError(f"cuda_graph_batch needs a CUDA target, got {tgt.kind.name}")
    if progress is None:
        with Progress(f"compiling the model for {_target.describe(target)}", detail=f"into {out_path}") as own:
            return build_library(model, target, out_path, verbose=verbose, progress=own)
    progress.stage("exporting the Relax module")
    mod, named_params, options = export_model(model)
    count = len(mod.functions)
    progress.stage(f"TVM compiles the model ({count} function{'s' if count != 1 else ''}) for "
                   f"{_target.describe(target)}")
    report: dict = {}
    executable = _compile_model(model, mod, tgt, report)
    if verbose and report:
        progress.stage(f"model functions: {_report_line(report)}")
    progress.stage("writing the library")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    executable.export_library(str(out_path), **({"options": options} if options else {}))
    # The parameter order, beside the library, so loaders need no re-export (see ``pagedkv.engine.param_names``).
    meta = {"param_names": [n for n, _ in named_params]}
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if isinstance(vocab, int):  # so pagedkv.engine.Engine checks token ids before a forward begins
        meta["vocab_size"] = vocab
    out_path.with_suffix(".json").write_text(json.dumps(meta))
    return out_path, named_params
