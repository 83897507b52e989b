"""A model compiled with ``cuda_graph_batch`` captures its whole decode step, attention included, in one CUDA
graph: TVM's ``RewriteCUDAGraph`` lifts everything from the embedding's output to the final norm into one
capture function (run by ``vm.builtin.cuda_graph.run_or_capture``, one graph per batch size) whose storage is
allocated once (``vm.builtin.cuda_graph.get_cached_alloc``). Checked on the Relax module after the CUDA
pipeline (no GPU needed); replays are tested on the GPU (tests/gpu/test_cuda_graph_gpu.py)."""

from __future__ import annotations

import re

import pytest
import tvm

from pagedkv.compile import build_library, check_captured, export_model, relax_pipeline
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.testing import graph_case as G

SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")


def _lowered(backend, graph_batch: int) -> tvm.IRModule:
    model = LlamaForCausalLM(G.CONFIG, dtype="float16", target=SM90, backend=backend,
                             cuda_graph_batch=graph_batch)
    mod, _, _ = export_model(model)
    with SM90, tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": graph_batch > 0}):
        return relax_pipeline(SM90)(mod)


def _names(mod) -> list[str]:
    return [gv.name_hint for gv in mod.functions]


@pytest.fixture(scope="module")
def graph_mod():
    return _lowered("tir", G.GRAPH_BATCH)


def test_decode_step_is_one_capture(graph_mod):
    assert "decode_cuda_graph_capture" in _names(graph_mod)
    assert not [n for n in _names(graph_mod) if n.startswith("decode_cuda_graph_capture") and n[-1].isdigit()]
    capture = graph_mod["decode_cuda_graph_capture"].script()
    calls = capture.count('"pagedkv.attention_with_fused_qkv"')
    assert calls == G.CONFIG.num_hidden_layers, f"{calls} attention calls in the capture function"
    decode = graph_mod["decode"].script()
    assert decode.count("vm.builtin.cuda_graph.run_or_capture") == 1
    assert "vm.builtin.cuda_graph.get_cached_alloc" in decode
    assert '"pagedkv.attention_with_fused_qkv"' not in decode  # every one is in the graph
    # the token ids (the one argument that changes between replays) are range-checked before the embedding's
    # unchecked gather, outside the graph
    assert decode.index('"pagedkv.check_indices"') < decode.index("take(") < decode.index("run_or_capture")
    attrs = graph_mod["decode"].attrs
    assert attrs["tir_var_upper_bound"]["b"] == G.GRAPH_BATCH


def test_no_graph_without_the_option():
    mod = _lowered("tir", 0)
    assert not [n for n in _names(mod) if "cuda_graph" in n]
    # build_library checks the capture after the pipeline: a step left outside a graph is an error
    with pytest.raises(ValueError, match=r"decode: cuda_graph_batch was asked for, but .*pagedkv.attention_with_fused_qkv"):
        check_captured(mod, ["decode"])


def test_captured_step_passes_the_check(graph_mod):
    check_captured(graph_mod, ["decode"])


def test_weights_are_not_transposed_per_step(graph_mod):
    """FuseTransposeMatmul: projections are NT matmul kernels, not a transpose of the weight plus a matmul."""
    prims = [n for n in _names(graph_mod) if isinstance(graph_mod[n], tvm.tirx.PrimFunc)]
    assert not [n for n in prims if n.startswith("transpose")], prims
    assert [n for n in prims if "NT_matmul" in n]


def test_graphs_need_a_cuda_target(tmp_path):
    model = LlamaForCausalLM(G.CONFIG, dtype="float32", target="llvm", backend="tir", cuda_graph_batch=2)
    with pytest.raises(ValueError, match="cuda_graph_batch needs a CUDA target"):
        build_library(model, "llvm", tmp_path / "m.so")


def _thread_extents(func) -> dict[str, int]:
    """``threadIdx.*`` extents bound in a scheduled PrimFunc (read from its TVMScript)."""
    found = {}
    for extent, tag in re.findall(r'T\.thread_binding\((?:T\.int64\()?(\d+)\)?, thread="(threadIdx\.[xyz])"\)', func.script()):
        found[tag] = max(found.get(tag, 0), int(extent))
    return found


def test_decode_projections_run_one_warp_per_block(graph_mod):
    """The projections of a decode step (row var ``b``) are LowBatchGEMV kernels of one warp (K = 576 reads as
    vector loads; benchmarks/HISTORY.md has the measurement); a prefill's (``n`` rows) stay on the SIMT matmul tiles."""
    from pagedkv.compile import _row_vars

    prims = {n: graph_mod[n] for n in _names(graph_mod) if isinstance(graph_mod[n], tvm.tirx.PrimFunc)}
    small = {n: f for n, f in prims.items() if "NT_matmul" in n and _row_vars(f) == {"b"}}
    large = {n: f for n, f in prims.items() if "NT_matmul" in n and "n" in _row_vars(f)}
    assert small and large, sorted(prims)
    for name, func in small.items():
        ext = _thread_extents(func)
        assert ext and all(v <= 32 for v in ext.values()) and ext.get("threadIdx.x", 1) * ext.get("threadIdx.y", 1) <= 32, (name, ext)
    assert any(_thread_extents(f).get("threadIdx.x", 1) * _thread_extents(f).get("threadIdx.y", 1) > 32
               for f in large.values()), {n: _thread_extents(f) for n, f in large.items()}
