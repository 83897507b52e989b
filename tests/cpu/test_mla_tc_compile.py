"""The tensor-core CUDA MLA decode (``tir_kernels/mla_cuda_tc.py``) on the build host: no GPU.

(a) ``nvcc --cubin -arch=sm_90a`` compiles TVM's source of ``mla_attn_decode_paged`` (tc forced) for DeepSeek's
    latent (512 + 64) at 16 heads fp16 (one m16 tile a block) and 128 heads bf16 (two): no register spills, at
    most 255 registers (256 threads a block), static shared memory within 48 KB and static + dynamic
    (``smem_bytes``) within sm_90's 227 KB a block; the source holds ``mma.sync`` and the dynamic buffer.
(b) The path switch ``cuda_mla_decode_kernel``: auto takes tc where ``tc_unserved`` is empty and wgq does not
    serve (``pagedkv.kernel_table``), SIMT elsewhere (fp32, latents it does not take); "simt" forces SIMT; "tc" on a spec it
    does not serve raises with the reasons.

(c) The wgmma kernel with Q in shared memory (``mla_cuda_wgq``, forced ``wgq``, sm_90a; its PrimFunc also holds
    ``mla_cuda_wg``'s kernel, the fallback where TMA cannot read the pages): the same resource checks and the
    wgmma counts of both kernels; a target other than sm_90a, and specs they do not serve, raise naming every
    reason.

The numerics: ``test_mla_tc_emulated.py`` (CPU emulation) and ``tests/gpu`` (the path cases of
``pagedkv.testing.shapes.mla_path_cases``).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
from _cuda_support import cuda_source_of, nvcc_all, ptxas_usage, stack_frames

from pagedkv.kernel_table import choose, variants
from pagedkv.ops import MLA_ATTN_DECODE_PAGED
from pagedkv import tir_kernels as tk
from pagedkv.tir_kernels import mla_cuda, mla_cuda_tc, mla_cuda_wg, mla_cuda_wgq
from pagedkv.tir_kernels._common import fast_macro_expansion

import tvm
from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)
SWITCH = mla_cuda_tc.SWITCH
#: (heads, kv_lora_rank, qk_rope_head_dim, dtype)
CONFIGS = [(16, 512, 64, "float16"), (128, 512, 64, "bfloat16")]
IDS = ["x".join(map(str, c)) for c in CONFIGS]
STATIC_SMEM, MAX_SMEM = 48 * 1024, 227 * 1024


def spec(h, rank, rope, dtype, value="tc"):
    return tk.KernelSpec(h, h, 64, 64, dtype, kv_lora_rank=rank, qk_rope_head_dim=rope, paths={SWITCH: value})


@functools.cache
def cuda_source(cfg: tuple) -> str:
    with fast_macro_expansion():
        func = mla_cuda.mla_attn_decode_paged_cuda(spec(*cfg))
    with SM80:
        exe = tvm.compile(tvm.IRModule({"pagedkv_mla_attn_decode_paged": func}), target=SM80)
    return cuda_source_of(exe)


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory):
    return nvcc_all(CONFIGS, cuda_source, tmp_path_factory.mktemp("mla_tc"), "mla_tc_")


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_tc_decode_compiles_without_spills(cfg, nvcc_results):
    src = cuda_source(cfg)
    assert "mma.sync.aligned.m16n8k16" in src and "extern __shared__" in src and "cp.async.cg" in src
    rc, log = nvcc_results[cfg]
    assert rc == 0, f"nvcc failed for {cfg}:\n{log[-4000:]}"
    usage = ptxas_usage(log)
    tc = usage["pagedkv_mla_attn_decode_paged_kernel"]
    assert tc[1:] == (0, 0), f"spills {tc}"
    assert tc[0] <= 255, tc
    assert not any(stack_frames(log).values()), stack_frames(log)  # no local arrays left in memory
    print(cfg, usage)
    static = [int(m) for m in re.findall(r"(\d+) bytes smem", log)]
    h, rank, rope, _ = cfg
    rows = mla_cuda_tc.group_rows(h)
    dyn = mla_cuda_tc.smem_bytes(rows, rank + rope)
    assert max(static) <= mla_cuda_tc.static_smem_bytes(rows) <= STATIC_SMEM, static
    assert max(static) + dyn <= MAX_SMEM, (static, dyn)


def test_block_plan():
    """16 heads a block up to 16, 32 past; DeepSeek's latent fits two stages for 32 rows."""
    assert [mla_cuda_tc.group_rows(h) for h in (1, 16, 17, 128)] == [16, 16, 32, 32]
    assert mla_cuda_tc.static_smem_bytes(32) <= STATIC_SMEM
    assert mla_cuda_tc.smem_bytes(32, 576) + mla_cuda_tc.static_smem_bytes(32) <= MAX_SMEM


def _uses_tc(s) -> bool:
    with fast_macro_expansion():
        return "pagedkv_mma_" in mla_cuda.mla_attn_decode_paged_cuda(s).script()


def test_switch_is_registered():
    assert tk.SWITCHES[SWITCH][1] == ("auto", "simt", "tc", "wgq")  # wgq: below (sm_90a)
    assert spec(16, 128, 64, "float16", "auto").paths == ()


@pytest.mark.parametrize("value", ["auto", "simt", "tc"])
def test_switch_picks_the_kernel(value):
    s = spec(16, 128, 64, "bfloat16", value)
    assert mla_cuda_tc.tc_unserved(s) == []
    assert _uses_tc(s) == (value in ("tc", "auto"))  # auto: tc serves (the spec names no Hopper arch)


@pytest.mark.parametrize("args, reason", [
    ((4, 64, 32, "float32"), "dtype float32"),
    ((16, 512, 128, "float16"), "latent dim 640"),
    ((16, 64, 32, "bfloat16"), "kv_lora_rank 64"),
])
def test_unserved_specs_run_simt_or_raise_forced(args, reason):
    """auto falls back to SIMT where tc does not serve; forcing tc raises, naming every reason."""
    assert any(reason in r for r in mla_cuda_tc.tc_unserved(spec(*args)))
    assert choose(MLA_ATTN_DECODE_PAGED, spec(*args, "auto")).name == "simt"
    with pytest.raises(NotImplementedError, match=f"{SWITCH}=tc.*{reason}"):
        mla_cuda.mla_attn_decode_paged_cuda(spec(*args, "tc"))


def test_forced_tc_lists_every_reason():
    """DeepSeek's dims in fp32: the dtype alone; a small fp32 latent: dtype, latent and rank."""
    assert [r.split(" (")[0] for r in mla_cuda_tc.tc_unserved(spec(16, 512, 64, "float32"))] == ["dtype float32"]
    reasons = mla_cuda_tc.tc_unserved(spec(4, 64, 32, "float32"))
    assert [r.split(" (")[0] for r in reasons] == ["dtype float32", "latent dim 96", "kv_lora_rank 64"]
    with pytest.raises(NotImplementedError, match="dtype float32.*; latent dim 96.*; kv_lora_rank 64"):
        mla_cuda.mla_attn_decode_paged_cuda(spec(4, 64, 32, "float32"))


def test_fp32_auto_is_the_simt_kernel():
    assert not _uses_tc(spec(3, 64, 32, "float32", "auto"))


# The wgmma kernel (``mla_cuda_wgq``, ``cuda_mla_decode_kernel=wgq``): sm_90a only; auto at 16+ heads there.
SM90A = Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
#: (heads, kv_lora_rank, qk_rope_head_dim, dtype): DeepSeek-V3 (two head groups; O 2 x 256 dims, 128
#: accumulators a thread) and V2-Lite's 16 heads (48 padding rows).
WG_CONFIGS = [(128, 512, 64, "float16"), (16, 512, 64, "bfloat16")]


#: The wgmma kernel forced (TMA latent tiles), whose PrimFunc also holds wg's kernel (its fallback).
WG_CASES = [("wgq", c) for c in WG_CONFIGS]


@functools.cache
def wg_cuda_source(case: tuple) -> str:
    kernel, cfg = case
    with fast_macro_expansion():
        func = mla_cuda.mla_attn_decode_paged_cuda(dataclasses.replace(spec(*cfg, kernel), target_arch="sm_90a"))
    with SM90A:
        exe = tvm.compile(tvm.IRModule({"pagedkv_mla_attn_decode_paged": func}), target=SM90A)
    return cuda_source_of(exe)


@pytest.mark.parametrize("case", WG_CASES, ids=[k + "-" + "x".join(map(str, c)) for k, c in WG_CASES])
def test_wg_decode_compiles_without_spills(case, tmp_path):
    """No spills in at most 255 registers (256 threads), static + dynamic shared memory within 227 KB, and the
    wgmma's of both kernels of the PrimFunc in the source: wg's (the fallback) per tile ``DL / 32`` m64n32k16 (S,
    A = Q) and ``TK / 16`` m64n{DV/2}k16 (P V); wgq's ``DL / 16`` m64n64k16 with both operands in shared memory
    (S) and ``2 TK / 16`` m64n{DV/2}k16, one warpgroup's P from registers, the other's from shared memory."""
    _kernel, cfg = case
    src = wg_cuda_source(case)
    rc, log = nvcc_all([case], wg_cuda_source, tmp_path, "mla_wg_")[case]
    assert rc == 0, log[-4000:]
    assert "instructions are serialized" not in log and "warpgroup.wait is injected" not in log, log[-3000:]
    usage = ptxas_usage(log)
    for name, (regs, *spills) in usage.items():
        assert spills == [0, 0] and regs <= 255, (name, regs, spills)
    assert not any(stack_frames(log).values()), stack_frames(log)
    print(case, usage)
    h, rank, rope, _ = cfg
    # Each kernel's static shared memory beside its dynamic (TVM emits the PrimFunc's own kernel first, then wg's
    # fallback and the merge kernels).
    static = {m.group(1): int(m.group(2) or 0) for m in re.finditer(
        r"Compiling entry function '(\w+)'.*?Used \d+ registers, used \d+ barriers(?:, (\d+) bytes smem)?", log, re.S)}
    assert static["pagedkv_mla_attn_decode_paged_kernel"] + mla_cuda_wgq.smem_bytes(rank + rope) <= MAX_SMEM, static
    assert static.get("pagedkv_mla_attn_decode_paged_kernel_2", 0) + mla_cuda_wg.smem_bytes(rank + rope) <= MAX_SMEM
    body = src.split("#endif")[-1]
    assert len(re.findall(r"pagedkv_wgmma_n32_b?f16_t0\(", body)) == (rank + rope) // 32
    pv = len(re.findall(rf"pagedkv_wgmma_n{rank // 2}_b?f16_t1\(", body))
    tk = mla_cuda_wgq.TK
    assert len(re.findall(rf"pagedkv_wgmma_ss_n{tk}_b?f16_t0\(", body)) == (rank + rope) // 16
    assert len(re.findall(rf"pagedkv_wgmma_ss_n{rank // 2}_b?f16_t1\(", body)) == tk // 16
    pv -= tk // 16  # the score warpgroup's (P from registers)
    assert pv == mla_cuda_wg.TK // 16
    assert "CUtensorMap" in body


def test_wg_needs_sm90a_and_names_every_reason():
    with pytest.raises(NotImplementedError, match=f"{SWITCH}=wgq: .*target arch"):
        mla_cuda.mla_attn_decode_paged_cuda(spec(128, 512, 64, "float16", "wgq"))
    reasons = mla_cuda_wgq.wgq_unserved(dataclasses.replace(spec(4, 96, 16, "float32", "wgq"), target_arch="sm_90a"))
    assert [r.split(" (")[0] for r in reasons] == ["dtype float32", "latent dim 112", "kv_lora_rank 96"]
    assert mla_cuda_wgq.wgq_unserved(dataclasses.replace(spec(128, 512, 64, "bfloat16", "wgq"),
                                                         target_arch="sm_90a")) == []


def _kernel_of(s) -> str:
    with fast_macro_expansion():
        script = mla_cuda.mla_attn_decode_paged_cuda(s).script()
    return "wgq" if "pagedkv_wgmma_" in script else "tc" if "pagedkv_mma_" in script else "simt"


@pytest.mark.parametrize("heads, arch, dtype, want", [
    (128, "sm_90a", "float16", "wgq"), (64, "sm_90a", "bfloat16", "wgq"), (32, "sm_90a", "float16", "wgq"),
    (16, "sm_90a", "bfloat16", "wgq"), (8, "sm_90a", "float16", "tc"), (128, "sm_90", "float16", "wgq"),
    (128, "sm_80", "float16", "tc"),
    (128, "sm_90a", "float32", "simt")])
def test_auto_picks_wgmma_on_sm90a_by_heads(heads, arch, dtype, want):
    """auto: wgq where it serves the spec (Hopper: sm_90 = sm_90a, fp16 / bf16) from 16 heads (the table's
    ``min_heads``); the mma.sync kernel below that or before Hopper, SIMT for fp32."""
    assert next(v for v in variants(MLA_ATTN_DECODE_PAGED) if v.name == "wgq").min_heads == 16
    s = dataclasses.replace(spec(heads, 512, 64, dtype, "auto"), target_arch=arch)
    assert choose(MLA_ATTN_DECODE_PAGED, s).name == want
    assert _kernel_of(s) == want
