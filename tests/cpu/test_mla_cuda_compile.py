"""The CUDA MLA kernels (``tir_kernels/mla_cuda.py``) build: TVM lowers them to CUDA source, nvcc compiles it.

No GPU is needed (TVM returns a source-only CUDA module when no CUDA driver is loaded). Per configuration
(H, kv_lora_rank, qk_rope_head_dim, dtype) the test checks that
(a) ``tvm.compile`` of the four MLA ops for ``sm_90`` succeeds and the source holds a ``__global__`` kernel
    for each (plus the split-KV merge kernel of the decode), with explicit thread bindings and 16-byte page
    accesses, and
(b) ``nvcc --cubin -arch=sm_90a -O3`` compiles that source (the nvcc jobs of all configurations run in
    parallel; skipped when nvcc is absent) without register spills and with at most 48 KB of static
    shared memory per kernel.

The numerical check of these kernels needs a GPU (``tests/gpu``).

Run: ``.venv/bin/python -m pytest tests/cpu/test_mla_cuda_compile.py -q``
"""

from __future__ import annotations

import functools
import pathlib
import re

import pytest
from _cuda_support import cuda_source_of, nvcc_all

ROOT = pathlib.Path(__file__).resolve().parents[2]
from pagedkv.tir_kernels import mla_cuda  # noqa: E402
from pagedkv.tir_kernels._common import fast_macro_expansion  # noqa: E402

import tvm
from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)

# (H, kv_lora_rank, qk_rope_head_dim, dtype): DeepSeek-V3 per 8-GPU shard, a small fp32 latent with a head
# count that leaves padding rows, and the full DeepSeek-V3 head count, also in bfloat16 (its checkpoint's
# dtype).
CONFIGS = [
    (16, 512, 64, "float16"),
    (3, 64, 32, "float32"),
    (128, 512, 64, "float16"),
    (128, 512, 64, "bfloat16"),
]
IDS = ["x".join(map(str, c)) for c in CONFIGS]
OPS = ("mla_append_kv", "mla_gather_kv", "mla_attn_prefill_paged", "mla_attn_decode_paged")
SMEM_LIMIT = 48 * 1024


def mla_spec(h: int, rank: int, rope: int, dtype: str):
    """The ``KernelSpec`` of an MLA configuration (the factories take the spec), the decode and the paged prefill
    forced to the SIMT kernels (``cuda_mla_decode_kernel=simt``, ``cuda_mla_prefill_kernel=simt``; the tensor-core
    ones, auto for fp16 / bf16: ``test_mla_tc_compile.py``, ``test_mla_prefill_tc_compile.py``)."""
    from pagedkv.kernel_spec import KernelSpec

    return KernelSpec(h, h, 64, 64, dtype, kv_lora_rank=rank, qk_rope_head_dim=rope,
                      paths={"cuda_mla_decode_kernel": "simt", "cuda_mla_prefill_kernel": "simt"})


def build_funcs(cfg: tuple) -> dict:
    """``{op: PrimFunc}`` of the four MLA ops for ``cfg``."""
    spec = mla_spec(*cfg)
    with fast_macro_expansion():
        return {op: getattr(mla_cuda, f"{op}_cuda")(spec) for op in OPS}


@functools.cache
def cuda_source(cfg: tuple) -> str:
    """CUDA source of the four MLA ops for ``cfg`` (cached per session)."""
    funcs = build_funcs(cfg)
    with SM80:
        exe = tvm.compile(tvm.IRModule({f"pagedkv_{op}": f for op, f in funcs.items()}), target=SM80)
    return cuda_source_of(exe)


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory):
    """nvcc on every configuration's source, the jobs run in parallel: ``{cfg: (returncode, log)}``."""
    return nvcc_all(CONFIGS, cuda_source, tmp_path_factory.mktemp("mla_cuda"), "mla_")


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_every_mla_op_lowers_to_cuda(cfg):
    for op, func in build_funcs(cfg).items():
        assert func.attrs["global_symbol"] == f"pagedkv_{op}"
        assert bool(func.attrs["tirx.is_scheduled"]), op
    src = cuda_source(cfg)
    for op in OPS:
        assert re.search(rf"__global__ void __launch_bounds__\(\d+\) pagedkv_{op}_kernel\b", src), \
            f"no CUDA kernel for {op}"
    # The decode's split-KV merge is a second kernel of the same PrimFunc.
    assert re.search(r"__global__ void __launch_bounds__\(\d+\) pagedkv_mla_attn_decode_paged_kernel_1\b", src)
    assert "threadIdx.x" in src and "blockIdx.x" in src
    # 16-byte page accesses (uint4 for fp16 / float4 for fp32).
    assert ("*(uint4*)(pages" in src) or ("*(float4*)(pages" in src)
    # Static shared memory only.
    assert "extern __shared__" not in src


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_nvcc_compiles_mla_for_sm90a(cfg, nvcc_results):
    rc, log = nvcc_results[cfg]
    assert rc == 0, f"nvcc failed for {cfg}:\n{log[-4000:]}"
    spills = [line for line in log.splitlines() if re.search(r"[1-9]\d* bytes spill", line)]
    assert not spills, "register spills:\n" + "\n".join(spills)
    smem = [int(m) for m in re.findall(r"(\d+) bytes smem", log)]
    assert smem and max(smem) <= SMEM_LIMIT, f"static shared memory {smem} over {SMEM_LIMIT}"
    _, rank, rope, _ = cfg
    assert max(smem) <= mla_cuda.smem_bytes(16, rank + rope), (smem, "smem_bytes() is not an upper bound")


def test_block_plan():
    """16 rows per block for DeepSeek-V3 latents (512 + 64) within 48 KB; 8 rows for latents past 576."""
    assert mla_cuda.smem_bytes(16, 576) <= SMEM_LIMIT < mla_cuda.smem_bytes(16, 640)
    assert mla_cuda.rows_per_thread("mla_attn_decode_paged", 512, 64) == 2
    assert mla_cuda.rows_per_thread("mla_attn_decode_paged", 64, 32) == 2
    assert mla_cuda.rows_per_thread("mla_attn_prefill_paged", 1024, 64) == 1
    assert mla_cuda.smem_bytes(8, mla_cuda.MAX_LATENT) <= SMEM_LIMIT


@pytest.mark.parametrize("factory, args, match", [
    ("mla_attn_decode_paged_cuda", (16, 72, 64, "float16"), "kv_lora_rank=72"),
    ("mla_attn_prefill_paged_cuda", (16, 512, 40, "float16"), "qk_rope_head_dim=40"),
    ("mla_attn_prefill_paged_cuda", (16, 2048, 64, "float32"), "kv_lora_rank up to 1024"),
    ("mla_attn_decode_paged_cuda", (16, 1024, 256, "float16"), "up to 1216"),
])
def test_unsupported_latents_name_the_dim(factory, args, match):
    with pytest.raises(NotImplementedError, match=match):
        getattr(mla_cuda, factory)(mla_spec(*args))


def test_backend_limits_match_the_kernels():
    """The TIR backend's CUDA MLA reasons (pure Python, for runtime-only processes) agree with the kernels."""
    from pagedkv import KVCacheConfig, ops
    from pagedkv.backends import get_backend
    from pagedkv.backends.tir import MLA_CUDA_MAX_LATENT, MLA_CUDA_MAX_RANK

    mc = mla_cuda
    assert (MLA_CUDA_MAX_RANK, MLA_CUDA_MAX_LATENT) == (mc.MAX_ACC // 4 * mc.DC, mc.MAX_LATENT)
    tir = get_backend("tir")
    for r, rope, ok in [(512, 64, True), (1024, 192, True), (520, 64, False), (1088, 64, False),
                        (1024, 256, False)]:
        cfg = KVCacheConfig.mla(num_layers=1, num_heads=4, kv_lora_rank=r, qk_nope_head_dim=64,
                                qk_rope_head_dim=rope, v_head_dim=64)
        reasons = tir.validate_configuration(ops.MLA_ATTN_DECODE_PAGED, cfg, {"kind": "cuda", "arch": "sm_90"})
        assert (not reasons) == ok, (r, rope, reasons)
        if ok:
            mc.rows_per_thread("mla_attn_decode_paged", r, rope)
        else:
            with pytest.raises(NotImplementedError):
                mc.rows_per_thread("mla_attn_decode_paged", r, rope)
