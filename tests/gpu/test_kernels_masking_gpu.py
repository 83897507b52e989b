"""The CUDA attention kernels with their masking options (sliding window, logits soft-cap), called directly
against the float64 reference (``pagedkv.testing.reference.attention``). Skips cleanly without a CUDA GPU.

The cache scenarios (``test_scenarios_gpu.py``) run these kernels the way the runtime calls them (causal,
one pass per sequence); here the kernels also get what the runtime does not ask for today: non-causal
windowed prefill, entries with fewer keys than queries (rows that see no key: ``o = 0``, ``lse = -1e30``),
windows inside one key tile and over many, and decode split over a window (the benchmark window, 1024).

Kernels: the op table of each MHA shape of the GPU suite with an option on (``pagedkv.testing.shapes``) and of
the benchmark's windowed shape: the configs ``make gpu-bundle`` prebuilds, loaded from
``$PAGEDKV_KERNEL_DIR`` on a runtime-only host (compiled here when TVM has a compiler).
"""

from __future__ import annotations

import functools

import pytest
import torch

from pagedkv import backends
from pagedkv.cache import _compile_op_table, _to_ffi
from pagedkv.testing.op_calls import op_function
from pagedkv.testing import reference as R
from pagedkv.testing.scenarios import assert_state_close, random_sm_scale
from pagedkv.testing.shapes import BENCH_WINDOWED, Shape, gpu_shapes

TARGET = {"kind": "cuda", "arch": "sm_90"}
DEVICE = "cuda"
ATTN_OPS = ("attn_prefill_ragged", "attn_prefill_paged", "attn_decode_paged")
SHAPES = [s for s in gpu_shapes() if isinstance(s, Shape) and (s.window or s.cap)] + [BENCH_WINDOWED]
IDS = [s.id for s in SHAPES]

#: Prefill entries (queries, keys): one token, square, more keys than queries (several query and key tiles,
#: past the benchmark window), fewer keys than queries, no keys, no queries.
PREFILL = [(1, 1), (9, 9), (40, 40), (3, 50), (70, 1300), (20, 6), (4, 0), (0, 5)]
#: Decode keys per entry: short, across pages, long enough for split-KV with the benchmark window, empty.
DECODE = [1, 5, 13, 64, 0, 700, 3000]


@functools.cache
def attention_kernels(shape: Shape):
    """(module, {op: function}) of ``shape``'s attention ops on ``TARGET`` (the module keeps them alive)."""
    cfg = shape.config()
    choice = tuple(backends.resolve(cfg, TARGET, "tir").choice.items())
    module, table = _compile_op_table(cfg, TARGET, choice)
    return module, {entry[0]: op_function(entry) for entry in table if entry[0] in ATTN_OPS}


def _call(fn, *args, **facts):
    """``fn`` (an ``op_function``) on ``args`` as tvm-ffi tensors; ``facts``: the runtime's (``max_kv_len``)."""
    fn(*[_to_ffi(a) if isinstance(a, torch.Tensor) else a for a in args], **facts)
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _indptr(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _rope(x, pos, theta, scale):
    """Rotate-half RoPE in float64 of the float32-rounded angle ``pos * scale / theta ** (2i/D)`` that the
    prefill kernels compute (the float64 reference's exact angle drifts from it by ~1e-4 rad at the positions
    of a 3000-key entry, which fails float32's tolerance). The decode kernel computes the exact angle and is
    checked against the float64 reference (``R.rope``)."""
    d = x.shape[-1]
    expo = (2.0 * torch.arange(d // 2, dtype=torch.float64) / d).float().double()
    divisor = (float(theta) ** expo).float()
    angle = ((torch.tensor(pos, dtype=torch.float32) * float(scale))[:, None] / divisor[None, :]).double()
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    x = x.double()
    x0, x1 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)


def _reference(shape, q, k, v, q_pos, k_pos, sm_scale, causal, apply_rope, exact=False):
    """Float64 (o, lse) of one entry, q / k rotated first with inline RoPE: at the exact angle (``exact``, the
    decode kernel) or at the prefill kernels' float32 one (``_rope``)."""
    if apply_rope:
        rot = R.rope if exact else _rope
        q, k = rot(q, q_pos, shape.theta, shape.scale), rot(k, k_pos, shape.theta, shape.scale)
    return R.attention(q, k, v, sm_scale, causal, sliding_window=shape.window, logits_soft_cap=shape.cap)


def _pages(shape, ks, vs, gen):
    """A page pool holding each entry's K / V (random page order, unused slots NaN) and its index arrays."""
    ps, hkv, d = shape.ps, shape.hkv, shape.d
    counts = [-(-k.shape[0] // ps) for k in ks]
    order = torch.randperm(sum(counts) + 3, generator=gen).tolist()  # 3 spare pages, never read
    pages = torch.full((len(order), 2, hkv, ps, d), float("nan"), dtype=getattr(torch, shape.dtype))
    values, last = [], []
    for k, v, count in zip(ks, vs, counts):
        ids = [order.pop() for _ in range(count)]
        for i, pg in enumerate(ids):
            rows = slice(i * ps, min((i + 1) * ps, k.shape[0]))
            n = rows.stop - rows.start
            pages[pg, 0, :, :n] = k[rows].transpose(0, 1).to(pages.dtype)
            pages[pg, 1, :, :n] = v[rows].transpose(0, 1).to(pages.dtype)
        values += ids
        last.append(k.shape[0] - (count - 1) * ps if count else 0)
    return pages.to(DEVICE), _i32(_indptr(counts)), _i32(values or [0]), _i32(last)


#: Key position offsets of the "far" decode entries (``_entries``): around 100K to 131K, where a float32
#: angle is off by up to 8e-3 rad and a Cody-Waite reduction built for smaller angles loses its exactness.
FAR = (98_000, 131_000)


def _entries(shape, lens, gen, far: bool = False):
    """Per entry (q, k, v, k_pos_offset) in the storage dtype's values (float32 tensors on the CPU); offsets
    below 50, or with ``far`` every other entry (odd ones) in ``FAR``."""
    dt = getattr(torch, shape.dtype)
    out = []
    for i, (n, m) in enumerate(lens):
        q, k, v = (torch.randn(rows, h, shape.d, generator=gen).to(dt).float()
                   for rows, h in ((n, shape.hq), (m, shape.hkv), (m, shape.hkv)))
        lo, hi = FAR if far and i % 2 else (0, 50)
        out.append((q, k, v, int(torch.randint(lo, hi, (1,), generator=gen))))
    return out


@pytest.mark.parametrize("apply_rope", [0, 1])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_prefill_masking(shape, paged, causal, apply_rope, gen):
    _module, fns = attention_kernels(shape)
    dt = getattr(torch, shape.dtype)
    sm_scale = random_sm_scale(gen, shape.d)
    ents = _entries(shape, PREFILL, gen)
    n = sum(len(e[0]) for e in ents)
    # each query at its key position (bottom-right), offset per entry
    q_pos = [off + len(k) - len(q) + i for q, k, _v, off in ents for i in range(len(q))]
    q = torch.cat([e[0] for e in ents]).to(dt).to(DEVICE)
    o = torch.full((n, shape.hq, shape.d), float("nan"), dtype=dt, device=DEVICE)
    lse = torch.full((n, shape.hq), float("nan"), dtype=torch.float32, device=DEVICE)
    q_indptr, k_pos = _i32(_indptr([len(e[0]) for e in ents])), _i32([e[3] for e in ents])
    tail = (causal, apply_rope, float(shape.scale), float(shape.theta), sm_scale)
    if paged:
        pages, page_indptr, page_values, last = _pages(shape, [e[1] for e in ents], [e[2] for e in ents], gen)
        _call(fns["attn_prefill_paged"], q, q_indptr, pages, page_indptr, page_values, last, k_pos,
              _i32(q_pos), o, lse, *tail)
    else:
        k = torch.cat([e[1] for e in ents]).to(dt).to(DEVICE)
        v = torch.cat([e[2] for e in ents]).to(dt).to(DEVICE)
        _call(fns["attn_prefill_ragged"], q, k, v, q_indptr, _i32(_indptr([len(e[1]) for e in ents])),
              _i32(q_pos), k_pos, o, lse, *tail)
    row = 0
    for (eq, ek, ev, off), (nq, nk) in zip(ents, PREFILL):
        if nq:
            ro, rl = _reference(shape, eq, ek, ev, q_pos[row:row + nq], [off + j for j in range(nk)],
                                sm_scale, bool(causal), apply_rope)
            assert_state_close(o[row:row + nq], lse[row:row + nq], ro, rl, shape.dtype,
                               f"{shape.id} entry ({nq} q, {nk} k) causal={causal} rope={apply_rope}")
        row += nq


@pytest.mark.parametrize("apply_rope", [0, 1])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_decode_masking(shape, apply_rope, gen):
    _module, fns = attention_kernels(shape)
    dt = getattr(torch, shape.dtype)
    sm_scale = random_sm_scale(gen, shape.d)
    ents = _entries(shape, [(1, m) for m in DECODE], gen, far=True)
    pages, page_indptr, page_values, last = _pages(shape, [e[1] for e in ents], [e[2] for e in ents], gen)
    q_pos = [off + len(k) - 1 for _q, k, _v, off in ents]
    q = torch.cat([e[0] for e in ents]).to(dt).to(DEVICE)
    o = torch.full((len(DECODE), shape.hq, shape.d), float("nan"), dtype=dt, device=DEVICE)
    lse = torch.full((len(DECODE), shape.hq), float("nan"), dtype=torch.float32, device=DEVICE)
    _call(fns["attn_decode_paged"], q, pages, page_indptr, page_values, last, _i32([e[3] for e in ents]),
          _i32(q_pos), o, lse, apply_rope, float(shape.scale), float(shape.theta), sm_scale, max_kv_len=max(DECODE))
    for b, ((eq, ek, ev, off), m) in enumerate(zip(ents, DECODE)):
        ro, rl = _reference(shape, eq, ek, ev, [q_pos[b]], [off + j for j in range(m)], sm_scale, True,
                            apply_rope, exact=True)
        assert_state_close(o[b:b + 1], lse[b:b + 1], ro, rl, shape.dtype,
                           f"{shape.id} decode entry {b} ({m} keys, keys from position {off}) rope={apply_rope}")
