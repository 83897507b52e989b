"""The paged MLA prefill on the tensor-core MLA kernels (``cuda_mla_prefill_kernel``; the decodes' blocks in
``tir_kernels._mla_frame_cuda.make_prefill_frame``) on the build host: no GPU.

(a) ``nvcc --cubin`` compiles TVM's source of ``mla_attn_prefill_paged`` for DeepSeek's latent (512 + 64): the
    mma.sync kernel (tc) at 16 heads fp16 and 128 heads bf16 for sm_80, and the wgmma kernel (wgq, with its
    fallback) at 128 heads fp16 for sm_90a: no register spills or stack, at most 255 registers, and the instructions of the kernel
    asked for (a frame around a decode's block must not cost the block its registers).
(b) The switch: auto takes the kernel the decode's auto takes on the same spec (the selection table: wgq on
    Hopper at 16+ heads, tc below or before Hopper, SIMT for fp32); a forced kernel on
    a spec it does not serve raises naming the prefill switch and the reasons; "simt" keeps the SIMT kernel.

The numerics: ``test_mla_tc_emulated.py`` (``PREFILL_CASES``, CPU emulation) and ``tests/gpu`` (the MLA path
cases of ``pagedkv.testing.shapes.mla_path_cases``).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from _cuda_support import cuda_source_of, nvcc_all, ptxas_usage, stack_frames

from pagedkv import tir_kernels as tk
from pagedkv.kernel_table import choose
from pagedkv.ops import MLA_ATTN_DECODE_PAGED
from pagedkv.tir_kernels import mla_cuda
from pagedkv.tir_kernels._common import fast_macro_expansion

import tvm
from tvm.target import Target

OP = "mla_attn_prefill_paged"
SWITCH = mla_cuda.PREFILL_SWITCH
SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)
SM90A = Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
#: (kernel, heads, dtype, arch): what nvcc compiles, and the instruction its source must hold.
CASES = [("tc", 16, "float16", "sm_80"), ("tc", 128, "bfloat16", "sm_80"), ("wgq", 128, "float16", "sm_90a")]
MARK = {"tc": "mma.sync.aligned.m16n8k16", "wgq": "wgmma.mma_async"}


def spec(heads, dtype, kernel, arch="sm_80"):
    s = tk.KernelSpec(heads, heads, 64, 64, dtype, kv_lora_rank=512, qk_rope_head_dim=64, paths={SWITCH: kernel})
    return dataclasses.replace(s, target_arch=arch)


@functools.cache
def cuda_source(case: tuple) -> str:
    kernel, heads, dtype, arch = case
    target = SM90A if arch == "sm_90a" else SM80
    with fast_macro_expansion():
        func = mla_cuda.mla_attn_prefill_paged_cuda(spec(heads, dtype, kernel, arch))
    with target:
        exe = tvm.compile(tvm.IRModule({f"pagedkv_{OP}": func}), target=target)
    return cuda_source_of(exe)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_prefill_compiles_without_spills(case, tmp_path):
    src = cuda_source(case)
    assert MARK[case[0]] in src and ("CUtensorMap" in src) == (case[0] == "wgq")
    rc, log = nvcc_all([case], cuda_source, tmp_path, "mla_prefill_")[case]
    assert rc == 0, log[-4000:]
    assert "instructions are serialized" not in log and "warpgroup.wait is injected" not in log, log[-3000:]
    usage = ptxas_usage(log)
    assert usage, log[-2000:]
    for name, (regs, *spills) in usage.items():
        assert spills == [0, 0] and regs <= 255, (name, regs, spills)
    assert not any(stack_frames(log).values()), stack_frames(log)
    print(case, usage)


def _kernel_of(s) -> str:
    with fast_macro_expansion():
        script = mla_cuda.mla_attn_prefill_paged_cuda(s).script()
    return "wgq" if "pagedkv_wgmma_ss_" in script else "tc" if "pagedkv_mma_" in script else "simt"


@pytest.mark.parametrize("heads, arch, dtype, want", [
    (128, "sm_90a", "float16", "wgq"), (64, "sm_90a", "bfloat16", "wgq"), (32, "sm_90a", "float16", "wgq"),
    (16, "sm_90a", "bfloat16", "wgq"), (8, "sm_90a", "float16", "tc"), (128, "sm_90", "float16", "wgq"),
    (128, "sm_80", "float16", "tc"), (128, "sm_90a", "float32", "simt")])
def test_auto_takes_the_decodes_kernel(heads, arch, dtype, want):
    s = spec(heads, dtype, "auto", arch)
    assert mla_cuda.prefill_kernel(s) == want and _kernel_of(s) == want
    assert choose(MLA_ATTN_DECODE_PAGED, s).name == want  # the decode's auto on the same spec


def test_forced_simt_and_unserved_kernels():
    assert _kernel_of(spec(16, "float16", "simt")) == "simt"
    with pytest.raises(NotImplementedError, match=f"{SWITCH}=tc: .*dtype float32"):
        mla_cuda.mla_attn_prefill_paged_cuda(spec(16, "float32", "tc"))
    with pytest.raises(NotImplementedError, match=f"{SWITCH}=wgq: .*target arch"):
        mla_cuda.mla_attn_prefill_paged_cuda(spec(128, "float16", "wgq", "sm_80"))


def test_switch_is_registered():
    from pagedkv.kernel_spec import PATH_ARCHS, SWITCHES

    assert SWITCHES[SWITCH][1] == ("auto", "simt", "tc", "wgq")
    assert PATH_ARCHS[(SWITCH, "wgq")] == "sm_90a"
