"""The partial-state kernels build for CUDA and nvcc compiles them (no GPU).

A multi-pass forward (shared-prefix passes, the own pass, a prefill's ragged pass) runs each pass on its op's
partial-state variant (``pagedkv.ops.PARTIAL_OF``: the same kernel writing ``o`` in float32, ``KernelSpec.partial``)
and merges with ``merge_state_partial`` (float32 states, ``o`` rounded once). Covering set of the variants each
op runs (``pagedkv.kernel_table``), one CUDA source per case:

- MHA on sm_90a, auto: the wgmma prefill tiles (wg1t ragged, wg2t paged, each holding its mma.sync fallback tile),
  the SIMT inline-RoPE prefill of the same PrimFuncs, the tensor-core decode (plain and RoPE);
- MHA on sm_80, auto: tc3 ragged, tc2 paged; forced: tc2 on both prefill ops (the ragged one's auto is tc3) with
  the staged decode, and at head dim 96 (bf16) the SIMT prefill with the lane-group decode;
- MLA on sm_90a, auto at 128 heads (wgq, with its wg fallback), and on sm_80 forced: tc decode, SIMT paged prefill.

Per case, every partial op's PrimFunc declares ``o`` float32 (the rest of its header is its op's). The CUDA source
is generated for every case but ``mha-sm80-auto`` (its tc3 / tc2 partial tiles are generated, compiled and run by
``test_prefill_tc_emulated.py``): its attention kernels take a ``float*`` o. ``nvcc --cubin -arch=sm_90a`` compiles
the two sm_90a cases (the wgmma tiles and MLA's wgq, whose registers are tightest) without register spills; the
other variants' stores differ from theirs only in the loop that writes ``o``. The default kernels are
unchanged by the variants (``tools/tir_hashes.py``: structural hashes). Numbers: the emulated runs
(``test_prefill_tc_emulated.py``, ``test_decode_tc_emulated.py``) and the CPU forward (``test_prefix_precision.py``).
"""

from __future__ import annotations

import functools
import re

import pytest
from _cuda_support import nvcc_all, ops_cuda_source

from pagedkv import ops
from pagedkv import tir_kernels as tk

from tvm.target import Target
from tvm.tirx.buffer import is_buffer_var

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
SM90A = Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64)
#: name -> (spec, target).
CASES = {
    "mha-sm90a-auto": (tk.KernelSpec(32, 8, 128, 128, "float16"), SM90A),
    "mha-sm80-auto": (tk.KernelSpec(32, 8, 128, 128, "bfloat16"), SM80),
    "mha-sm80-tc2-staged": (tk.KernelSpec(32, 8, 128, 128, "float16",
                                          paths={"cuda_prefill_kernel": "tc2", "cuda_decode_kernel": "staged"}), SM80),
    "mha-sm80-d96-simt-lanes": (tk.KernelSpec(12, 4, 96, 96, "bfloat16", paths={"cuda_decode_kernel": "lanes"}),
                                SM80),
    # 128 heads, as test_mla_prefill_tc_compile's wgq case: at 16 the default prefill's wg fallback kernel already
    # spills (312 bytes, CUDA 13), its partial variant 316.
    "mla-sm90a-auto": (tk.KernelSpec(128, 128, 192, 128, "float16", **_MLA), SM90A),
    "mla-sm80-tc-simt": (tk.KernelSpec(16, 16, 192, 128, "bfloat16", **_MLA,
                                       paths={"cuda_mla_decode_kernel": "tc", "cuda_mla_prefill_kernel": "simt"}),
                         SM80),
}


def _partial_ops(spec) -> tuple[str, ...]:
    return tuple(op for op in ops.ops_for(spec) if op in ops.PARTIAL_OPS)


#: The cases whose CUDA source is generated here, and those nvcc compiles.
SOURCE_CASES = [name for name in CASES if name != "mha-sm80-auto"]
NVCC_CASES = ["mha-sm90a-auto", "mla-sm90a-auto"]


@functools.cache
def _source(name: str) -> str:
    spec, target = CASES[name]
    return ops_cuda_source(spec, _partial_ops(spec), target)


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory):
    """nvcc on the sm_90a cases' sources, in parallel: ``{name: (returncode, log)}``."""
    return nvcc_all(NVCC_CASES, _source, tmp_path_factory.mktemp("cuda_partial"), "partial_")


@pytest.mark.parametrize("name", list(CASES))
def test_partial_kernels_declare_float32_o(name):
    spec, target = CASES[name]
    funcs = tk.build_kernels(spec, target, ops=_partial_ops(spec))
    assert set(funcs) == set(ops.PARTIAL_OPS) & set(ops.OPS_BY_KIND["mla" if spec.is_mla else "mha"])
    for op, func in funcs.items():  # (test_ops_table checks every header against the op table)
        params = {str(p.name): str(p.dtype) for p in func.params if is_buffer_var(p)}
        if op == ops.MERGE_STATE_PARTIAL:
            assert (params["o_a"], params["o_b"], params["o"]) == ("float32", "float32", spec.dtype), params
        else:
            assert (params["o"], params["q"]) == ("float32", spec.dtype), (op, params)


@pytest.mark.parametrize("name", SOURCE_CASES)
def test_partial_kernels_write_float32(name):
    spec, _target = CASES[name]
    src = _source(name)
    for op in _partial_ops(spec):
        kernels = re.findall(rf"__global__ void __launch_bounds__\(\d+\) (pagedkv_{op}_kernel\w*)\(([^)]*)\)", src)
        assert kernels, f"no CUDA kernel for {op}"
        if op != ops.MERGE_STATE_PARTIAL:  # the attention kernels writing o (a split merge kernel too, if any)
            assert any(re.search(r"float\* __restrict__ o_ptr\b", params) for _k, params in kernels), (op, kernels)


@pytest.mark.parametrize("name", NVCC_CASES)
def test_partial_kernels_nvcc_no_spills(name, nvcc_results):
    rc, log = nvcc_results[name]
    assert rc == 0, f"nvcc failed for {name}:\n{log[-4000:]}"
    spills = [line for line in log.splitlines() if re.search(r"[1-9]\d* bytes spill", line)]
    assert not spills, "register spills:\n" + "\n".join(spills)
