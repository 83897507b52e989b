"""Every forced code path of the CUDA kernels (``pagedkv.tir_kernels.SWITCHES``, ``cuda_*``) against the float64
reference. Skips cleanly without a CUDA GPU.

A run-time path choice (the decode kernels' split-KV count ``S``, picked on the host from the shapes) is only
tested where a test's shapes happen to select it; forcing it (``pagedkv.backends.tir.forced_paths``) runs each
path on every shape. Here:

- the MHA decode kernel, called directly, under every value of ``cuda_decode_splits`` (auto, 1, 2, 3, 8) on
  ``PATH_SHAPES`` (plain, windowed, windowed + capped; 8 and 4 kv heads; GQA groups 4 and 8; auto runs the
  plain fp16 decode on the tensor-core kernel of ``_decode_tc_cuda``, fp32 and inline RoPE on the staged
  kernels of ``_decode_staged_cuda`` / ``_decode_staged_rope_cuda``), with the lane-group kernels forced
  (``cuda_decode_kernel=lanes``, splits auto, 1, 3) and, on the fp16 shapes, the staged ones
  (``cuda_decode_kernel=staged``, the same splits), inline RoPE on and off (the staged RoPE kernel rotates q
  per key tile and keys by their tile offset, so a split or an entry ending mid-tile and positions near 100K
  check its tables; the lane-group one walks a split in batches of ``NW`` key steps with a rotated-q table per
  batch, so a split ends mid-batch too), and with the tensor-core plain kernel forced
  (``cuda_decode_kernel=tc``) on ``TC_DECODE_SHAPES`` (group 8 bf16 windowed + capped under splits auto, 1, 3,
  8; group 16 at D 64 under auto), over batches of 20 entries of mixed lengths (empty, shorter than the window, just around it, windows
  starting past the first key step and mid-page, 3000 keys), every other entry's keys from a position near
  100K (``FAR``; RoPE against the exact float64 angle), longest first and shortest first (a per-batch start or
  state would show in the later entries);
- the MLA decode kernel the same way on ``PATH_MLA_SHAPES``;
- the scenario suite (``pagedkv.testing.scenarios``) under every forced value on ``PATH_SCENARIO_SHAPES``
  (plain, windowed, MLA), through ``pagedkv.create`` as the runtime calls the kernels.

Kernels: the libraries ``pagedkv.testing.shapes.gpu_path_libraries`` names, prebuilt by ``make gpu-bundle``
(loaded from ``$PAGEDKV_KERNEL_DIR`` by key, forced paths included, on a runtime-only host; compiled here when
TVM has a compiler). ``tests/cpu/test_bundle.py`` checks that the bundle builds every library named in
``LIBRARIES`` below.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_kernels_masking_gpu import _call, _entries, _i32, _indptr, _pages, _reference

from pagedkv import backends
from pagedkv.backends.tir import forced_paths
from pagedkv.cache import _compile_op_table
from pagedkv.kernel_spec import target_for_paths
from pagedkv.testing.op_calls import op_function
from pagedkv.testing import reference as R
from pagedkv.testing.scenarios import SCENARIOS, ScenarioRunner, assert_state_close, random_sm_scale
from pagedkv.testing.shapes import (PATH_SCENARIO_SHAPES, cuda_path_switches, decode_path_cases, mla_path_cases,
                                    mla_prefill_path_cases)

TARGET = {"kind": "cuda", "arch": "sm_90"}
DEVICE = "cuda"
SPLITS = list(cuda_path_switches()["cuda_decode_splits"])
#: Keys per decode entry: empty, one, around the windows (24, 300) and the key steps (16 / 32), mid-page
#: window starts, several splits of a long entry.
LENGTHS = [3000, 0, 1, 5, 23, 24, 25, 31, 33, 47, 64, 100, 255, 299, 300, 301, 333, 700, 1500, 17]
ORDERS = {"long_first": sorted(LENGTHS, reverse=True), "short_first": sorted(LENGTHS)}

#: Default kernels (plain decode: the tensor-core kernel in fp16, the staged one in fp32) under every split
#: value, and the lane-group and staged plain kernels forced (``cuda_decode_kernel=lanes`` / ``staged``) under
#: ``LANES_SPLITS``; inline RoPE runs the staged RoPE kernel in the first and with ``staged`` (every
#: ``PATH_SHAPES`` shape is within ``staged_rope_limits``), and the lane-group one with ``lanes``.
DECODE_CASES = decode_path_cases()
MLA_CASES = mla_path_cases()
MLA_PREFILL_CASES = mla_prefill_path_cases()
SCENARIO_CASES = [(s, {"cuda_decode_splits": v}) for s in PATH_SCENARIO_SHAPES for v in SPLITS if v != "auto"]
#: ... and the lane-group plain kernel through the runtime (a library of DECODE_CASES).
SCENARIO_CASES += [(s, {"cuda_decode_kernel": "lanes", "cuda_decode_splits": "3"}) for s in PATH_SCENARIO_SHAPES[:2]]
#: (shape, forced paths) of every kernel library this module loads.
LIBRARIES = DECODE_CASES + MLA_CASES + MLA_PREFILL_CASES + SCENARIO_CASES


def _id(case) -> str:
    shape, paths = case
    return shape.id + "-" + "-".join(f"{k}={v}" for k, v in sorted(paths.items()))


@functools.cache
def _kernels(shape, paths_items: tuple):
    """(module, {op: function}) of ``shape``'s op table compiled (or loaded) under the forced paths."""
    cfg = shape.config()
    target = target_for_paths(dict(paths_items), TARGET)  # the MLA "wgq" kernel's library is built for sm_90a
    with forced_paths(dict(paths_items)):
        choice = tuple(backends.resolve(cfg, target, "tir").choice.items())
        return _compile_op_table(cfg, target, choice)


def _decode_fn(shape, paths: dict, op: str):
    module, table = _kernels(shape, tuple(sorted(paths.items())))
    return module, op_function(next(entry for entry in table if entry[0] == op))


def _check_decode(case, lengths, apply_rope, gen, label, max_kv_len):
    """``case``'s attn_decode_paged on one entry per length (NaN-poisoned outputs) against the float64
    reference; ``max_kv_len``: the runtime's launch hint given to the kernel."""
    shape, paths = case
    _module, fn = _decode_fn(shape, paths, "attn_decode_paged")
    dt = getattr(torch, shape.dtype)
    sm_scale = random_sm_scale(gen, shape.d)
    ents = _entries(shape, [(1, m) for m in lengths], gen, far=True)
    pages, page_indptr, page_values, last = _pages(shape, [e[1] for e in ents], [e[2] for e in ents], gen)
    q_pos = [off + len(k) - 1 for _q, k, _v, off in ents]
    q = torch.cat([e[0] for e in ents]).to(dt).to(DEVICE)
    o = torch.full((len(ents), shape.hq, shape.d), float("nan"), dtype=dt, device=DEVICE)
    lse = torch.full((len(ents), shape.hq), float("nan"), dtype=torch.float32, device=DEVICE)
    _call(fn, q, pages, page_indptr, page_values, last, _i32([e[3] for e in ents]), _i32(q_pos), o, lse,
          apply_rope, float(shape.scale), float(shape.theta), sm_scale, max_kv_len=max_kv_len)
    for b, ((eq, ek, ev, off), m) in enumerate(zip(ents, lengths)):
        ro, rl = _reference(shape, eq, ek, ev, [q_pos[b]], [off + j for j in range(m)], sm_scale, True,
                            apply_rope, exact=True)
        assert_state_close(o[b:b + 1], lse[b:b + 1], ro, rl, shape.dtype,
                           f"{label} entry {b} ({m} keys from position {off}) rope={apply_rope}")


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("apply_rope", [0, 1])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[_id(c) for c in DECODE_CASES])
def test_decode_forced_splits(case, apply_rope, order, gen):
    lengths = ORDERS[order]
    _check_decode(case, lengths, apply_rope, gen, f"{_id(case)} {order}", max(lengths))


def _mla_pages(shape, latents, gen):
    """MLA page pool ``[P, 1, 1, ps, DL]`` holding each entry's latents (random page order, unused slots
    NaN) and its index arrays."""
    ps, dl = shape.ps, shape.r + shape.rope
    counts = [-(-x.shape[0] // ps) for x in latents]
    order = torch.randperm(sum(counts) + 3, generator=gen).tolist()  # 3 spare pages, never read
    pages = torch.full((len(order), 1, 1, ps, dl), float("nan"), dtype=getattr(torch, shape.dtype))
    values, last = [], []
    for x, count in zip(latents, counts):
        ids = [order.pop() for _ in range(count)]
        for i, pg in enumerate(ids):
            rows = x[i * ps:(i + 1) * ps]
            pages[pg, 0, 0, :rows.shape[0]] = rows.to(pages.dtype)
        values += ids
        last.append(x.shape[0] - (count - 1) * ps if count else 0)
    return pages.to(DEVICE), _i32(_indptr(counts)), _i32(values or [0]), _i32(last)


def _check_mla_decode(case, lengths, gen, label, max_kv_len):
    """``case``'s mla_attn_decode_paged on one entry per length against the float64 reference."""
    shape, paths = case
    _module, fn = _decode_fn(shape, paths, "mla_attn_decode_paged")
    dt = getattr(torch, shape.dtype)
    dl, r = shape.r + shape.rope, shape.r
    sm_scale = random_sm_scale(gen, shape.d)
    qs = [torch.randn(1, shape.h, dl, generator=gen).to(dt).float() for _ in lengths]
    lat = [torch.randn(m, dl, generator=gen).to(dt).float() for m in lengths]
    pages, page_indptr, page_values, last = _mla_pages(shape, lat, gen)
    o = torch.full((len(lengths), shape.h, r), float("nan"), dtype=dt, device=DEVICE)
    lse = torch.full((len(lengths), shape.h), float("nan"), dtype=torch.float32, device=DEVICE)
    _call(fn, torch.cat(qs).to(dt).to(DEVICE), pages, page_indptr, page_values, last, o, lse, sm_scale,
          max_kv_len=max_kv_len)
    for b, (q, x, m) in enumerate(zip(qs, lat, lengths)):
        ro, rl = R.attention(q, x[:, None, :], x[:, None, :r], sm_scale, True)
        assert_state_close(o[b:b + 1], lse[b:b + 1], ro, rl, shape.dtype, f"{label} entry {b} ({m} keys)")


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("case", MLA_CASES, ids=[_id(c) for c in MLA_CASES])
def test_mla_decode_forced_splits(case, order, gen):
    lengths = ORDERS[order]
    _check_mla_decode(case, lengths, gen, f"{_id(case)} {order}", max(lengths))


#: (queries, keys) of the paged MLA prefill's entries: more queries than keys (under causal the first rows see none),
#: one query, a long prefix over several tiles and splits, an entry without keys, page and tile edges.
MLA_PREFILL_ENTRIES = [(7, 300), (1, 17), (40, 33), (3, 0), (16, 64), (5, 1000)]


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("case", MLA_PREFILL_CASES, ids=[_id(c) for c in MLA_PREFILL_CASES])
def test_mla_prefill_forced_kernels(case, causal, gen):
    """``case``'s mla_attn_prefill_paged (NaN-poisoned outputs) against the float64 reference, bottom-right causal
    or not; rows that see no key give o = 0, lse = -1e30."""
    shape, paths = case
    _module, table = _kernels(shape, tuple(sorted(paths.items())))
    fn = op_function(next(entry for entry in table if entry[0] == "mla_attn_prefill_paged"))
    dt = getattr(torch, shape.dtype)
    dl, r = shape.r + shape.rope, shape.r
    sm_scale = random_sm_scale(gen, shape.d)
    qs = [torch.randn(nq, shape.h, dl, generator=gen).to(dt).float() for nq, _m in MLA_PREFILL_ENTRIES]
    lat = [torch.randn(m, dl, generator=gen).to(dt).float() for _nq, m in MLA_PREFILL_ENTRIES]
    pages, page_indptr, page_values, last = _mla_pages(shape, lat, gen)
    n = sum(q.shape[0] for q in qs)
    o = torch.full((n, shape.h, r), float("nan"), dtype=dt, device=DEVICE)
    lse = torch.full((n, shape.h), float("nan"), dtype=torch.float32, device=DEVICE)
    q_indptr = _i32(_indptr([q.shape[0] for q in qs]))
    _call(fn, torch.cat(qs).to(dt).to(DEVICE), q_indptr, pages, page_indptr, page_values, last, o, lse, causal,
          sm_scale)
    t0 = 0
    for b, (q, x) in enumerate(zip(qs, lat)):
        ro, rl = R.attention(q, x[:, None, :], x[:, None, :r], sm_scale, bool(causal))
        assert_state_close(o[t0:t0 + q.shape[0]], lse[t0:t0 + q.shape[0]], ro, rl, shape.dtype,
                           f"{_id(case)} causal={causal} entry {b} ({q.shape[0]} queries, {x.shape[0]} keys)")
        t0 += q.shape[0]


#: ``max_kv_len`` values the split-hint tests give the kernels: the true longest entry, unknown (0, a CUDA-graph
#: decode), a short one (the batch looks balanced: S = 1) and a huge one (skewed: split).
HINTS = {"longest": None, "unknown": 0, "one": 1, "huge": 1 << 30}


@pytest.mark.parametrize("hint", list(HINTS))
def test_decode_split_hint_any_value(hint, gen):
    """The runtime's ``max_kv_len`` picks the split count only (``wave_split_count``): a batch of one full
    wave (32 entries x 8 kv heads = 256 blocks of the tc kernel's 264 slots; 512-767 keys, so the ladder
    splits in 2) runs S = 1 when the hint says balanced and S = 2 otherwise; every value gives the reference."""
    case = next(c for c in DECODE_CASES if c[0].hkv == 8 and c[0].dtype == "float16" and c[0].window == 0
                and c[1] == {"cuda_decode_splits": "auto"})
    lengths = [512 + int(x) for x in torch.randint(0, 256, (32,), generator=gen)]
    mx = max(lengths) if HINTS[hint] is None else HINTS[hint]
    _check_decode(case, lengths, 0, gen, f"hint={hint}", mx)


@pytest.mark.parametrize("kernel", ["auto", "wgq"])
@pytest.mark.parametrize("hint", list(HINTS))
def test_mla_decode_split_hint_any_value(hint, kernel, gen):
    """As above for the MLA tensor-core decodes (auto: the mma.sync one; wgq: wgmma; 16 heads: one block an entry,
    132 slots): 128 entries of 512-767 keys, one full wave: S = 1 when balanced, else the ladder's 2."""
    paths = {"cuda_decode_splits": "auto"} | ({} if kernel == "auto" else {"cuda_mla_decode_kernel": kernel})
    case = next(c for c in MLA_CASES if c[0].h == 16 and c[1] == paths)
    lengths = [512 + int(x) for x in torch.randint(0, 256, (128,), generator=gen)]
    mx = max(lengths) if HINTS[hint] is None else HINTS[hint]
    _check_mla_decode(case, lengths, gen, f"hint={hint}", mx)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("case", SCENARIO_CASES, ids=[_id(c) for c in SCENARIO_CASES])
def test_scenario_forced_paths(case, scenario, make_gpu_cache, gen):
    shape, paths = case
    with forced_paths(paths):  # the cache's kernels are compiled / looked up here
        cache = make_gpu_cache(shape.config())
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    runner.run(SCENARIOS[scenario](shape.ps), scenario)
