"""The tensor-core CUDA decode kernel (``tir_kernels/_decode_tc_cuda.py``, ``cuda_decode_kernel=tc``) run on the
CPU (no GPU): TVM's generated CUDA of ``attn_decode_paged`` on the emulator of ``_decode_emu.py`` (``mma.sync``,
``ldmatrix`` and ``cp.async`` emulated from the PTX ISA's definitions, copies completing as late as their waits
allow; launched as TVM's host code launches it, the split and merge kernels as on a GPU), checked against the
float64 reference.

Cases: GQA groups 1, 4, 7, 8 and 16 (padding rows of the m16 tile, a full tile), head dims 64 / 128, fp16 /
bf16, one windowed + soft-capped; batches of mixed lengths (an empty entry, one key, fewer keys than a tile,
page and tile edges, five tiles: the 3-slot ring wraps) with pages in random order and every slot not holding a
key NaN; split counts forced to 1 (direct write), 3 and 8 (workspace + merge; the automatic count on this kernel:
``test_decode_chunked_emulated``). Inline RoPE
(``apply_rope = 1``: the tensor-core RoPE kernel of ``_decode_tc_rope_cuda`` in the same PrimFunc, keys rotated in
shared memory) on groups 1, 4, 7, 8 and 16, both head dims and dtypes, windowed + capped, every other entry's positions
near 30,000 (``k_pos_offset``). A NaN run (issue 44): NaN q row and keys, one outside the window. Fresh random
inputs each run, NaN-poisoned outputs. Skips without g++.
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import numpy as np
import pytest
import torch
from _decode_emu import (TC_SWITCHES, build, check_against_reference, inputs, launch, launches, run_decode,
                         set_tc_switch, storage, values)

from pagedkv import tir_kernels as tk
from pagedkv.testing import reference as R
from pagedkv.tir_kernels import _decode_tc_cuda as tcd

#: name -> (config, forced split count or "auto").
CONFIGS = {
    "2x2x128-f16-s1": (tk.KernelSpec(2, 2, 128, 128, "float16"), "1"),
    "4x1x64-bf16-s3": (tk.KernelSpec(4, 1, 64, 64, "bfloat16"), "3"),
    "7x1x128-f16-s3": (tk.KernelSpec(7, 1, 128, 128, "float16"), "3"),
    "8x1x128-bf16-s1": (tk.KernelSpec(8, 1, 128, 128, "bfloat16"), "1"),
    # 8 splits: more than an entry's tiles (splits past its keys write the empty state); the automatic count
    # (several times the blocks to emulate) runs on this kernel in test_decode_chunked_emulated's auto test
    "16x1x64-f16-s8": (tk.KernelSpec(16, 1, 64, 64, "float16"), "8"),
    "16x1x128-bf16-s3": (tk.KernelSpec(16, 1, 128, 128, "bfloat16"), "3"),
    "8x1x64-f16-w90-cap20-s3": (tk.KernelSpec(8, 1, 64, 64, "float16", sliding_window=90, logits_soft_cap=20.0),
                                "3"),
}
CASES = [(name, 0) for name in CONFIGS] + [(name, 1) for name in CONFIGS]
#: Keys per entry: five tiles (the ring wraps at S = 1), empty, one, fewer than a tile, page / tile edges.
LENGTHS = [300, 0, 1, 17, 64, 129, 63]
PS = 16
THETA, SCALE = 10000.0, 1.0


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``get(name)``: the config's compiled kernels (``_decode_emu.Built``), the plain one the tc kernel."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    out, workdir = {}, tmp_path_factory.mktemp("emu_decode_tc")

    def get(name):
        if name not in out:
            cfg, splits = CONFIGS[name]
            out[name] = build(cfg, {"cuda_decode_kernel": "tc", "cuda_decode_splits": splits}, workdir / name)
            tc = [k for k, (body, _p) in out[name].kernels.items() if "pagedkv_mma_" in body and "tcd_smem" in body]
            assert len(tc) == 2, "the plain and the inline-RoPE decode run the tensor-core kernel"
            assert sum("pagedkv_rope_rotl_" in out[name].kernels[k][0] for k in tc) == 1
        return out[name]

    return get


@pytest.mark.parametrize(("name", "apply_rope"), CASES, ids=[f"{n}-{'rope' if r else 'plain'}" for n, r in CASES])
def test_emulated_tc_decode_matches_reference(name, apply_rope, built):
    b = built(name)
    cfg, splits = CONFIGS[name]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = inputs(cfg, gen, LENGTHS, PS)
    sm_scale = 0.9 / math.sqrt(cfg.head_dim)
    o, lse, env = run_decode(b, cfg, ents, pages, page_indptr, page_values, last, PS, apply_rope, sm_scale,
                             THETA, SCALE)
    if splits != "auto":
        assert env["S"] == int(splits)
    check_against_reference(name, cfg, ents, o, lse, apply_rope, THETA, SCALE, sm_scale)


@pytest.mark.parametrize("name", ["2x2x128-f16-s1", "4x1x64-bf16-s3"], ids=["d128", "d64"])
def test_tc_dynamic_shared_memory_launch(name, built):
    """The host code launches the tc kernel (plain and RoPE) with the ring's bytes of dynamic shared memory (the
    emulator gives every kernel a static array, so its runs would not see a short launch)."""
    b = built(name)
    cfg, _splits = CONFIGS[name]
    for rope in (0, 1):
        env = {"B": 4, "_p": 64, "ps": 16, "nnz": 32, "apply_rope": rope, "sm_scale": 0.1, "rope_scale": 1.0,
               "rope_theta": 1e4, "max_kv_len": 100, "dev_id": 0}
        dyn = []
        for kname, args in launches(b.main, env):
            names = b.launch_params[kname]
            vals = dict(zip(names, args[len(args) - len(names):]))
            if "tirx.use_dyn_shared_memory" in names:
                dyn.append(vals["tirx.use_dyn_shared_memory"])
        assert dyn == [tcd.smem_words(cfg.head_dim, rope=bool(rope)) * 4], (rope, dyn, b.launch_params)


#: The NaN run's poisoned elements (``_decode_emu.inputs``' ``nan``) on LENGTHS: a q row of entry 3; a key of
#: entry 5 inside the window of 90 (its rows NaN) and one of entry 0 below it (300 keys: never read, rows finite).
NAN_AT = [("q", 3, 5), ("k", 5, 100, 0), ("k", 0, 150, 0)]


def test_emulated_tc_decode_nan_propagates(built):
    """Issue 44: a NaN q row and a NaN key the row sees give NaN rows (o and lse, through the split merge: S = 3),
    a NaN key outside the window changes nothing; the other rows match the reference (on main the NaN rows came
    out as the empty state: o = 0, lse = -1e30)."""
    name = "8x1x64-f16-w90-cap20-s3"
    b = built(name)
    cfg, _splits = CONFIGS[name]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = inputs(cfg, gen, LENGTHS, PS, nan=NAN_AT)
    sm_scale = 0.9 / math.sqrt(cfg.head_dim)
    o, lse, env = run_decode(b, cfg, ents, pages, page_indptr, page_values, last, PS, 0, sm_scale, THETA, SCALE)
    assert env["S"] == 3
    assert torch.isnan(lse).sum() == 1 + cfg.num_qo_heads  # the q row, the 8 heads of entry 5
    check_against_reference(f"{name}-nan", cfg, ents, o, lse, 0, THETA, SCALE, sm_scale)


@pytest.mark.knobs
def test_emulated_tc_decode_two_slot_ring(tmp_path, monkeypatch):
    """The ring's other size (``TCD_SLOTS = 2``: one tile in flight, ``wait_group 0``), which the default (3)
    never builds: plain and RoPE (one build serves both: ``apply_rope`` is a runtime argument), splits 1 (the
    ring wraps over 300 keys) and 3."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    monkeypatch.setattr(tcd, "TCD_SLOTS", 2)
    for splits in ("1", "3"):
        cfg = tk.KernelSpec(8, 2, 128, 128, "float16")
        b = build(cfg, {"cuda_decode_kernel": "tc", "cuda_decode_splits": splits}, tmp_path / f"s{splits}")
        tc = [body for body, _p in b.kernels.values() if "tcd_smem" in body]
        assert len(tc) == 2 and not any("pagedkv_cp_async_wait1(" in body for body in tc)  # no 3-slot wait
        for apply_rope in (0, 1):
            gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
            ents, pages, page_indptr, page_values, last = inputs(cfg, gen, LENGTHS, PS)
            sm_scale = 0.9 / math.sqrt(cfg.head_dim)
            o, lse, env = run_decode(b, cfg, ents, pages, page_indptr, page_values, last, PS, apply_rope,
                                     sm_scale, THETA, SCALE)
            assert env["S"] == int(splits)
            check_against_reference(f"slots2-s{splits}-rope{apply_rope}", cfg, ents, o, lse, apply_rope, THETA,
                                    SCALE, sm_scale)


#: (head dim, split count, dtype) of the anchor runs, a covering set: both head dims' lane layouts at S = 1, both
#: rotations (fp16 packed, bf16 in float32), and a split decode.
ANCHOR_RUNS = [(128, "1", "float16"), (64, "1", "bfloat16"), (64, "3", "float16")]


@pytest.mark.parametrize(("d", "splits", "dtype"), ANCHOR_RUNS, ids=[f"d{d}-s{s}-{t}" for d, s, t in ANCHOR_RUNS])
def test_emulated_tc_rope_anchor_every_other_tile(d, splits, dtype, tmp_path, monkeypatch):
    """The RoPE kernel's base angles re-anchored (exact ``rope_sincos``) every 2 tiles instead of every
    ``ANCHOR_TILES``: anchors after stepped tiles (tiles 2, 4 of 300 keys at S = 1), both head dims' lane
    layouts (8 and 4 chunks a half row), positions near 30,000 on every other entry."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    from pagedkv.tir_kernels import _decode_tc_rope_cuda as tcr

    monkeypatch.setattr(tcr, "ANCHOR_TILES", 2)
    cfg = tk.KernelSpec(8, 2, d, d, dtype)
    b = build(cfg, {"cuda_decode_kernel": "tc", "cuda_decode_splits": splits}, tmp_path / f"d{d}s{splits}")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = inputs(cfg, gen, LENGTHS, PS)
    sm_scale = 0.9 / math.sqrt(cfg.head_dim)
    o, lse, env = run_decode(b, cfg, ents, pages, page_indptr, page_values, last, PS, 1, sm_scale, THETA, SCALE)
    assert env["S"] == int(splits)
    check_against_reference(f"anchor2-d{d}-s{splits}", cfg, ents, o, lse, 1, THETA, SCALE, sm_scale)


#: switch -> (head dim, split count) of its one build: both head dims and split counts 1 and 3 over the four.
SWITCH_SHAPES = {"float32_rotation": (128, "1"), "rings_inverted": (64, "3"), "lookup_inverted": (128, "3"),
                 "no_l2_prefetch": (64, "1")}


@pytest.mark.parametrize("splits", ["1", "3"])
def test_emulated_tc_decode_partial(splits, tmp_path):
    """``attn_decode_paged_partial`` (o in float32: a multi-pass forward's pass) on the tensor-core kernel, plain
    and RoPE: one split writes o from the block's merged rows, three through the split merge kernel."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    cfg = tk.KernelSpec(8, 2, 64, 64, "bfloat16")
    b = build(cfg, {"cuda_decode_kernel": "tc", "cuda_decode_splits": splits}, tmp_path / f"s{splits}",
              op="attn_decode_paged_partial")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = inputs(cfg, gen, LENGTHS, PS)
    sm_scale = 0.9 / math.sqrt(cfg.head_dim)
    for rope in (0, 1):
        o, lse, env = run_decode(b, cfg, ents, pages, page_indptr, page_values, last, PS, rope, sm_scale, THETA,
                                 SCALE, out_dtype="float32")
        assert env["S"] == int(splits)
        check_against_reference(f"partial-s{splits}-rope{rope}", cfg, ents, o, lse, rope, THETA, SCALE, sm_scale)


@pytest.mark.knobs
@pytest.mark.parametrize("switch", list(TC_SWITCHES))
def test_emulated_tc_decode_switches(switch, tmp_path, monkeypatch):
    """The kernel's other build switches, which the defaults never build: ``PACKED_F16 = False`` (fp16 keys
    rotated in float32, as bf16 always is) and ``TCD_WARP_RING`` inverted (the plain kernel's warps copy their
    own rows behind a warp barrier, the RoPE kernel's block whole tiles behind a block barrier) and
    ``TCD_LOOKUP_AHEAD`` inverted (D 128's page lookups right before their copies, D 64's a step early) and
    ``CP_ASYNC_L2_PREFETCH = None`` (copies without the L2 prefetch hint);
    plain and RoPE, positions near 30,000; one build a switch (``SWITCH_SHAPES``: each inverted switch crosses
    paths the defaults already build at the other head dim or variant)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    set_tc_switch(monkeypatch, switch)
    d, splits = SWITCH_SHAPES[switch]
    cfg = tk.KernelSpec(8, 2, d, d, "float16")
    b = build(cfg, {"cuda_decode_kernel": "tc", "cuda_decode_splits": splits}, tmp_path / f"d{d}s{splits}")
    bodies = [body for body, _p in b.kernels.values() if "tcd_smem" in body]
    assert any("pagedkv_rope_rotl_" in body for body in bodies)
    assert not any("_p(" in body for body in bodies) if switch == "float32_rotation" else True
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = inputs(cfg, gen, LENGTHS, PS)
    sm_scale = 0.9 / math.sqrt(cfg.head_dim)
    for rope in (0, 1):
        o, lse, env = run_decode(b, cfg, ents, pages, page_indptr, page_values, last, PS, rope, sm_scale,
                                 THETA, SCALE)
        assert env["S"] == int(splits)
        check_against_reference(f"{switch}-d{d}-s{splits}-rope{rope}", cfg, ents, o, lse, rope, THETA, SCALE,
                                sm_scale)


#: Sinks of 8 query heads (+-8: a dropped sink is obvious; +-3: about a row's own softmax mass, a doubled one).
SINKS = torch.tensor([8.0, -8.0, 3.0, -3.0, 0.5, -0.5, 2.0, -2.0])


def _sink_kernels(cfg, workdir):
    """The CUDA sink kernels of ``cfg`` (``tir_kernels/sinks_cuda.py``) on the emulator, by op."""
    return {op: build(cfg, {}, workdir / op, op=op) for op in ("apply_sinks", "merge_state_partial_sinks")}


def test_emulated_split_decode_then_sinks(built, tmp_path):
    """A one-pass decode forward with sinks on CUDA: the tensor-core decode split three ways (workspace + merge
    kernel), then ``apply_sinks``. Each query counts its head's sink once, not once per split: within tolerance of
    the reference with the sinks, far from it without them and with them doubled; an entry without keys gets
    ``o = 0``, ``lse = the sink``. Then the emulated ``merge_state_partial_sinks``, and NaN through both kernels."""
    name = "4x1x64-bf16-s3"
    cfg, splits = CONFIGS[name]
    cfg8 = tk.KernelSpec(8, 2, 64, 64, "bfloat16")  # the sink kernels read only Hq and the dtype
    hq = cfg.num_qo_heads
    sinks = SINKS[:hq].numpy().astype(np.float32)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = inputs(cfg, gen, LENGTHS, PS)
    sm_scale = 0.9 / math.sqrt(cfg.head_dim)
    o, lse, env = run_decode(built(name), cfg, ents, pages, page_indptr, page_values, last, PS, 0, sm_scale, THETA,
                             SCALE)
    assert env["S"] == int(splits)
    kernels = _sink_kernels(dataclasses.replace(cfg8, num_qo_heads=hq, num_kv_heads=1), tmp_path)
    o_st, lse_st = storage(o, cfg.dtype), lse.numpy().astype(np.float32)
    launch(kernels["apply_sinks"], {"o": o_st, "lse": lse_st, "sinks": sinks},
           {"n": len(ents), "DV": cfg.head_dim, "dev_id": 0})
    got_o, got_l = values(o_st, cfg.dtype), torch.from_numpy(lse_st).double()
    for b, (eq, ek, ev, _off) in enumerate(ents):
        miss = {}
        for what, s in (("sinks", SINKS[:hq]), ("none", None), ("doubled", SINKS[:hq] + math.log(2))):
            ro, rl = R.attention(eq, ek, ev, sm_scale, True, sinks=s)
            rel = ((got_o[b] - ro[0]).norm(dim=1) / ro[0].norm(dim=1).clamp_min(1e-6)).max().item()
            miss[what] = max(rel, (got_l[b] - rl[0]).abs().max().item() / 10)
        assert miss["sinks"] < 1e-2 and min(miss["none"], miss["doubled"]) > 5e-2, f"entry {b}: {miss}"
    assert torch.all(got_o[1] == 0) and torch.allclose(got_l[1], SINKS[:hq].double() / math.log(2))
    _emulated_sink_nan_and_partial_merge(kernels, hq)


def _emulated_sink_nan_and_partial_merge(kernels, hq: int):
    """``merge_state_partial_sinks`` (float32 states, an empty pair, o rounded once) and NaN through both kernels:
    a NaN lse or o stays NaN in its row and goes nowhere else."""
    gen = torch.Generator().manual_seed(7)
    n, dv = 4, 80  # dv past two warp strides, not a multiple of 32
    sinks = SINKS[:hq]
    o_a, o_b = (torch.randn(n, hq, dv, generator=gen) for _ in range(2))
    l_a, l_b = (torch.randn(n, hq, generator=gen) * 4 for _ in range(2))
    o_a[0], o_b[0], l_a[0], l_b[0] = 0, 0, R.EMPTY_LSE, R.EMPTY_LSE
    l_a[1, 1], o_b[2, 0, 3] = math.nan, math.nan
    want_o, want_l = R.apply_sinks(*R.merge_states(o_a.double(), l_a.double(), o_b.double(), l_b.double()), sinks)
    arrays = {"o_a": o_a.numpy().copy(), "lse_a": l_a.numpy().copy(), "o_b": o_b.numpy().copy(),
              "lse_b": l_b.numpy().copy(), "sinks": sinks.numpy().copy(), "o": storage(torch.full_like(o_a, math.nan),
                                                                                       "bfloat16")}
    launch(kernels["merge_state_partial_sinks"], arrays, {"n": n, "DV": dv, "dev_id": 0})
    for got, want_state, tol in ((torch.from_numpy(arrays["o_a"]).double(), want_o, 1e-5),
                                 (values(arrays["o"], "bfloat16"), want_o, 1e-2)):
        assert torch.equal(torch.isnan(got), torch.isnan(want_state)), "NaN lost or leaked"
        ok = ~torch.isnan(want_state)
        assert torch.allclose(got[ok], want_state[ok], rtol=tol, atol=tol)
    got_l = torch.from_numpy(arrays["lse_a"]).double()
    assert torch.equal(torch.isnan(got_l), torch.isnan(want_l))
    assert torch.allclose(got_l[~torch.isnan(want_l)], want_l[~torch.isnan(want_l)], atol=1e-4)
    # apply_sinks on a NaN lse and a NaN o element
    o, lse = torch.randn(2, hq, dv, generator=gen), torch.randn(2, hq, generator=gen)
    lse[0, 2], o[1, 3, 7] = math.nan, math.nan
    want_o, want_l = R.apply_sinks(o.to(torch.bfloat16).double(), lse.double(), sinks)
    arrays = {"o": storage(o, "bfloat16"), "lse": lse.numpy().copy(), "sinks": sinks.numpy().copy()}
    launch(kernels["apply_sinks"], arrays, {"n": 2, "DV": dv, "dev_id": 0})
    got = values(arrays["o"], "bfloat16")
    assert torch.equal(torch.isnan(got), torch.isnan(want_o))
    assert torch.equal(torch.isnan(torch.from_numpy(arrays["lse"])), torch.isnan(want_l))
