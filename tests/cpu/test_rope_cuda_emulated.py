"""The CUDA kernels of the RoPE variants, their generated CUDA run on the CPU (``_decode_emu``'s g++ emulation,
launched as TVM's host code launches them) against the float64 reference (``pagedkv.testing.reference_rope``):
``split_rotary`` with a LongRoPE table of interleaved pairs over rotary_dim 16 (every feature of the table), and the
inline RoPE of the lane-group decode (split 3: the merge too) and the SIMT ragged prefill with a whole-head LongRoPE
table (both sets; its attention factor folded into the scale). float32, head dim 32. Skips without g++.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import _decode_emu as emu

from pagedkv import tir_kernels as tk
from pagedkv.rope_spec import RopeSpec, attention_factor, rope_table
from pagedkv.testing import reference as R
from pagedkv.testing.reference_rope import rope_variant

D, THETA, HQ, HKV, OMAX = 32, 10000.0, 4, 2, 24
INTERLEAVED = RopeSpec(rope_type="longrope", rotary_dim=16, interleaved=True, factor=4.0,
                       original_max_position_embeddings=OMAX, short_factor=tuple(1 + 0.1 * i for i in range(8)),
                       long_factor=tuple(1 + 0.7 * i for i in range(8)))
WHOLE = RopeSpec(rope_type="longrope", factor=4.0, original_max_position_embeddings=OMAX,
                 short_factor=tuple(1 + 0.1 * i for i in range(16)), long_factor=tuple(1 + 0.7 * i for i in range(16)))
SETS = [(1, False), (2, True)]  # apply_rope, LongRoPE's long set


def _spec(rope: RopeSpec) -> tk.KernelSpec:
    return tk.KernelSpec(HQ, HKV, D, dtype="float32", rope=rope_table(rope, D, THETA, 1.0))


@pytest.fixture(scope="module")
def stem(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    return tmp_path_factory.mktemp("rope")


def _rel(out, ref) -> float:
    return float((torch.as_tensor(np.asarray(out, dtype=np.float64)) - ref).norm() / ref.norm())


def test_split_rotary(stem):
    """Rotated pairs at both sets (exact angles: ``rope_sincos``); the dims past rotary_dim and v copied."""
    built = emu.build(_spec(INTERLEAVED), {}, stem / "split_rotary", op="split_rotary")
    rng = np.random.default_rng()
    n = 7
    qkv = rng.standard_normal((n, HQ + 2 * HKV, D)).astype(np.float32)
    pos = rng.integers(0, 3 * OMAX, n).astype(np.int32)
    for apply_rope, long in SETS:
        arrays = {"qkv": qkv, "q_pos": pos, **{name: np.full((n, h, D), np.nan, np.float32)
                                               for name, h in (("q", HQ), ("k", HKV), ("v", HKV))}}
        emu.launch(built, arrays, {"n": n, "apply_rope": apply_rope, "rope_scale": 1.0, "rope_theta": THETA,
                                   "dev_id": 0})
        for name, part in (("q", qkv[:, :HQ]), ("k", qkv[:, HQ:HQ + HKV])):
            ref = rope_variant(torch.from_numpy(part), pos, THETA, 1.0, INTERLEAVED, long=long)
            assert _rel(arrays[name], ref) < 1e-5, (name, apply_rope)
            assert np.array_equal(arrays[name][..., 16:], part[..., 16:])
        assert np.array_equal(arrays["v"], qkv[:, HQ + HKV:])


def test_inline_decode_lanes(stem):
    """The lane-group decode's inline RoPE takes the table (relative positions, exact angles; keys near position
    30,000 in every other entry), split in 3 (workspace + merge)."""
    assert attention_factor(WHOLE) > 1.1  # folded into the scale: a dropped or doubled factor fails
    spec = _spec(WHOLE)
    built = emu.build(spec, {"cuda_decode_kernel": "lanes", "cuda_decode_splits": "3"}, stem / "decode")
    ents, pages, page_indptr, page_values, last = emu.inputs(spec, torch.Generator().manual_seed(3), [0, 5, 37, 70], 8)
    for apply_rope, long in SETS:
        o, lse, _env = emu.run_decode(built, spec, ents, pages, page_indptr, page_values, last, 8, apply_rope, 0.3,
                                      THETA, 1.0)
        for b, (eq, ek, ev, off) in enumerate(ents):
            m = ek.shape[0]
            if not m:
                assert torch.all(o[b] == 0)
                continue
            rq = rope_variant(eq, [off + m - 1], THETA, 1.0, WHOLE, long=long)
            rk = rope_variant(ek, [off + j for j in range(m)], THETA, 1.0, WHOLE, long=long)
            ro, rl = R.attention(rq, rk, ev, 0.3, True)
            assert _rel(o[b:b + 1], ro) < 2e-5 and torch.allclose(lse[b:b + 1], rl, atol=1e-4), (apply_rope, b)


def test_inline_prefill_simt(stem):
    """The SIMT ragged prefill's inline RoPE takes the table (causal; entries at positions 0, 37, 74)."""
    built = emu.build(_spec(WHOLE), {"cuda_prefill_kernel": "simt"}, stem / "prefill", op="attn_prefill_ragged")
    gen = torch.Generator().manual_seed(4)
    lens = [(3, 7), (5, 5), (1, 9)]
    ents = [tuple(torch.randn(r, h, D, generator=gen).double() for r, h in ((nq, HQ), (nk, HKV), (nk, HKV)))
            for nq, nk in lens]
    offs = [37 * i for i in range(len(lens))]
    q_pos = [off + nk - nq + i for (nq, nk), off in zip(lens, offs) for i in range(nq)]
    n = len(q_pos)
    for apply_rope, long in SETS:
        arrays = {name: torch.cat([e[i] for e in ents]).float().numpy() for i, name in enumerate(("q", "k", "v"))}
        arrays.update(q_indptr=np.cumsum([0] + [nq for nq, _ in lens]).astype(np.int32),
                      kv_indptr=np.cumsum([0] + [nk for _, nk in lens]).astype(np.int32),
                      q_pos=np.array(q_pos, np.int32), k_pos_offset=np.array(offs, np.int32),
                      o=np.full((n, HQ, D), np.nan, np.float32), lse=np.full((n, HQ), np.nan, np.float32))
        env = {"n": n, "_m": arrays["k"].shape[0], "B": len(lens), "causal": 1, "apply_rope": apply_rope,
               "rope_scale": 1.0, "rope_theta": THETA, "sm_scale": 0.3, "dev_id": 0}
        emu.run_launches(built, emu.launches(built.main, env), arrays)
        row = 0
        for (eq, ek, ev), (nq, nk), off in zip(ents, lens, offs):
            rq = rope_variant(eq, q_pos[row:row + nq], THETA, 1.0, WHOLE, long=long)
            rk = rope_variant(ek, [off + j for j in range(nk)], THETA, 1.0, WHOLE, long=long)
            ro, rl = R.attention(rq, rk, ev, 0.3, True)
            assert _rel(arrays["o"][row:row + nq], ro) < 2e-5, (apply_rope, off)
            assert np.allclose(arrays["lse"][row:row + nq], rl.numpy(), atol=1e-4)
            row += nq
