"""Chunked split ranges of the CUDA MHA decode (``_common_cuda.chunk_split``, path switch
``cuda_decode_split_ranges``) run on the CPU (no GPU): TVM's generated CUDA of ``attn_decode_paged`` on the
emulator of ``_decode_emu.py`` (host code evaluated as TVM lowered it, the split and merge kernels launched as on a
GPU), checked against the float64 reference.

Chunk ranges give every entry ranges of one length ``C``, as many as its keys need; the blocks past an entry's keys
write only their rows' empty lse, and the merge must not read their ``o`` (the workspace is NaN-poisoned). Cases:
the tensor-core and the staged kernel, plain and inline RoPE, chunk forced with the split count forced (3) and
automatic, a windowed + soft-capped config (the ranges cover the window only); auto on a skewed batch (chunk
taken), on a balanced one and without the runtime's ``max_kv_len`` (equal ranges kept). Fresh random inputs each
run, NaN-poisoned outputs. Skips without g++.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from _decode_emu import build, check_against_reference, inputs, run_decode

from pagedkv import tir_kernels as tk

#: name -> (config, forced paths). A forced split count with chunk ranges: the longest entry's range count.
CONFIGS = {
    "tc-4x1x128-f16-s3": (tk.KernelSpec(4, 1, 128, 128, "float16"),
                          {"cuda_decode_kernel": "tc", "cuda_decode_splits": "3"}),
    "tc-4x1x128-f16-auto": (tk.KernelSpec(4, 1, 128, 128, "float16"), {"cuda_decode_kernel": "tc"}),
    "tc-8x1x64-bf16-w90-cap20-s3": (tk.KernelSpec(8, 1, 64, 64, "bfloat16", sliding_window=90,
                                                    logits_soft_cap=20.0),
                                    {"cuda_decode_kernel": "tc", "cuda_decode_splits": "3"}),
    "staged-4x1x64-f16-s3": (tk.KernelSpec(4, 1, 64, 64, "float16"),
                             {"cuda_decode_kernel": "staged", "cuda_decode_splits": "3"}),
    "staged-7x1x64-f32-w40-cap20-s2": (tk.KernelSpec(7, 1, 64, 64, "float32", sliding_window=40,
                                                       logits_soft_cap=20.0),
                                       {"cuda_decode_kernel": "staged", "cuda_decode_splits": "2"}),
}
#: Keys per entry: several chunks with a short last one, empty, one key, page and tile edges.
LENGTHS = [300, 0, 1, 17, 64, 129, 63]
#: A skewed batch long enough for the automatic split count to split (S > 1 before chunking; the longest entry
#: over 5/4 of the average).
SKEWED = [2600, 1, 0, 300, 17]
#: A balanced batch (no entry over 5/4 of the average): equal ranges.
BALANCED = [300, 310, 290, 300]
PS = 16
THETA, SCALE = 10000.0, 1.0


def _run(b, cfg, lengths, apply_rope, name, **kw):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = inputs(cfg, gen, lengths, PS)
    sm_scale = 0.9 / math.sqrt(cfg.head_dim)
    o, lse, env = run_decode(b, cfg, ents, pages, page_indptr, page_values, last, PS, apply_rope, sm_scale,
                             THETA, SCALE, **kw)
    check_against_reference(name, cfg, ents, o, lse, apply_rope, THETA, SCALE, sm_scale)
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``get(name, ranges, splits=True)``: the config's compiled kernels under split ranges ``ranges`` ("auto":
    not forced), with the config's forced split count or (``splits=False``) the automatic one."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    out, workdir = {}, tmp_path_factory.mktemp("emu_decode_chunk")

    def get(name, ranges="chunk", splits=True):
        key = (name, ranges, splits)
        if key not in out:
            cfg, paths = CONFIGS[name]
            paths = {k: v for k, v in paths.items() if splits or k != "cuda_decode_splits"}
            if ranges != "auto":
                paths["cuda_decode_split_ranges"] = ranges
            out[key] = build(cfg, paths, workdir / f"{name}-{ranges}-{int(splits)}")
        return out[key]

    return get


@pytest.mark.parametrize("apply_rope", [0, 1], ids=["plain", "rope"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_emulated_chunked_decode_matches_reference(name, apply_rope, built):
    cfg, paths = CONFIGS[name]
    env = _run(built(name), cfg, LENGTHS, apply_rope, name)
    span = min(max(LENGTHS), cfg.sliding_window or max(LENGTHS))
    assert env["C"] > 0 and env["C"] % tk._common_cuda.CHUNK_ALIGN == 0
    assert env["S"] == -(-span // env["C"]), env
    if "cuda_decode_splits" in paths:  # the longest span's ranges
        assert env["C"] == -(-(-(-span // int(paths["cuda_decode_splits"]))) // 64) * 64, env
    else:  # at least DECODE_MIN_SPLIT_KEYS a range: 300 keys in 2
        assert env["C"] == 256 and env["S"] == 2, env


@pytest.mark.parametrize("apply_rope", [0, 1], ids=["plain", "rope"])
@pytest.mark.parametrize("name", ["tc-4x1x128-f16-auto"])
def test_emulated_chunked_decode_auto(name, apply_rope, built):
    """Auto: chunk ranges on a skewed batch with an automatic split count above 1; equal ranges on a balanced
    batch and where the runtime passes no longest entry (0, as under CUDA graphs). On the tensor-core kernel
    (auto's on Hopper) only: the ranges come from host code both kernels share (``_common_cuda.decode_split_ranges``); the staged kernel's
    reading of chunk ranges runs in ``test_emulated_chunked_decode_matches_reference`` (an emulated build of the
    staged kernel with automatic splits cost 15 s)."""
    cfg = CONFIGS[name][0]
    b = built(name, "auto", splits=False)
    env = _run(b, cfg, SKEWED, apply_rope, f"{name}-skewed")
    assert env["C"] > 0 and env["S"] == -(-max(SKEWED) // env["C"]), env
    env = _run(b, cfg, SKEWED, apply_rope, f"{name}-unknown", max_kv_len=0)
    assert env["C"] == 0 and env["S"] > 1, env
    env = _run(b, cfg, BALANCED, apply_rope, f"{name}-balanced")
    assert env["C"] == 0, env
