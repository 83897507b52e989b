"""Every pagedkv TIR kernel builds for CUDA: TVM lowers it to CUDA source and nvcc compiles that source.

No GPU is needed (TVM returns a source-only CUDA module when no CUDA driver is loaded; the source is
also kept when one is). Per kernel configuration the test checks that
(a) ``tvm.compile`` of every MHA op (fp16 / bf16: the partial-state variants too; the attention-sink ops, whose
    specs here have ``attention_sinks``) for ``sm_90`` (and for a generic CUDA target) succeeds and the source holds
    a ``__global__`` kernel for every op, with explicit thread bindings (``source_ops``: the ops not compiled for
    the same spec by another module), and
(b) ``nvcc --cubin -arch=sm_90a -O3`` compiles that source (one ``.cu`` per configuration, the nvcc jobs
    of all configurations run in parallel; skipped when nvcc is absent) without register spills.

The attention kernels' compile-time masking options (``sliding_window``, ``logits_soft_cap``) get the same
checks on their own (window only, soft cap only, both), and with both 0 they must be the default kernels.

The numerical check of these kernels needs a GPU (``tests/gpu``).

Run: ``.venv/bin/python -m pytest tests/cpu/test_cuda_compile.py -q``
"""

from __future__ import annotations

import functools
import pathlib
import re

import pytest
from _cuda_support import cuda_source_of, nvcc_all, ops_cuda_source, ptxas_usage

ROOT = pathlib.Path(__file__).resolve().parents[2]
from pagedkv import tir_kernels as tk  # noqa: E402
from pagedkv.ops import PARTIAL_OPS, SINK_OPS, ops_for  # noqa: E402

import tvm
from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)

# (Hq, Hkv, D, Dv, dtype): GQA groups 4, 7, 3, 8; head dims 128, 64, 96, 256; float16 and float32 here, bfloat16
# in ``MASKED_CONFIGS`` (Llama 3's shape, 32 q / 8 kv heads, head dim 128, with both masking options: the attention
# ops; the other ops differ from float16's by the storage type only).
CONFIGS = [
    (32, 8, 128, 128, "float16"),
    (7, 1, 64, 64, "float32"),
    (12, 4, 96, 96, "float16"),
    (16, 2, 256, 256, "float16"),
]
IDS = ["x".join(map(str, c)) for c in CONFIGS]

#: The attention ops, which take the masking options.
ATTN_OPS = ("attn_prefill_ragged", "attn_prefill_paged", "attn_decode_paged")
#: (Hq, Hkv, D, Dv, dtype, sliding_window, logits_soft_cap): both options on the H200 benchmark shape (fp16 and
#: bf16) and on float32 group 1 (where the prefill kernels have the least register headroom). Each option alone
#: changes the TIR (``test_masking_off_is_the_default_kernel``) and runs on the GPU in the suite's window-only and
#: cap-only shapes (``testing.shapes``); nvcc runs once a config here (a CUDA compile of three ops each), so the
#: single-option configs are not compiled again.
MASKED_CONFIGS = [shape + (100, 50.0) for shape in [(32, 8, 128, 128, "float16"), (4, 4, 64, 64, "float32")]]
MASKED_CONFIGS.append((32, 8, 128, 128, "bfloat16", 100, 50.0))  # both options in bf16
MASKED_IDS = ["x".join(map(str, c[:5])) + f"-w{c[5]}-cap{c[6]:g}" for c in MASKED_CONFIGS]
#: (config id, op) -> spill bytes allowed (stores and loads; default 0) in the op's first kernel. None today: the
#: staged inline-RoPE decode kernel in float32 with a soft cap and no window spilled 4 bytes at 96 registers
#: while it rotated keys in its score; rotating them at the stage it takes 80 (ptxas, CUDA 13).
KNOWN_SPILLS: dict[tuple[str, str], int] = {}


def _generic_cuda_target() -> Target:
    """A CUDA target without an arch (TVM 0.27 picks a default when it cannot detect a GPU)."""
    return Target({"kind": "cuda"}, host="llvm")


def _spec(cfg: tuple) -> tk.KernelSpec:
    """The spec of a ``CONFIGS`` entry, with the attention-sink ops (two small elementwise kernels)."""
    return tk.KernelSpec(*cfg, attention_sinks=True)


def source_ops(cfg: tuple) -> tuple[str, ...]:
    """The ops whose CUDA source this file generates and nvcc-compiles for ``cfg``: every op but the partial-state
    variants (the same kernels writing a float32 o: ``test_partial_compile.py`` generates and compiles them on a
    covering set; doing it here again per config cost about 80 s of the suite), with the sink ops on the first
    config only (two elementwise kernels whose code does not depend on the config's tiles)."""
    drop = set(PARTIAL_OPS) | (set() if cfg == CONFIGS[0] else set(SINK_OPS))
    if cfg == CONFIGS[0]:
        # Its attention kernels (tc3 ragged, tc2 paged, the tc decode: auto's on sm_80 sources) are generated and
        # nvcc-compiled on this very spec, with register and spill bounds, by test_prefill_tc_compile.py and
        # test_cuda_decode_tc.py (a forced path builds auto's TIR): a third lowering and nvcc here cost ~30 s.
        drop |= set(ATTN_OPS)
    elif cfg[2] in (96, 256) and cfg[4] != "float32":
        # Auto's prefill tiles at head dims 96 (tc3, tc2) and 256 (tcq), SIMT RoPE kernel included, are
        # nvcc-compiled with spill bounds and HMMA counts by test_prefill_tc_compile.py (windowed + capped bf16).
        drop |= {"attn_prefill_ragged", "attn_prefill_paged"}
    return tuple(op for op in ops_for(_spec(cfg)) if op not in drop)


@functools.cache
def cuda_source(cfg: tuple, kind: str = "sm90") -> str:
    """CUDA source of ``source_ops(cfg)`` (cached per session); ``kind`` is "sm90" or "generic"."""
    return ops_cuda_source(_spec(cfg), source_ops(cfg), SM80 if kind == "sm90" else _generic_cuda_target())


def _sm90_source(cfg):
    return cuda_source(cfg, "sm90")


@functools.cache
def masked_source(key: tuple) -> str:
    """CUDA source (sm_90) of the three attention ops for a ``MASKED_CONFIGS`` entry."""
    *shape, window, cap = key
    return ops_cuda_source(tk.KernelSpec(*shape, sliding_window=window, logits_soft_cap=cap), ATTN_OPS, SM80)


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory):
    """nvcc on every configuration's source, the jobs run in parallel: ``{cfg: (returncode, log)}``."""
    return nvcc_all(CONFIGS, _sm90_source, tmp_path_factory.mktemp("cuda"), "")


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_every_op_lowers_to_cuda(cfg):
    funcs = tk.build_kernels(_spec(cfg), SM80)
    # every MHA op; fp16 / bf16 also the partial-state variants (o float32), which float32 leaves out
    assert list(funcs) == list(ops_for(_spec(cfg)))
    assert ("attn_decode_paged_partial" in funcs) == (cfg[4] != "float32")
    assert ("merge_state_partial_sinks" in funcs) == (cfg[4] != "float32") and "apply_sinks" in funcs
    for op, func in funcs.items():
        assert func.attrs["global_symbol"] == f"pagedkv_{op}"
        assert bool(func.attrs["tirx.is_scheduled"]), op
    src = _sm90_source(cfg)
    for op in source_ops(cfg):
        assert re.search(rf"__global__ void __launch_bounds__\(\d+\) pagedkv_{op}_kernel\b", src), \
            f"no CUDA kernel for {op}"
    assert "threadIdx.x" in src and "blockIdx.x" in src
    # 16-byte page accesses (uint4 for fp16 / float4 for fp32) in the paged kernels.
    assert ("*(uint4*)(pages" in src) or ("*(float4*)(pages" in src)


def test_generic_cuda_target_lowers():
    """A CUDA target without an arch lowers every op (on the float32 config: CUDA-core kernels only, whichever
    the arch, a small compile; it builds no partial-state ops)."""
    src = cuda_source(CONFIGS[1], "generic")
    assert not set(ops_for(_spec(CONFIGS[1]))) & set(PARTIAL_OPS)
    for op in source_ops(CONFIGS[1]):
        assert f"pagedkv_{op}_kernel" in src


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_nvcc_compiles_for_sm90a(cfg, nvcc_results):
    rc, log = nvcc_results[cfg]
    assert rc == 0, f"nvcc failed for {cfg}:\n{log[-4000:]}"
    spills = [line for line in log.splitlines() if re.search(r"[1-9]\d* bytes spill", line)]
    assert not spills, "register spills:\n" + "\n".join(spills)


@pytest.mark.parametrize("op, cfg, match", [
    ("attn_decode_paged", (8, 2, 72, 72, "float16"), "head_dim=72"),
    ("attn_prefill_paged", (8, 2, 72, 72, "float32"), "head_dim=72"),
    ("attn_prefill_ragged", (8, 2, 512, 512, "float16"), "512"),
    ("attn_prefill_ragged", (8, 2, 128, 72, "float16"), "v_head_dim=72"),
])
def test_unsupported_shapes_name_the_head_dim(op, cfg, match):
    with pytest.raises(NotImplementedError, match=match):
        tk.FACTORIES[op](tk.KernelSpec(*cfg), SM80)


def test_cpu_dispatch_unchanged():
    """The llvm target still gets the CPU kernels (no thread bindings, not marked scheduled)."""
    funcs = tk.build_kernels(tk.KernelSpec(8, 2, 64, 64, "float16"), tk.host_target())
    for op, func in funcs.items():
        assert "tirx.is_scheduled" not in func.attrs, op


# ---------------------------------------------------------------------------------------------------
# masking options (sliding window, logits soft-cap) of the attention kernels
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nvcc_masked_results(tmp_path_factory):
    """nvcc on every ``MASKED_CONFIGS`` source, in parallel: ``{key: (returncode, log)}``."""
    return nvcc_all(MASKED_CONFIGS, masked_source, tmp_path_factory.mktemp("cuda_masked"), "masked_")


@pytest.mark.parametrize("key", MASKED_CONFIGS, ids=MASKED_IDS)
def test_masked_attention_lowers_to_cuda(key):
    src = masked_source(key)
    for op in ATTN_OPS:
        assert re.search(rf"__global__ void __launch_bounds__\(\d+\) pagedkv_{op}_kernel\b", src), op
    # The soft cap must not use tanhf: --use_fast_math (TVM's nvcc / NVRTC flags) makes it tanh.approx.f32.
    assert not re.search(r"\btanhf?\s*\(", src)


@pytest.mark.parametrize("key", MASKED_CONFIGS, ids=MASKED_IDS)
def test_masked_attention_nvcc_no_spills(key, nvcc_masked_results):
    rc, log = nvcc_masked_results[key]
    assert rc == 0, f"nvcc failed for {key}:\n{log[-4000:]}"
    usage = ptxas_usage(log)
    for op in ATTN_OPS:
        assert any(name.startswith(f"pagedkv_{op}_kernel") for name in usage), (op, sorted(usage))
    print("\n".join(f"{name}: {regs} registers, spill stores/loads {st}/{ld} bytes"
                    for name, (regs, st, ld) in sorted(usage.items())))
    # the allowance is for the decode op's first kernel (its inline-RoPE variant) only
    allowed = {f"pagedkv_{op}_kernel": KNOWN_SPILLS.get((MASKED_IDS[MASKED_CONFIGS.index(key)], op), 0)
               for op in ATTN_OPS}
    spills = {name: u for name, u in usage.items() if max(u[1], u[2]) > allowed.get(name, 0)}
    assert not spills, f"register spills (registers, store, load bytes): {spills}"


@pytest.mark.parametrize("shape", [(32, 8, 128, 128, "float16"), (4, 4, 64, 64, "float32")],
                         ids=["32x8x128-f16", "4x4x64-f32"])
@pytest.mark.parametrize("op", ATTN_OPS)
def test_masking_off_is_the_default_kernel(op, shape):
    """Options 0 (int or float) give exactly the default kernel; each option on changes it."""
    spec_factory = getattr(tk.attention_cuda, f"{op}_cuda")  # called directly, on specs with the options

    def factory(*args, **options):
        return spec_factory(tk.KernelSpec(*args, **options))

    args = shape  # (hq, hkv, d, dv, dtype): KernelSpec's positional fields
    with tk._common.fast_macro_expansion():  # as the factories' dispatch (5x faster parsing)
        default = factory(*args).script()
        assert factory(*args, sliding_window=0, logits_soft_cap=0.0).script() == default
        assert factory(*args, sliding_window=0, logits_soft_cap=0).script() == default
        assert factory(*args, sliding_window=64).script() != default
        assert factory(*args, logits_soft_cap=20.0).script() != default


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_empty_rows_helper_compiles(dtype, tmp_path):
    """The FlashInfer backend's ``pagedkv_empty_rows`` helper in every cache dtype: lowered and nvcc-compiled."""
    target = SM80
    with target:
        exe = tvm.compile(tvm.IRModule({"pagedkv_empty_rows": tk.make_empty_rows(dtype, target)}), target=target)
    src = cuda_source_of(exe)
    assert re.search(r"__global__ void __launch_bounds__\(\d+\) pagedkv_empty_rows_kernel\b", src)
    rc, log = nvcc_all([(dtype,)], lambda _: src, tmp_path, "empty_rows_")[(dtype,)]
    assert rc == 0, f"nvcc failed for {dtype}:\n{log[-4000:]}"
