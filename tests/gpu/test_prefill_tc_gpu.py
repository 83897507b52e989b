"""The tensor-core CUDA prefill (``tir_kernels.attention_cuda_prefill_tc``, forced with the path switch
``cuda_prefill_kernel=tc2`` or ``tc3`` (128 rows, two stages in dynamic shared memory; under auto, without wgmma,
tc3 serves the ragged op and tc2 the paged one where they serve the spec), ``wg2t`` / ``wg1t`` (wgmma, two / one
warpgroups, K / V by TMA; their libraries built for sm_90a)) and the SIMT one (forced ``simt``) against the float64
reference. Skips cleanly without a CUDA GPU.

Shapes ``pagedkv.testing.shapes.PREFILL_TC_SHAPES`` (GQA groups 4, 1, 8, 7, 3; head dims 128, 64, 96, 256; fp16 and
bf16; two windowed + soft-capped, at head dims 64 and 128), ragged and paged, causal and not, over one batch of entries of mixed
lengths: not multiples of the 64-row / 64-key tiles (1, 17, 63, 64, 65, 200, 1000), more keys than queries
(bottom-right causal), fewer (rows that see no key), no keys, no queries; outputs NaN-poisoned, fresh random
inputs per test. Besides ``assert_state_close`` (the suite's rule) each entry's ``|o - ref| / |ref|`` must be
below 1e-2. Ragged k / v also as views not 16-byte aligned (the kernel then loads elements instead of 16-byte
``cp.async`` chunks). ``apply_rope = 1`` still runs the SIMT RoPE kernel of the same PrimFunc (checked once
per shape).

Kernels: the libraries of ``(shape, paths)`` for each of ``PREFILL_KERNEL_PATHS``, prebuilt by ``make gpu-bundle``
(``pagedkv.testing.shapes.gpu_path_libraries``); ``tests/cpu/test_bundle.py`` checks that the bundle builds
every library named in ``LIBRARIES``.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from test_kernels_masking_gpu import _call, _entries, _i32, _indptr, _pages, _reference

from pagedkv import backends
from pagedkv.backends.tir import forced_paths
from pagedkv.cache import _compile_op_table
from pagedkv.kernel_spec import WG_PREFILL_TILES, target_for_paths
from pagedkv.testing.scenarios import assert_state_close, random_sm_scale
from pagedkv.testing.shapes import PREFILL_KERNEL_PATHS, PREFILL_TC_SHAPES, prefill_kernel_refusal

TARGET = {"kind": "cuda", "arch": "sm_90"}
DEVICE = "cuda"
#: (shape, forced paths) of every kernel library this module loads.
LIBRARIES = [(s, dict(p)) for s in PREFILL_TC_SHAPES for p in PREFILL_KERNEL_PATHS
             if not prefill_kernel_refusal(s, p["cuda_prefill_kernel"])]
KERNELS = [p["cuda_prefill_kernel"] for p in PREFILL_KERNEL_PATHS]
#: The tensor-core tiles among them.
TC_KERNELS = [k for k in KERNELS if k != "simt"]
#: (queries, keys) per entry, in one batch.
ENTRIES = [(1, 1), (17, 17), (63, 63), (64, 64), (65, 65), (200, 200), (1000, 1000), (17, 200), (65, 1000),
           (64, 129), (20, 6), (200, 0), (0, 5), (3, 70)]


@functools.cache
def _prefill_fns(shape, kernel: str):
    """(module, {op: function}) of the shape's op table compiled (or loaded) with the ``kernel`` prefill."""
    cfg = shape.config()
    paths = {"cuda_prefill_kernel": kernel}
    target = target_for_paths(paths, TARGET)  # wg2t / wg1t (wgmma): their libraries are built for sm_90a
    with forced_paths(paths):
        choice = tuple(backends.resolve(cfg, target, "tir").choice.items())
        module, table = _compile_op_table(cfg, target, choice)
    return module, {entry[0]: entry[-1] for entry in table}


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` as a view one element into its buffer: not 16-byte aligned."""
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    view = buf[1:].view(x.shape)
    view.copy_(x)
    assert view.data_ptr() % 16
    return view


def _run(shape, paged: bool, causal: int, apply_rope: int, gen, misalign: bool = False, kernel: str = "tc3",
         ps: int | None = None):
    """Run one prefill over ``ENTRIES``; returns (entries, q_pos, o, lse, sm_scale). ``misalign``: ragged q / k / v
    as unaligned views (the kernel's element-load path); ``ps``: pages of that many keys instead of the shape's
    (the kernels take the page size from the pool: the same library)."""
    _module, fns = _prefill_fns(shape, kernel)
    dt = getattr(torch, shape.dtype)
    sm_scale = random_sm_scale(gen, shape.d)
    ents = _entries(shape, ENTRIES, gen)
    n = sum(len(e[0]) for e in ents)
    q_pos = [off + len(k) - len(q) + i for q, k, _v, off in ents for i in range(len(q))]
    q = torch.cat([e[0] for e in ents]).to(dt).to(DEVICE)
    o = torch.full((n, shape.hq, shape.d), float("nan"), dtype=dt, device=DEVICE)
    lse = torch.full((n, shape.hq), float("nan"), dtype=torch.float32, device=DEVICE)
    q_indptr, k_pos = _i32(_indptr([len(e[0]) for e in ents])), _i32([e[3] for e in ents])
    tail = (causal, apply_rope, float(shape.scale), float(shape.theta), sm_scale)
    if paged:
        pages, page_indptr, page_values, last = _pages(dataclasses.replace(shape, ps=ps or shape.ps),
                                                       [e[1] for e in ents], [e[2] for e in ents], gen)
        _call(fns["attn_prefill_paged"], q, q_indptr, pages, page_indptr, page_values, last, k_pos,
              _i32(q_pos), o, lse, *tail)
    else:
        k = torch.cat([e[1] for e in ents]).to(dt).to(DEVICE)
        v = torch.cat([e[2] for e in ents]).to(dt).to(DEVICE)
        if misalign:  # q too: "tc3" copies q rows with cp.async when aligned
            k, v, q = _misaligned(k), _misaligned(v), _misaligned(q)
        _call(fns["attn_prefill_ragged"], q, k, v, q_indptr, _i32(_indptr([len(e[1]) for e in ents])),
              _i32(q_pos), k_pos, o, lse, *tail)
    return ents, q_pos, o, lse, sm_scale


def _check(shape, paged, causal, apply_rope, gen, misalign=False, kernel="tc3", ps=None):
    if why := prefill_kernel_refusal(shape, kernel):
        pytest.skip(f"tile {kernel!r} refuses {shape.id}: {why}")
    ents, q_pos, o, lse, sm_scale = _run(shape, paged, causal, apply_rope, gen, misalign, kernel, ps)
    row = 0
    for (eq, ek, ev, off), (nq, nk) in zip(ents, ENTRIES):
        if nq:
            what = (f"{kernel} {shape.id} {'paged' if paged else 'ragged'}{' misaligned' if misalign else ''} entry ({nq} q, "
                    f"{nk} k) causal={causal} rope={apply_rope}")
            ro, rl = _reference(shape, eq, ek, ev, q_pos[row:row + nq], [off + j for j in range(nk)],
                                sm_scale, bool(causal), apply_rope)
            got = o[row:row + nq].detach().to("cpu", torch.float64)
            assert not torch.isnan(got).any() and not torch.isnan(lse[row:row + nq]).any(), f"{what}: NaN left"
            if ro.abs().max() > 0:
                rel = ((got - ro).norm() / ro.norm()).item()
                assert rel < 1e-2, f"{what}: |o - ref| / |ref| = {rel:.3g}"
            assert_state_close(o[row:row + nq], lse[row:row + nq], ro, rl, shape.dtype, what)
        row += nq


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("shape", PREFILL_TC_SHAPES, ids=[s.id for s in PREFILL_TC_SHAPES])
def test_prefill_tc(shape, paged, causal, kernel, gen):
    _check(shape, paged, causal, 0, gen, kernel=kernel)


@pytest.mark.parametrize("shape", PREFILL_TC_SHAPES, ids=[s.id for s in PREFILL_TC_SHAPES])
@pytest.mark.parametrize("kernel", TC_KERNELS)
def test_prefill_tc_library_runs_simt_rope(shape, kernel, gen):
    """``apply_rope = 1``: the tensor-core PrimFunc's SIMT RoPE kernel (the tensor-core one has no RoPE)."""
    _check(shape, False, 1, 1, gen, kernel=kernel)


@pytest.mark.parametrize("kernel", TC_KERNELS)
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("shape", PREFILL_TC_SHAPES, ids=[s.id for s in PREFILL_TC_SHAPES])
def test_prefill_tc_unaligned_views(shape, causal, kernel, gen):
    """Ragged k / v not 16-byte aligned: the element-load path (a run-time test of the addresses)."""
    _check(shape, False, causal, 0, gen, misalign=True, kernel=kernel)


@pytest.mark.parametrize("kernel", WG_PREFILL_TILES)
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("shape", PREFILL_TC_SHAPES[:3], ids=[s.id for s in PREFILL_TC_SHAPES[:3]])
def test_prefill_tma_tile_pages_not_a_multiple_of_8(shape, causal, kernel, gen):
    """Pages of 12 keys: a TMA tile's paged PrimFunc runs its fallback (tc2; boxes of 8 keys would straddle pages),
    the other branch of the host code's test (pages of 16, the shapes' own, take the TMA kernel)."""
    _check(shape, True, causal, 0, gen, kernel=kernel, ps=12)
