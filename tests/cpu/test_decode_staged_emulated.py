"""The staged CUDA decode kernels (plain and inline RoPE, ``tir_kernels/_decode_staged_cuda.py`` and
``_decode_staged_rope_cuda.py``) run on the CPU (no GPU): TVM's generated CUDA of ``attn_decode_paged`` on the
emulator of ``_decode_emu.py`` (launched as TVM's host code launches it, the split and merge kernels as on a
GPU), checked against the float64 reference (``pagedkv.testing.reference``: RoPE at the exact angle, keys at
``k_pos_offset + j``, the query at ``q_pos``).

Cases: GQA groups 1, 3, 4, 7 and 8, head dims 64, 96 (padding lanes) and 128, fp16 / bf16 / fp32, one windowed and soft-capped; batches of
mixed lengths (an empty entry, one key, page edges, a last tile the keys do not fill) with every other entry's
positions near 30000; split counts forced above 1 (the workspace and merge path) and 1; NaN runs (issue 44) at
float32. Fresh random inputs each run, NaN-poisoned outputs. Skips without g++.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from _decode_emu import build, check_against_reference, inputs, run_decode

from pagedkv import tir_kernels as tk

#: name -> (config, forced split count). Splits: 3 and 2 (split + merge), 1 (direct write).
CONFIGS = {
    "4x1x64-f16-s3": (tk.KernelSpec(4, 1, 64, 64, "float16"), "3"),
    "8x1x128-bf16-s2": (tk.KernelSpec(8, 1, 128, 128, "bfloat16"), "2"),
    "2x2x128-f16-s1": (tk.KernelSpec(2, 2, 128, 128, "float16"), "1"),
    "7x1x64-f32-w40-cap20-s2": (tk.KernelSpec(7, 1, 64, 64, "float32", sliding_window=40, logits_soft_cap=20.0),
                                "2"),
    # 6 of 8 lanes hold dims (the padding lanes' zeros in the dots and the q table reads)
    "3x1x96-bf16-s3": (tk.KernelSpec(3, 1, 96, 96, "bfloat16"), "3"),
}
#: Keys per entry: empty, one, page (16) and tile (32 / 64) edges, a last tile left partly empty, several tiles.
LENGTHS = [150, 0, 1, 17, 64, 95]
PS = 16
THETA, SCALE = 10000.0, 1.0


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``get(name)``: the config's compiled kernels (``_decode_emu.Built``)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    out, workdir = {}, tmp_path_factory.mktemp("emu_decode")

    def get(name):
        if name not in out:
            cfg, splits = CONFIGS[name]
            # staged forced: auto runs the plain fp16 / bf16 decode on the tensor-core kernel where it serves
            out[name] = build(cfg, {"cuda_decode_splits": splits, "cuda_decode_kernel": "staged"}, workdir / name)
            staged = [k for k, (body, _p) in out[name].kernels.items() if "Ks_ptr" in body]
            assert len(staged) == 2, "plain and RoPE decode both run the staged kernel"
        return out[name]

    return get


@pytest.mark.parametrize("apply_rope", [0, 1], ids=["plain", "rope"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_emulated_staged_decode_matches_reference(name, apply_rope, built):
    b = built(name)
    cfg = CONFIGS[name][0]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = inputs(cfg, gen, LENGTHS, PS)
    sm_scale = 0.9 / math.sqrt(cfg.head_dim)
    o, lse, _env = run_decode(b, cfg, ents, pages, page_indptr, page_values, last, PS, apply_rope, sm_scale,
                              THETA, SCALE)
    check_against_reference(name, cfg, ents, o, lse, apply_rope, THETA, SCALE, sm_scale)


#: The NaN run's poisoned elements (``_decode_emu.inputs``' ``nan``) on LENGTHS: a q row of entry 3; a key of entry 5
#: inside the window of 40 (its 7 rows NaN) and one of entry 0 below it (never read: its rows stay finite).
NAN_AT = [("q", 3, 2), ("k", 5, 80, 0), ("k", 0, 50, 0)]


@pytest.mark.parametrize("apply_rope", [0, 1], ids=["plain", "rope"])
def test_emulated_staged_decode_nan_propagates(apply_rope, built):
    """Issue 44 on the float32 decode (auto's kernel for fp32): a NaN q row and a NaN key the row sees give NaN
    rows (o and lse, through the split merge), a NaN key outside the window changes nothing; on main the NaN rows
    came out as the empty state."""
    name = "7x1x64-f32-w40-cap20-s2"
    b = built(name)
    cfg = CONFIGS[name][0]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = inputs(cfg, gen, LENGTHS, PS, nan=NAN_AT)
    sm_scale = 0.9 / math.sqrt(cfg.head_dim)
    o, lse, _env = run_decode(b, cfg, ents, pages, page_indptr, page_values, last, PS, apply_rope, sm_scale,
                              THETA, SCALE)
    assert torch.isnan(lse).sum() == 1 + cfg.num_qo_heads
    check_against_reference(f"{name}-nan", cfg, ents, o, lse, apply_rope, THETA, SCALE, sm_scale)
