"""The tensor-core CUDA decode kernel (``tir_kernels/_decode_tc_cuda.py``, ``cuda_decode_kernel=tc``) on the build
host: no GPU.

- its limits as data (``tc_decode_limits``: fp16 / bf16, head dims 64 / 128, GQA groups up to 16) and the switch:
  forcing tc where the limits refuse raises with the reasons; auto takes it for the plain and the inline-RoPE
  variant where the selection table (``pagedkv.kernel_table``) serves it (then the same TIR as forced); "lanes" /
  "staged" never; other ops are unchanged by the switch;
- the generated CUDA under ``nvcc --cubin -arch=sm_90a``: no spills, the registers that keep 2 blocks (D 128) /
  3 blocks (D 64) resident, ``D / 4`` MMAs a key tile per warp unrolled, the RoPE kernel's ``D / 32`` 8-pair
  rotations a lane and tile, and the dynamic shared memory (the 3-slot ring, + the RoPE tables) that the host
  code launches each with.

The numerical check is ``tests/cpu/test_decode_tc_emulated.py`` (CPU emulation of the generated CUDA) and, on a
GPU, the path cases ``pagedkv.testing.shapes.TC_DECODE_SHAPES`` in ``tests/gpu/test_cuda_paths_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from _cuda_support import nvcc_all, ops_cuda_source, ptxas_usage, stack_frames
from _decode_emu import TC_SWITCHES, set_tc_switch

from pagedkv import tir_kernels as tk
from pagedkv.tir_kernels import _decode_tc_cuda as tc
from pagedkv.tir_kernels import _mma_cuda as mma_cuda
from pagedkv.tir_kernels import attention_cuda_decode as dec

from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)
SWITCH = "cuda_decode_kernel"
OP = "attn_decode_paged"
#: nvcc shapes: name -> (config, most registers of the tc kernel). 2 blocks an SM at D 128 are set by the shared
#: memory (2 x 104,448 bytes); the register bounds keep the measured counts (139 / ~96) from creeping up.
NVCC = {
    # 165 since chunked split ranges (the q load skipped in a split without keys; 160 before): two blocks an SM
    # are set by shared memory and allow 255
    "32x8x128-f16": (tk.KernelSpec(32, 8, 128, 128, "float16"), 168),
    "64x8x128-bf16-w300-cap3": (tk.KernelSpec(64, 8, 128, 128, "bfloat16", sliding_window=300,
                                                logits_soft_cap=3.0), 168),
    "32x2x64-f16": (tk.KernelSpec(32, 2, 64, 64, "float16"), 128),
    "4x4x64-bf16": (tk.KernelSpec(4, 4, 64, 64, "bfloat16"), 128),
}


#: Registers the RoPE kernel may take beyond the plain bound: a lane's angles live in registers (48 floats:
#: base, tile step, row step) and its chunks are loaded before they are rotated; measured 229 (packed fp16) and
#: 239 (float32 rotation) at 32/8/128 fp16 against the plain 160 (both with the next tile's page lookups in 16
#: registers). Two blocks an SM (set by shared memory) leave
#: 255 a thread.
ROPE_REGS = 80


def _with(cfg, **paths):
    return dataclasses.replace(cfg, paths=paths)


def test_limits_are_data():
    for g in (1, 4, 7, 8, 16):
        for d in (64, 128):
            for dt in ("float16", "bfloat16"):
                assert tc.tc_decode_limits(g, d, dt) == []
    assert tc.tc_decode_limits(4, 128, "float32") == ["dtype float32 (the tensor-core decode takes float16, bfloat16)"]
    assert "head_dim 96" in tc.tc_decode_limits(4, 96, "float16")[0]
    assert "GQA group 32" in tc.tc_decode_limits(32, 128, "bfloat16")[0]
    assert len(tc.tc_decode_limits(32, 256, "float32")) == 3
    assert tc.smem_words(128) * 4 == 104448 and tc.smem_words(64) * 4 == 55296
    # + frequencies, the 16-offset table and 4 warps' base angles (float32): still 2 blocks an SM at D 128
    assert tc.smem_words(128, rope=True) * 4 == 104448 + 512 and tc.smem_words(64, rope=True) * 4 == 55296 + 256
    assert 2 * (tc.smem_words(128, rope=True) * 4 + 1024) <= 233472


def test_switch_values_and_forced_tc_raises():
    assert tk.SWITCHES[SWITCH][1] == ("auto", "lanes", "staged", "tc")
    cfg = tk.KernelSpec(32, 8, 128, 128, "float16")
    assert dec.use_tc(_with(cfg, cuda_decode_kernel="tc"))
    assert not dec.use_tc(_with(cfg, cuda_decode_kernel="lanes"))
    assert not dec.use_tc(_with(cfg, cuda_decode_kernel="staged"))
    # inline RoPE follows the switch: tc forced runs the tensor-core RoPE kernel, staged the staged one
    assert dec.use_tc(_with(cfg, cuda_decode_kernel="tc"), rope=True)
    assert not dec.use_tc(_with(cfg, cuda_decode_kernel="staged"), rope=True)
    for bad, why in ((tk.KernelSpec(8, 2, 128, 128, "float32"), "dtype float32"),
                     (tk.KernelSpec(8, 2, 96, 96, "float16"), "head dims 96/96"),
                     (tk.KernelSpec(64, 2, 128, 128, "float16"), "GQA group 32")):
        with pytest.raises(NotImplementedError, match=f"cuda_decode_kernel=tc: .*{why}"):
            dec.use_tc(_with(bad, cuda_decode_kernel="tc"))
        with pytest.raises(NotImplementedError, match=why):
            tk.FACTORIES[OP](_with(bad, cuda_decode_kernel="tc"), SM80)
        assert not dec.use_tc(bad)  # auto: never where refused


def test_auto_is_the_tables_choice():
    """auto builds what the selection table names: the tensor-core kernel (plain and inline RoPE) where it
    serves, the same TIR as forced; the staged kernel where it does not (fp32)."""
    cfg = tk.KernelSpec(16, 2, 64, 64, "bfloat16", sliding_window=40, logits_soft_cap=5.0)
    assert dec.use_tc(cfg) and dec.use_tc(cfg, rope=True)
    forced = tk.FACTORIES[OP](_with(cfg, cuda_decode_kernel="tc"), SM80).script()
    staged = tk.FACTORIES[OP](_with(cfg, cuda_decode_kernel="staged"), SM80).script()
    assert tk.FACTORIES[OP](cfg, SM80).script() == forced != staged
    fp32 = tk.KernelSpec(16, 2, 64, 64, "float32")
    assert not dec.use_tc(fp32) and dec.use_staged(fp32)


def test_other_ops_ignore_the_tc_value():
    cfg = tk.KernelSpec(8, 2, 64, 64, "float16")
    for op in ("attn_prefill_paged", "attn_prefill_ragged", "merge_state"):
        assert (tk.FACTORIES[op](_with(cfg, cuda_decode_kernel="tc"), SM80).script()
                == tk.FACTORIES[op](cfg, SM80).script())


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tcd")

    def source(key):
        return ops_cuda_source(_with(NVCC[key[0]][0], cuda_decode_kernel="tc"), (OP,), SM80)

    return workdir, nvcc_all([(name,) for name in NVCC], source, workdir, "tcd_")


def _bodies(source: str) -> dict:
    out = {}
    for m in re.finditer(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\([^)]*\) \{\n', source):
        out[m.group(1)] = source[m.end():source.index("\n}\n", m.end())]
    return out


@pytest.mark.parametrize("name", list(NVCC))
def test_tc_nvcc_no_spills_registers_mma(name, nvcc_results):
    workdir, results = nvcc_results
    rc, log = results[(name,)]
    assert rc == 0, log[-3000:]
    usage = ptxas_usage(log)
    assert usage and all(max(u[1:]) == 0 for u in usage.values()), usage
    assert not any(stack_frames(log).values()), stack_frames(log)  # no local arrays left in memory
    cfg, most = NVCC[name]
    bodies = _bodies((workdir / f"tcd_{name}.cu").read_text())
    tc_kernels = [k for k, b in bodies.items() if "tcd_smem" in b]
    assert len(tc_kernels) == 2, list(bodies)  # plain and inline RoPE
    for k in tc_kernels:
        body, regs = bodies[k], usage[k][0]
        rope = "pagedkv_rope_rotl_" in body
        print(f"{name}: tc kernel{' (RoPE)' if rope else ''} {regs} registers; all {usage}")
        assert regs <= most + (ROPE_REGS if rope else 0), (name, k, regs)
        # S (D / 16 k steps x 2 n8 tiles) and P V (D / 8 n8 tiles) of a warp's 16 keys, unrolled once
        assert len(re.findall(r"\bpagedkv_mma_b?f16\(", body)) == cfg.head_dim // 4
        # every 16-byte copy with the L2 prefetch hint of CP_ASYNC_L2_PREFETCH, none without
        pf = mma_cuda.CP_ASYNC_L2_PREFETCH
        copy = "pagedkv_cp_async16(" if pf is None else f"pagedkv_cp_async16_pf{pf}("
        assert body.count(copy) == 2 * (tc.TCD_TK * cfg.head_dim // 8) // tc.TCD_NT * 3
        assert len(re.findall(r"\bpagedkv_cp_async16(_pf\d+)?\(", body)) == body.count(copy)
        # RoPE: one rotation call a tile (a lane's D/32 chunks of its warp's 16 keys)
        assert len(re.findall(r"\bpagedkv_rope_rotl_b?f16_j\d+_r\d+_h\d+(_p)?\(", body)) == (1 if rope else 0)
    assert sum("pagedkv_rope_rotl_" in bodies[k] for k in tc_kernels) == 1
    assert "mma" not in "".join(b for k, b in bodies.items() if k not in tc_kernels)  # merge: SIMT


@pytest.mark.knobs
def test_tc_switches_nvcc(tmp_path, monkeypatch):
    """The kernel's non-default build switches (``PACKED_F16 = False``: fp16 keys rotated in float32;
    ``TCD_WARP_RING`` inverted: per-warp copies in the plain kernel, block-wide in the RoPE one;
    ``TCD_LOOKUP_AHEAD`` inverted: D 128's page lookups right before their copies; ``CP_ASYNC_L2_PREFETCH =
    None``: copies without the L2 prefetch hint) compile for sm_90a without spills or stack, within the
    register bounds: all four flipped in one build (they change separate parts of the kernel; one nvcc run
    instead of four, the emulated tests run each alone)."""
    for switch in TC_SWITCHES:
        set_tc_switch(monkeypatch, switch)
    cfg, most = NVCC["32x8x128-f16"]
    src = ops_cuda_source(_with(cfg, cuda_decode_kernel="tc"), (OP,), SM80)
    assert "__hfma2(" not in src and "pagedkv_cp_async16_pf128((" not in src
    rc, log = nvcc_all([("switches",)], lambda key: src, tmp_path, "tcdsw_")[("switches",)]
    assert rc == 0, log[-3000:]
    usage = ptxas_usage(log)
    assert usage and all(max(u[1:]) == 0 for u in usage.values()), usage
    assert not any(stack_frames(log).values()), stack_frames(log)
    assert max(u[0] for u in usage.values()) <= most + ROPE_REGS, usage
    print(usage)


def test_copy_helpers_reject_values_they_have_no_ptx_for(monkeypatch):
    """An L2 prefetch size other than None / 128, or a wait depth past 2, raises instead of naming a helper
    the CUDA source does not define (nvcc would fail far from the cause)."""
    monkeypatch.setattr(mma_cuda, "CP_ASYNC_L2_PREFETCH", 256)
    with pytest.raises(ValueError, match="CP_ASYNC_L2_PREFETCH"):
        mma_cuda.cp_async16(0, 0)
    with pytest.raises(ValueError, match="wait_group 3"):
        mma_cuda.cp_async_wait(3)
