"""The shape matrix of the scenario suite, shared by the CPU and GPU suites and by ``pagedkv.apps.gpu_bundle``
(which prebuilds the GPU kernels for exactly these configs).

GQA group sizes 1, 3, 4, 7, head dims 64 / 128, float32 / float16, page sizes 16 / 8 and RoPE modes
none / normal / inline each appear at least twice; bfloat16 (the dtype of Llama 3, Qwen and DeepSeek-V3
checkpoints) on two of them (inline RoPE at head dim 128, normal at 64: neither takes FlashInfer modules of
its own, whose libraries are ~7 MB of the GPU bundle each) and on one small MLA shape. Three
shapes turn on the attention options: a sliding window shorter than the scenarios' sequences (crossing
pages), a logits soft-cap small enough to bend random scores (|s| ~ 1), and both.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import KVCacheConfig
from ..kernel_spec import SWITCHES
from ..kernel_table import TABLE


#: Short dtype names of the test ids.
DTYPE_IDS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Shape:
    hq: int
    hkv: int
    d: int
    dtype: str
    ps: int
    rope: str
    theta: float = 10000.0
    scale: float = 1.0
    window: int = 0
    cap: float = 0.0
    #: max_batch_size; a larger batch scales the token capacity and the prefill chunk with it
    batch: int = 8

    @property
    def id(self) -> str:
        dt = DTYPE_IDS[self.dtype]
        extra = "" if (self.theta, self.scale) == (10000.0, 1.0) else f"-t{self.theta:g}s{self.scale:g}"
        extra += f"-w{self.window}" if self.window else ""
        extra += f"-cap{self.cap:g}" if self.cap else ""
        extra += f"-b{self.batch}" if self.batch != 8 else ""
        return f"h{self.hq}x{self.hkv}-d{self.d}-{dt}-p{self.ps}-{self.rope}{extra}"

    def config(self) -> KVCacheConfig:
        # Capacity for every scenario (<= 8 sequences, <= 64 tokens a forward, <= 16 pages at page size 8);
        # the pool is kept small so freed pages get reused. A larger batch (the batch scenarios) gets the
        # same capacity per sequence.
        grow = max(1, self.batch // 8)
        return KVCacheConfig(num_layers=2, num_qo_heads=self.hq, num_kv_heads=self.hkv, head_dim=self.d,
                             dtype=self.dtype, rope_mode=self.rope, rope_theta=self.theta,
                             rope_scale=self.scale, page_size=self.ps, max_batch_size=self.batch,
                             max_total_seq_len=128 * grow, prefill_chunk_size=64 * grow,
                             sliding_window=self.window, logits_soft_cap=self.cap)


SHAPES = [
    Shape(4, 4, 64, "float32", 16, "none"),
    Shape(4, 4, 128, "float16", 8, "inline"),
    Shape(6, 2, 64, "float16", 8, "normal"),
    Shape(6, 2, 128, "float32", 16, "inline", scale=0.5),
    Shape(8, 2, 64, "float32", 8, "inline", theta=500000.0),
    Shape(8, 2, 128, "float16", 16, "none"),
    Shape(7, 1, 64, "float16", 16, "normal", scale=2.0),
    Shape(7, 1, 128, "float32", 8, "normal"),
    Shape(4, 1, 64, "float32", 8, "normal", window=13),
    Shape(6, 2, 128, "float16", 16, "none", cap=2.0),
    Shape(3, 1, 64, "float16", 8, "inline", window=20, cap=2.5),
    Shape(6, 2, 128, "bfloat16", 8, "inline"),
    Shape(7, 1, 64, "bfloat16", 16, "normal"),
]

#: The CPU scenario matrix (``tests/cpu/test_scenarios.py``): ``SHAPES`` but four whose properties the others
#: cover on the CPU (group 3 at head dim 128 in float32 with inline RoPE: groups 3, head dim 128, float32, inline
#: RoPE and a RoPE scale each run on other shapes; the soft cap alone: with a window on the inline shape, and alone
#: in ``test_scenarios_paths``' forced-thread runs; group 3 at head dim 64 in fp16 with normal RoPE, and group 7 at
#: 128 in float32 with normal RoPE: each property on two or more others). Each CPU shape compiles its own kernel
#: library (seconds).
CPU_SCENARIO_SHAPES = [s for s in SHAPES
                       if s.id not in ("h6x2-d128-f32-p16-inline-t10000s0.5", "h6x2-d128-f16-p16-none-cap2",
                                       "h6x2-d64-f16-p8-normal", "h7x1-d128-f32-p8-normal")]

#: CPU shapes of the many-sequence scenarios (``scenarios_batch``): 24 sequences, 16 and 4 kv heads (more
#: work items than the CPU kernels' 64 parallel chunks), windowed with a window shorter than a key tile (the
#: first entry's window starts past its first tile), and plain with inline RoPE on the kernel shape of
#: ``SHAPES[0]`` (kernels compiled for a shape serve every capacity, so they are shared).
BATCH_SHAPES = [
    Shape(16, 16, 64, "float32", 16, "none", window=13, batch=24),
    Shape(4, 4, 64, "float32", 8, "inline", batch=24),
]

#: Extra GPU-only shapes: GQA group 8, the H200 benchmark shape (32 q / 8 kv heads, head dim 128) in fp16
#: and in bf16 (Llama 3 8B's attention), and attention options on FlashInfer's shape (fp16, head dim 128:
#: window and soft-cap together, one module build each for decode and prefill) and on two TIR-only ones.
GPU_EXTRA = [
    Shape(32, 8, 128, "float16", 16, "normal"),
    Shape(32, 8, 128, "bfloat16", 16, "normal"),
    Shape(8, 1, 128, "float16", 16, "inline"),
    Shape(32, 8, 128, "float16", 16, "normal", window=40, cap=3.0),
    Shape(8, 2, 64, "float32", 8, "none", cap=2.0),
    Shape(7, 1, 128, "float16", 8, "inline", window=11),
]

#: The attention options of the backend benchmark's windowed cases (``benchmarks/bench_backends_gpu.py``,
#: Mistral's window and Gemma-2's cap) on its shape; the bundle prebuilds its kernels (the TIR kernels take
#: the options at compile time).
BENCH_OPTIONS = dict(sliding_window=1024, logits_soft_cap=30.0)
BENCH_WINDOWED = Shape(32, 8, 128, "float16", 16, "none", window=1024, cap=30.0)


@dataclass(frozen=True)
class MLAShape:
    """An MLA cache shape: ``h`` heads, latent ``r + rope``, non-absorbed dims ``nope + rope`` / ``v``."""

    h: int
    r: int
    rope: int
    nope: int
    v: int
    dtype: str
    ps: int

    @property
    def d(self) -> int:
        """The model's qk head dim (its softmax scale is about ``d ** -0.5``)."""
        return self.nope + self.rope

    @property
    def id(self) -> str:
        dt = DTYPE_IDS[self.dtype]
        return f"mla-h{self.h}-r{self.r}-rope{self.rope}-nope{self.nope}-v{self.v}-{dt}-p{self.ps}"

    def config(self) -> KVCacheConfig:
        return KVCacheConfig.mla(num_layers=2, num_heads=self.h, kv_lora_rank=self.r,
                                 qk_nope_head_dim=self.nope, qk_rope_head_dim=self.rope, v_head_dim=self.v,
                                 dtype=self.dtype, page_size=self.ps, max_batch_size=8,
                                 max_total_seq_len=128, prefill_chunk_size=64)


#: MLA shapes: two small ones (3 and 4 heads), DeepSeek-V2-Lite's (16 heads, 512 + 64 latent, nope 128,
#: v 128), and a small bf16 one (4 heads; page size 8).
MLA_SHAPES = [
    MLAShape(3, 64, 32, 32, 48, "float32", 8),
    MLAShape(4, 64, 32, 64, 64, "float16", 16),
    MLAShape(16, 512, 64, 128, 128, "float16", 16),
    MLAShape(4, 64, 32, 64, 64, "bfloat16", 8),
]
#: Extra GPU-only MLA shapes: V2-Lite in float32 and DeepSeek-V3's 128 heads, in fp16 and in bf16 (the
#: checkpoint's dtype).
MLA_GPU_EXTRA = [
    MLAShape(16, 512, 64, 128, 128, "float32", 8),
    MLAShape(128, 512, 64, 128, 128, "float16", 16),
    MLAShape(128, 512, 64, 128, 128, "bfloat16", 16),
]


def gpu_shapes() -> list:
    return SHAPES + GPU_EXTRA + MLA_SHAPES + MLA_GPU_EXTRA


def gpu_configs() -> list[KVCacheConfig]:
    return [s.config() for s in gpu_shapes()]


def flashinfer_gpu_shapes() -> list:
    """The GPU shapes the FlashInfer suite runs (and ``pagedkv.apps.gpu_bundle`` prebuilds FlashInfer kernel libraries
    for): those whose FlashInfer modules are fp16 at head dim 128 (decode, prefill fa2 / fa3) or the
    DeepSeek MLA dims (ckv 512, kpe 64), and the same in bf16 without attention options (the bf16 modules
    built: decode, prefill fa2 / fa3 and MLA, none with a window or a soft cap), so a bundle build links
    cached or quick modules only (a cold fa2 / fa3 prefill module per head dim takes 10-20 minutes on the
    2-core build host). Whether FlashInfer serves each op of a shape is up to the backend (e.g. inline RoPE:
    it does not)."""
    def cheap(s) -> bool:
        if isinstance(s, MLAShape):
            return (s.r, s.rope) == (512, 64) and s.dtype in ("float16", "bfloat16")
        plain = not (s.window or s.cap)
        return s.d == 128 and (s.dtype == "float16" or (s.dtype == "bfloat16" and plain))

    return [s for s in gpu_shapes() if cheap(s)]


# ---------------------------------------------------------------------------------------------------------
# forced CUDA code paths (``pagedkv.backends.tir.forced_paths``; switches ``pagedkv.tir_kernels.SWITCHES``)
# ---------------------------------------------------------------------------------------------------------
#: Shapes of the CUDA path tests (``tests/gpu/test_cuda_paths_gpu.py``), whose decode kernels run under every
#: value of the CUDA path switches: plain, windowed, windowed + capped; 8, 4 and 8 kv heads; GQA groups 4, 4, 8
#: (8: in the lane-group kernel two row chunks over blockIdx.z beside the splits; in the staged kernel 4 rows
#: per thread); both dtypes. The windows (24, 300) start past the
#: first key step and mid-page in the long entries of the tests. Page size and RoPE mode change no kernel.
#: (A soft cap alone is left out: it maps each score and meets no split boundary; every forced shape costs
#: eight kernel libraries, about 0.5 MB each: five split values, three with the lane-group kernel forced.)
PATH_SHAPES = [
    Shape(32, 8, 128, "float16", 16, "normal"),
    Shape(16, 4, 64, "float32", 8, "inline", window=24),
    Shape(64, 8, 128, "float16", 16, "none", window=300, cap=3.0),
]
#: MLA shapes of the path tests: DeepSeek-V2-Lite's latent (fp16) and the small fp32 one (3 heads).
PATH_MLA_SHAPES = [MLA_SHAPES[2], MLA_SHAPES[0]]
#: The scenario suite runs under each forced path on these: plain, windowed and MLA.
PATH_SCENARIO_SHAPES = PATH_SHAPES[:2] + PATH_MLA_SHAPES


def cuda_path_switches() -> dict[str, tuple[str, ...]]:
    """switch -> values ("auto" first) of every CUDA path switch (works with the TVM runtime only)."""
    from ..backends.tir import path_switches

    return {name: values for name, (_, values) in sorted(path_switches().items()) if name.startswith("cuda_")}


#: Shapes of the tensor-core prefill tests (``tests/gpu/test_prefill_tc_gpu.py``, each tile forced through the path
#: switch ``cuda_prefill_kernel``: ``PREFILL_KERNEL_PATHS``): GQA groups 4, 1, 8, 7, 3 and 2; head dims 128, 64,
#: 96 (Phi-3: tc2 / tc3) and 256 (Gemma 2 / 3's 16 q / 8 kv heads: tcq; the last two are
#: ``benchmarks/bench_prefill_dims_gpu.py``'s too); fp16 and bf16; two windowed and soft-capped (the variant hooks
#: inside the MMA tiles), at head dim 64 and at 128 (the wgmma tiles, auto's on sm_90a, serve only 128; tcq's
#: windowed + capped runs are emulated: ``tests/cpu/test_prefill_tc_emulated.py``).
PREFILL_TC_SHAPES = [
    Shape(32, 8, 128, "float16", 16, "none"),
    Shape(8, 8, 128, "bfloat16", 16, "none"),
    Shape(64, 8, 128, "bfloat16", 16, "none"),
    Shape(21, 3, 64, "float16", 8, "none"),
    Shape(12, 4, 64, "bfloat16", 8, "none", window=100, cap=30.0),
    Shape(28, 4, 128, "bfloat16", 8, "none", window=100, cap=30.0),
    Shape(32, 4, 96, "float16", 16, "none"),
    Shape(16, 8, 256, "bfloat16", 16, "none"),
]
#: Both plain prefill kernels, forced, the tensor-core one in each of its tiles (every value of the path switch but
#: auto; the wg tiles' libraries are built for and looked up under sm_90a: ``kernel_spec.target_for_paths``): the tests run the
#: shapes on each (the SIMT one is the default only where the tensor-core kernel does not serve a spec, so the
#: fp16 / bf16 shapes reach it only forced).
PREFILL_KERNEL_PATHS = tuple({"cuda_prefill_kernel": v} for v in SWITCHES["cuda_prefill_kernel"][1] if v != "auto")


#: Split counts under which the path tests also run the lane-group and the staged MHA decode kernels forced
#: (``cuda_decode_kernel=lanes`` / ``staged``; auto runs the plain decode on the tensor-core kernel where it
#: serves, the staged one elsewhere and for inline RoPE): their own policy, the direct-write S = 1 and a
#: merged odd S.
LANES_SPLITS = ("auto", "1", "3")


#: Shapes of the tensor-core decode forced (``cuda_decode_kernel=tc``, ``tir_kernels/_decode_tc_cuda.py``) in
#: the path tests, beside the fp16 ``PATH_SHAPES`` that auto runs on it: group 8 bf16 windowed + soft-capped
#: and group 16 at D 64 (a full m16 tile; 3-slot ring of 55 KB). The first runs under every ``TC_DECODE_SPLITS``
#: value, the second under auto only: each forced (shape, splits) is a kernel library of about 0.5 MB in the
#: carried bundle.
TC_DECODE_SHAPES = [
    Shape(64, 8, 128, "bfloat16", 16, "none", window=300, cap=3.0),
    Shape(32, 2, 64, "float16", 16, "none"),
]
#: Split counts of the tensor-core decode path cases: its policy, the direct-write S = 1, merged 3 and 8.
TC_DECODE_SPLITS = ("auto", "1", "3", "8")


#: Split ranges forced (``cuda_decode_split_ranges``; auto takes chunk ranges on the tests' skewed batch where the
#: split count is automatic): chunk with the split count forced (3: the longest entry's ranges) on every
#: ``PATH_SHAPES`` shape under the default kernels and on the first under the lane-group and staged kernels,
#: and entry with the automatic count (auto's ranges before chunking) on the first.
RANGE_CASES = ([(s, {"cuda_decode_split_ranges": "chunk", "cuda_decode_splits": "3"}) for s in PATH_SHAPES]
               + [(PATH_SHAPES[0], {"cuda_decode_kernel": k, "cuda_decode_split_ranges": "chunk",
                                    "cuda_decode_splits": "3"}) for k in ("lanes", "staged")]
               + [(PATH_SHAPES[0], {"cuda_decode_split_ranges": "entry", "cuda_decode_splits": "auto"})])


def decode_path_cases() -> list[tuple[Shape, dict[str, str]]]:
    """(shape, forced paths) of the MHA decode path tests: every ``PATH_SHAPES`` shape under every value of
    ``cuda_decode_splits`` (the default kernels), under ``LANES_SPLITS`` with ``cuda_decode_kernel=lanes`` and
    (the fp16 shapes, whose plain decode auto runs on the tensor cores) ``staged``, and the
    ``TC_DECODE_SHAPES`` with ``cuda_decode_kernel=tc`` (the first under every ``TC_DECODE_SPLITS`` value, the
    last under auto), and the ``RANGE_CASES``. Every entry names its split value (``"auto"`` included)."""
    splits = cuda_path_switches()["cuda_decode_splits"]
    tc = [(TC_DECODE_SHAPES[0], v) for v in TC_DECODE_SPLITS] + [(TC_DECODE_SHAPES[1], "auto")]
    staged = [s for s in PATH_SHAPES if s.dtype != "float32"]
    return ([(s, {"cuda_decode_splits": v}) for s in PATH_SHAPES for v in splits]
            + [(s, {"cuda_decode_kernel": k, "cuda_decode_splits": v}) for k, shapes in
               (("lanes", PATH_SHAPES), ("staged", staged)) for s in shapes for v in LANES_SPLITS]
            + [(s, {"cuda_decode_kernel": "tc", "cuda_decode_splits": v}) for s, v in tc]
            + RANGE_CASES)


#: Split counts under which the path tests also run each MLA decode kernel forced (``cuda_mla_decode_kernel``):
#: its own policy, the direct-write S = 1 and a merged odd S.
MLA_KERNEL_SPLITS = ("auto", "1", "3")
#: (shape, forced kernel) of those runs: the tensor-core kernel on DeepSeek-V3's 128 heads in bf16 (two m16
#: tiles a block, four head groups; V2-Lite's latent, 16 heads in fp16, runs it by default under every split
#: value above) and the SIMT kernel on V2-Lite (auto takes the tensor cores there: ``pagedkv.kernel_table``;
#: SIMT only forced); the wgmma kernel with Q in shared memory
#: (``mla_cuda_wgq``, sm_90a: two head groups of 64; pages of 16: TMA boxes) on DeepSeek-V3's 128 heads and on
#: V2-Lite's 16 (48 padding rows).
MLA_KERNEL_SHAPES = [(MLA_GPU_EXTRA[2], "tc"), (MLA_SHAPES[2], "simt"), (MLA_GPU_EXTRA[2], "wgq"),
                     (MLA_SHAPES[2], "wgq")]


def mla_path_cases() -> list[tuple[MLAShape, dict[str, str]]]:
    """(shape, forced paths) of the MLA decode path tests: every value of ``cuda_decode_splits`` (the default
    kernels), and ``MLA_KERNEL_SPLITS`` under each forced kernel of ``MLA_KERNEL_SHAPES``."""
    return ([(s, {"cuda_decode_splits": v}) for s in PATH_MLA_SHAPES
             for v in cuda_path_switches()["cuda_decode_splits"]]
            + [(s, {"cuda_mla_decode_kernel": k, "cuda_decode_splits": v}) for s, k in MLA_KERNEL_SHAPES
               for v in MLA_KERNEL_SPLITS])


#: The paged MLA prefill under each forced kernel (``cuda_mla_prefill_kernel``; the decodes' blocks a query token
#: each): the mma.sync one on DeepSeek-V3's 128 heads (bf16) and V2-Lite's 16 (fp16), the wgmma one (wgq, sm_90a;
#: auto's from 16 heads) on both, and the SIMT kernel (auto's only for fp32 and latents the others refuse) on
#: V2-Lite; each with the split count automatic (1 for a prefill of many tokens) and forced to 3 (workspace + merge).
MLA_PREFILL_KERNEL_SHAPES = [(MLA_GPU_EXTRA[2], "tc"), (MLA_SHAPES[2], "tc"),
                             (MLA_GPU_EXTRA[2], "wgq"), (MLA_SHAPES[2], "wgq"), (MLA_SHAPES[2], "simt")]
MLA_PREFILL_SPLITS = ("auto", "3")


def mla_prefill_path_cases() -> list[tuple[MLAShape, dict[str, str]]]:
    """(shape, forced paths) of the paged MLA prefill path tests (``MLA_PREFILL_KERNEL_SHAPES`` x
    ``MLA_PREFILL_SPLITS``)."""
    return [(s, {"cuda_mla_prefill_kernel": k, "cuda_decode_splits": v}) for s, k in MLA_PREFILL_KERNEL_SHAPES
            for v in MLA_PREFILL_SPLITS]


def gpu_path_libraries() -> list[tuple[KVCacheConfig, dict[str, str]]]:
    """(config, forced paths) of every kernel library the CUDA path tests load (``decode_path_cases``,
    ``mla_path_cases``, ``mla_prefill_path_cases``; ``"auto"`` values dropped), and the tensor-core prefill shapes under each of ``PREFILL_KERNEL_PATHS``
    (that switch has its own shapes: a forced tile raises on a spec it does not serve, e.g. float32 or MLA).
    ``pagedkv.apps.gpu_bundle`` prebuilds exactly these beside ``gpu_configs``."""
    return ([(s.config(), {k: v for k, v in paths.items() if v != "auto"})
             for s, paths in decode_path_cases() + mla_path_cases() + mla_prefill_path_cases()]
            + [(s.config(), dict(p)) for s in PREFILL_TC_SHAPES for p in PREFILL_KERNEL_PATHS
               if not prefill_kernel_refusal(s, p["cuda_prefill_kernel"])])


def prefill_kernel_refusal(shape: Shape, kernel: str) -> str:
    """Why the forced prefill tile ``kernel`` refuses ``shape``'s head dim (TVM-free: the selection table's data);
    empty when it serves it. The tests skip such pairs with it and the bundle builds no library for them."""
    dims = next(v.head_dims for v in TABLE["cuda_prefill_kernel"] if v.name == kernel)
    return "" if dims is None or shape.d in dims else f"head dim {shape.d} (tile {kernel!r} takes {dims})"
