"""The staged CUDA decode kernel (``tir_kernels/_decode_staged_cuda.py``) on the build host: no GPU.

- its plan for every group size, head dim and dtype the kernels serve: whole warps, at most 1024 threads, a
  tile of at most ``TILE_BYTES`` of K + V split evenly over the key groups, lanes covering the head dim;
- its limits as data (``staged_limits``; with inline RoPE ``staged_rope_limits``: also the pair layout and the
  RoPE tables' shared memory) and the switch ``cuda_decode_kernel``: auto = staged per variant wherever the
  limits allow, a forced "staged" on a shape either refuses raises, "lanes" is the lane-group kernel for both;
- the generated CUDA: 16-byte page loads (``uint4``) into registers, 16-byte shared loads, one staged kernel per
  decode variant (inline RoPE, plain) plus the split merge; the RoPE one with its tables, keys rotated as they
  are staged and no sin / cos in the key loop's score.

nvcc (no spills) runs on the default kernels in ``test_cuda_compile.py`` (groups 4, 7, 3, 8, 4; head dims 128,
64, 96, 256, 128; every dtype) and on every forced split count in ``test_cuda_paths_compile.py``; the numerical
check is ``tests/cpu/test_decode_staged_emulated.py`` (CPU emulation of the generated CUDA),
``tests/gpu/test_cuda_paths_gpu.py`` (``cuda_decode_kernel=staged``) and the GPU suite (the staged kernels are the default for
float32 and inline RoPE; the plain fp16 / bf16 decode runs the tensor-core kernel where it serves).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from _cuda_support import cuda_source_of

from pagedkv import tir_kernels as tk
from pagedkv.tir_kernels import _decode_staged_cuda as st
from pagedkv.tir_kernels import _decode_staged_rope_cuda as sr
from pagedkv.tir_kernels.attention_cuda_decode import use_staged

import tvm
from tvm.script import tirx as T
from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)
SWITCH = "cuda_decode_kernel"
GROUPS = (1, 2, 3, 4, 7, 8, 16)
DIMS = (64, 96, 128, 256)
DTYPES = ("float16", "bfloat16", "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("g", GROUPS)
def test_plan_invariants(g, d, dtype):
    assert st.staged_limits(g, d, dtype) == []
    p = st.staged_plan(2 * g, 2, d, dtype)
    assert p.g == g and g % p.r == 0 and p.gt * p.r == g
    assert p.nt % 32 == 0 and p.nt <= 1024, p
    assert p.l0 * p.vec == d and p.l0 <= p.l <= 32 and p.l & (p.l - 1) == 0, p
    assert p.vec * st.itemsize(dtype) % 16 == 0, p  # whole 16-byte vectors
    assert p.tk % p.nz == 0 and 2 * p.tk * d * st.itemsize(dtype) <= st.TILE_BYTES, p
    assert p.loads * p.nt >= p.tk * p.l0, p
    assert p.smem_bytes <= st.STAGED_MAX_SMEM, p
    # several rows per thread (shared loads and conversions amortized), q and o within the register budget
    assert p.r * p.vec <= st.STAGED_ROW_FLOATS
    want = {1: 1, 2: 2, 3: 1, 4: 2, 7: 1, 8: 4, 16: 4}[g]
    assert p.r == (want if p.vec <= 8 else min(want, 2)), p
    # 16-byte vectors: two per lane where the head dim splits so (fewer lanes: fewer shuffles per score)
    assert p.vec * st.itemsize(dtype) == (32 if d % (2 * st.vec16(dtype)) == 0 else 16), p
    # inline RoPE: a lane's two vectors are the halves of its pairs (dims j and j + D/2); the tables fit
    assert p.lw == d // 2 and p.vec == 2 * st.vec16(dtype), p
    why = sr.staged_rope_limits(g, d, dtype)
    # too little shared memory for the RoPE tables: group 16 at D = 256, and float32 at group 8 x 256 and 16 x 128
    refused = (g, d) == (16, 256) or (dtype == "float32" and (g, d) in ((8, 256), (16, 128)))
    assert why == ([why[0]] if refused else []), why
    if not why:
        assert sr.rope_smem_bytes(p) <= st.STAGED_MAX_SMEM and sr.pool_floats(p) >= p.nz * p.g * p.d, p
        assert sr.pool_floats(p) >= p.tk * d, p  # key table (cos + sin); the rotated-q table has its own
        assert sr.rope_smem_bytes(p) >= p.smem_bytes + g * d * 4, p


def test_limits_are_data_and_forced_staged_raises():
    assert st.staged_limits(4, 120, "float16") == ["head_dim 120 is not a multiple of 16"]
    why = st.staged_limits(256, 128, "float16")  # 128 row threads x 8 lanes (and too much shared memory)
    assert "exceeds 512 threads" in why[0]
    why = st.staged_limits(32, 256, "float16")  # 49408 bytes of shared memory
    assert len(why) == 1 and "shared memory" in why[0]
    big = tk.KernelSpec(256, 1, 128, 128, "float16")
    assert not use_staged(big)  # auto: the lane-group kernel takes it
    with pytest.raises(NotImplementedError, match="cuda_decode_kernel=staged"):
        use_staged(dataclasses.replace(big, paths={SWITCH: "staged"}))


def test_rope_limits_are_data():
    # a lane of 4 float32 vectors (D = 512: 32 lanes of 16 elements) does not hold both halves of its pairs
    assert st.staged_limits(8, 512, "float32") == []
    why = sr.staged_rope_limits(8, 512, "float32")
    assert "not two 16-byte vectors" in why[0]
    assert "shared memory with the RoPE tables" in sr.staged_rope_limits(16, 256, "float16")[0]
    assert sr.staged_rope_limits(4, 120, "float16") == st.staged_limits(4, 120, "float16")  # the plain ones first
    cfg = tk.KernelSpec(32, 2, 256, 256, "float16")  # plain staged, RoPE on the lane-group kernel
    assert use_staged(cfg) and not use_staged(cfg, rope=True)
    forced = dataclasses.replace(cfg, paths={SWITCH: "staged"})
    assert use_staged(forced)  # the plain variant serves; the inline-RoPE one names its reason
    with pytest.raises(NotImplementedError, match=r"cuda_decode_kernel=staged.*RoPE tables"):
        use_staged(forced, rope=True)
    with pytest.raises(NotImplementedError, match=r"cuda_decode_kernel=staged.*RoPE tables"):
        tk.FACTORIES["attn_decode_paged"](forced, SM80)  # the PrimFunc holds both variants
    lanes = dataclasses.replace(cfg, paths={SWITCH: "lanes"})
    assert not use_staged(lanes) and not use_staged(lanes, rope=True)


def test_switch_values():
    assert tk.SWITCHES[SWITCH][1] == ("auto", "lanes", "staged", "tc")  # tc: test_cuda_decode_tc.py
    cfg = tk.KernelSpec(8, 2, 64, 64, "float32")  # fp32: the tensor-core decode (auto's first) does not serve
    for rope in (False, True):
        assert use_staged(cfg, rope) and use_staged(dataclasses.replace(cfg, paths={SWITCH: "staged"}), rope)
        assert not use_staged(dataclasses.replace(cfg, paths={SWITCH: "lanes"}), rope)


def _script(cfg, op="attn_decode_paged", **paths):
    return tk.FACTORIES[op](dataclasses.replace(cfg, paths=paths), SM80).script()


def test_auto_is_staged_lanes_differs_other_kernels_alone():
    cfg = tk.KernelSpec(8, 2, 64, 64, "float32", sliding_window=40, logits_soft_cap=5.0)
    auto = _script(cfg)
    assert _script(cfg, cuda_decode_kernel="staged") == auto
    assert _script(cfg, cuda_decode_kernel="lanes") != auto
    for op in ("attn_prefill_paged", "attn_prefill_ragged", "merge_state"):
        assert _script(cfg, op, cuda_decode_kernel="lanes") == _script(cfg, op)


def test_mla_decode_ignores_the_kernel_switch():
    cfg = tk.KernelSpec(3, 3, 96, 64, "float32", kv_lora_rank=64, qk_rope_head_dim=32)
    op = "mla_attn_decode_paged"
    assert _script(cfg, op, cuda_decode_kernel="lanes") == _script(cfg, op)


def _key_loop(body: str) -> str:
    """The source of a staged kernel's key loop (``for (int it ...) { ... }``, braces matched)."""
    start = body.index("for (int it")
    depth = 0
    for end in range(body.index("{", start), len(body)):
        depth += {"{": 1, "}": -1}.get(body[end], 0)
        if depth == 0:
            return body[start:end + 1]
    raise AssertionError("unclosed key loop")


@pytest.mark.parametrize("hq,hkv,dtype", [(32, 8, "float16"), (64, 8, "bfloat16"), (16, 4, "float32")])
def test_generated_cuda_uses_vector_loads(hq, hkv, dtype):
    # staged forced: auto runs the plain fp16 / bf16 decode on the tensor-core kernel
    cfg = tk.KernelSpec(hq, hkv, 128, 128, dtype, paths={SWITCH: "staged"})
    with SM80:
        exe = tvm.compile(tvm.IRModule({"main": tk.FACTORIES["attn_decode_paged"](cfg, SM80)}), target=SM80)
    src = cuda_source_of(exe)
    bodies = re.split(r'extern "C" __global__', src)[1:]
    staged = [b for b in bodies if "Ks_ptr" in b]  # the forward declarations have no body
    assert len(staged) == 2, "one staged kernel body per decode variant"
    rope = [b for b in staged if "q_raw_ptr" in b]
    assert len(rope) == 1, "one staged inline-RoPE kernel"
    for body in staged:
        # page reads: 16-byte vectors into the staging registers; shared tile reads: 16-byte vectors
        vec = "float4" if dtype == "float32" else "uint4"
        # (the RoPE kernel's staging registers are a scalar array: it rotates their elements)
        assert re.search(rf"(Kst_ptr\[\d+\]|\*\({vec}\*\)\(Kst_ptr \+ \d+\)) = \*\({vec}\*\)\(pages_ptr", body), \
            "K page loads are not 16 bytes"
        assert re.search(rf"Vst_ptr\[\d+\] = \*\({vec}\*\)\(pages_ptr", body), "V page loads are not 16 bytes"
        assert re.search(rf"\*\({vec}\*\)\(kv_ptr \+ 0\) = Ks_ptr\[", body), "K shared loads are not 16 bytes"
        assert "__shfl_xor_sync" in body and body.count("__syncthreads()") >= 3
    # RoPE: keys rotated as they are staged (float4 reads of the shared key table), then the plain kernel's
    # score: no key-table read after the first score read of the tile, and the key loop's own two barriers
    # only (the planner added none: the rotated-q table is not in the key table's pool)
    body = rope[0]
    assert re.search(r"\*\(float4\*\)\(rc_ptr \+ 0\) = \*\(float4\*\)\(pool_ptr", body), "key table reads"
    loop = _key_loop(body)
    first_score_read = loop.index("= Ks_ptr[")
    assert loop.rindex("rs_ptr[") < first_score_read and loop.rindex("rc_ptr[") < first_score_read
    assert loop.count("__syncthreads()") == 2
    assert _key_loop(next(b for b in staged if b is not body)).count("__syncthreads()") == 2
    assert body.count("__syncthreads()") >= 5  # setup, two per tile, before the merge, the merge


def _wave_rule(B: int, keys: int, hkv: int = 8, max_keys: int = 0) -> int:
    """``wave_split_count`` for the staged kernel written out in Python (``max_keys`` 0: not known)."""
    from pagedkv.tir_kernels._common_cuda import BALANCED, FULL_WAVES, WAVE_BUDGETS
    from pagedkv.tir_kernels.attention_cuda_decode import DECODE_MIN_SPLIT_KEYS, STAGED_MAX_SPLITS, STAGED_RESIDENT_BLOCKS

    n0, c = B * hkv, STAGED_RESIDENT_BLOCKS
    full = n0 * FULL_WAVES[1] >= FULL_WAVES[0] * c * -(-n0 // c)  # S = 1's own waves nearly full
    balanced = max_keys > 0 and BALANCED[1] * max_keys <= BALANCED[0] * keys
    if full and (balanced or (max_keys == 0 and n0 > c)):
        return 1
    k = next(k for f, k in WAVE_BUDGETS if f is None or n0 <= f * c)
    return max(1, min(k * c // n0, keys // DECODE_MIN_SPLIT_KEYS, STAGED_MAX_SPLITS))


def test_staged_split_policy_fills_whole_waves():
    """The staged kernel's split count (``wave_split_count``, evaluated by TVM on the host) equals the rule
    written out in Python, and on the benchmark shapes (8 kv heads) it splits a batch just over one wave
    (B = 64: S = 3, 1536 blocks on 396 slots) while B = 16 x 4K and B = 1 x 32K keep one wave. With the
    longest entry known (the runtime's ``max_kv_len``): a balanced batch in one full wave keeps S = 1, a
    skewed one past one wave is split (its longest entry would set the time)."""
    import numpy as np

    from pagedkv.tir_kernels.attention_cuda_decode import (DECODE_MIN_SPLIT_KEYS, STAGED_MAX_SPLITS,
                                                           STAGED_RESIDENT_BLOCKS)
    from pagedkv.tir_kernels._common_cuda import wave_split_count

    @T.prim_func
    def splits(B: T.int32, nnz: T.int32, ps: T.int32, mx: T.int32, out: T.Buffer((1,), "int32")):
        out[0] = wave_split_count(B, nnz, ps, 8, resident_blocks=STAGED_RESIDENT_BLOCKS,
                                  min_split_keys=DECODE_MIN_SPLIT_KEYS, max_splits=STAGED_MAX_SPLITS, max_keys=mx)

    lib = tvm.compile(splits, target="llvm")
    o = tvm.runtime.tensor(np.zeros(1, "int32"))
    unknown = {(1, 32768): 49, (16, 4096): 3, (64, 4096): 3, (64, 8192): 3, (256, 2048): 1, (128, 1024): 3,
               (90, 4096): 1, (80, 4096): 2,  # 720 blocks: 2 waves 91% full (S = 1); 640: 81%
               (48, 4096): 4}  # 384 blocks: one wave 97% full, split all the same (lengths unknown)
    balanced = {(48, 4096): 1, (90, 4096): 1, (16, 4096): 3, (64, 4096): 3}  # longest = average
    skewed = {(48, 4096): 4, (90, 4096): 2, (99, 4096): 2}  # longest = 4 x average
    rng = np.random.default_rng()
    extra = {(int(b), int(k)): None for b, k in zip(rng.integers(1, 300, 12), rng.integers(1, 40000, 12))}
    for factor, table in ((0, {**unknown, **extra}), (1, {**balanced, **extra}), (4, {**skewed, **extra}),
                          (1.3, extra)):
        for (b, keys), want in table.items():
            nnz = -(-b * keys // 16)
            mx = int(factor * keys)
            lib(b, nnz, 16, mx, o)
            rule = _wave_rule(b, nnz * 16 // b, max_keys=mx)
            assert o.numpy()[0] == rule, (b, keys, mx)
            assert want is None or rule == want, (b, keys, mx, rule)
