"""Every pagedkv TIR kernel on the CPU against a float64 PyTorch reference.

Rules: fresh random inputs every run (no fixed seed), outputs pre-filled with NaN, unused page slots
NaN (an over-read poisons the result), relative error ``|out - ref| / |ref|`` below 1e-5 (float32) or
1e-2 (float16, bfloat16; the reference takes the inputs as rounded to the storage dtype). bfloat16 arrays
are numpy arrays of ml_dtypes' ``bfloat16``. Compiled kernels are cached per (op, config) for the session.

Run: ``.venv/bin/python -m pytest tests/cpu/test_kernels.py -q``
"""

from __future__ import annotations

import functools
import math

import ml_dtypes  # noqa: F401 (registers numpy's "bfloat16"; a dependency of apache-tvm)
import numpy as np
import pytest
import torch

import tvm

from pagedkv import ops
from pagedkv import tir_kernels as tk
from pagedkv.testing import reference as shared_ref  # the one float64 reference

TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
EMPTY_LSE = -1.0e30
RNG = np.random.default_rng()  # replaced per test by the fixture below
TARGET = tk.host_target()


@pytest.fixture(autouse=True)
def _fresh_rng(request):
    """Fresh random inputs per test; the shared ``seed`` fixture (tests/conftest.py) prints the seed and
    honours ``PAGEDKV_TEST_SEED`` for replay."""
    global RNG  # noqa: PLW0603 (the helpers below draw from the module generator)
    try:
        seed = request.getfixturevalue("seed")
    except pytest.FixtureLookupError:
        seed = None
    RNG = np.random.default_rng(seed)

# (Hq, Hkv, D): GQA groups 1, 3, 4, 7 with D 64/128, plus one D=96 case.
ATTN_SHAPES = [(4, 4, 64), (6, 2, 128), (8, 2, 64), (14, 2, 128), (3, 1, 96)]
DTYPES = ["float32", "float16", "bfloat16"]


def covering(shapes, *, offset: int):
    """(shape, dtype) pairs, a covering set instead of the product: one dtype a shape, rotating from
    ``offset``, so every dtype meets two or three shapes (GQA groups and head dims) of an op, and a shape
    meets another dtype in each op (the ops' offsets differ). A kernel is compiled per (shape, dtype) (page
    size, causal and RoPE are runtime arguments, run in full over each pair): the compiles are the cost of
    this module."""
    return [(shape, DTYPES[(i + offset) % len(DTYPES)]) for i, shape in enumerate(shapes)]


def _pair_ids(pairs):
    return [f"{'x'.join(map(str, shape))}-{dtype}" for shape, dtype in pairs]


DECODE_PAIRS = covering(ATTN_SHAPES + [(16, 2, 256)], offset=0)
PAGED_PAIRS = covering(ATTN_SHAPES, offset=1)
RAGGED_PAIRS = covering([s + (s[2],) for s in ATTN_SHAPES] + [(8, 2, 128, 64)], offset=2)


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def kernel(op: str, cfg: tk.KernelSpec):
    """Compiled ``pagedkv_<op>`` for ``cfg`` (cached for the whole session)."""
    func = tk.FACTORIES[op](cfg, TARGET)
    lib = tvm.compile(tvm.IRModule({f"pagedkv_{op}": func}), target=TARGET)
    return lib[f"pagedkv_{op}"]


def dev(arr: np.ndarray, offset: int = 0):
    """A TVM tensor holding ``arr``; ``offset > 0`` makes it a view at that element offset."""
    if offset == 0:
        return tvm.runtime.tensor(np.ascontiguousarray(arr))
    flat = np.full(arr.size + offset, np.nan if is_float(arr.dtype) else -7, dtype=arr.dtype)
    flat[offset:] = arr.ravel()
    base = tvm.runtime.tensor(flat)
    return base._create_view(arr.shape, str(arr.dtype), relative_byte_offset=offset * arr.itemsize)


def is_float(dtype) -> bool:
    """numpy float dtypes, ml_dtypes' bfloat16 included (its numpy kind is "V")."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) == np.dtype("bfloat16")


def randn(*shape, dtype="float32"):
    return RNG.standard_normal(shape).astype(dtype)


def rel_err(out, ref) -> float:
    out = torch.as_tensor(np.asarray(out, dtype=np.float64))
    ref = torch.as_tensor(np.asarray(ref, dtype=np.float64))
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def rope_ref(x: torch.Tensor, pos: torch.Tensor, scale: float, theta: float) -> torch.Tensor:
    """Rotate-half RoPE in float64 (``pagedkv.testing.reference``); ``x[..., T, D]`` with positions ``pos[T]``."""
    return shared_ref.rope(x.transpose(0, 1), pos, theta, scale).transpose(0, 1)


def attention_ref(q, k, v, causal, sm_scale, q_pos=None, k_pos=None, rope=None, *, sliding_window=0,
                  logits_soft_cap=0.0):
    """One entry: ``q[qlen,Hq,D]``, ``k[kvlen,Hkv,D]``, ``v[kvlen,Hkv,Dv]`` -> (o, lse base 2), float64.

    Rows that see no key get o = 0 and lse = EMPTY_LSE. ``sliding_window`` / ``logits_soft_cap`` as in
    ``KernelSpec`` (0: off).
    """
    q, k, v = (torch.as_tensor(np.asarray(a, dtype=np.float64)) for a in (q, k, v))
    qlen, hq, _ = q.shape
    kvlen, hkv, dv = v.shape
    if rope is not None:
        q = rope_ref(q.transpose(0, 1), torch.as_tensor(q_pos), *rope).transpose(0, 1)
        k = rope_ref(k.transpose(0, 1), torch.as_tensor(k_pos), *rope).transpose(0, 1)
    o, lse = shared_ref.attention(q, k, v, sm_scale, bool(causal), sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap)
    return o.numpy(), lse.numpy()


def check_attention(o, lse, o_ref, lse_ref, dtype):
    """o/lse vs reference: nothing left NaN, empty rows exact, relative errors under the dtype's bound."""
    assert not np.isnan(o).any(), "output rows left unwritten (NaN)"
    assert not np.isnan(lse).any(), "lse rows left unwritten (NaN)"
    empty = lse_ref <= EMPTY_LSE / 2
    assert np.array_equal(lse[empty], np.full(empty.sum(), EMPTY_LSE, np.float32)), "empty lse"
    assert np.all(o[empty] == 0), "empty rows must have o = 0"
    assert rel_err(o, o_ref) < TOL[dtype]
    if (~empty).any():
        assert rel_err(lse[~empty], lse_ref[~empty]) < TOL[dtype]


class PagedKV:
    """A random page pool holding ``lens[b]`` tokens per entry on shuffled pages; the rest is NaN."""

    def __init__(self, lens, hkv, d, ps, dtype):
        self.lens, self.ps = list(lens), ps
        npages = [-(-n // ps) for n in self.lens]
        pool = sum(npages) + 3  # spare pages stay NaN
        self.pages = np.full((pool, 2, hkv, ps, d), np.nan, dtype=dtype)
        order = RNG.permutation(pool).astype(np.int32)
        self.page_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
        self.page_values = order[: sum(npages)].copy()
        self.last_page_len = np.array([n - (p - 1) * ps if p else 0 for n, p in zip(self.lens, npages)],
                                      dtype=np.int32)
        self.k, self.v = [], []
        for b, n in enumerate(self.lens):
            k, v = randn(n, hkv, d, dtype=dtype), randn(n, hkv, d, dtype=dtype)
            for j in range(n):
                page = self.page_values[self.page_indptr[b] + j // ps]
                self.pages[page, 0, :, j % ps] = k[j]
                self.pages[page, 1, :, j % ps] = v[j]
            self.k.append(k)
            self.v.append(v)


def rope_params():
    """Random RoPE scale/theta (positions stay below ~300 so float32 angles keep 1e-5 accuracy)."""
    return float(RNG.choice([1.0, 0.5, 2.0])), float(RNG.choice([10000.0, 500000.0]))


def view_offset(ps: int) -> int:
    """Element offset for the non-page buffers: page size 8 runs every such buffer as a view."""
    return 5 if ps == 8 else 0


# ---------------------------------------------------------------------------------------------------
# vocabulary and factories
# ---------------------------------------------------------------------------------------------------
def test_ops_match_vocabulary():
    assert tk.OPS is ops.OPS  # the kernels take the vocabulary from pagedkv.ops, not a copy


def test_build_kernels_symbols():
    spec = tk.KernelSpec(8, 2, 64, 64, "float16")
    funcs = tk.build_kernels(spec, TARGET)
    assert list(funcs) == list(ops.ops_for(spec))  # the layer kind's ops less the sink ops (no attention_sinks)
    mla_spec = tk.KernelSpec(4, 4, 96, 64, "float16", kv_lora_rank=64, qk_rope_head_dim=32)
    mla = tk.build_kernels(mla_spec, TARGET)
    assert sorted(mla) == sorted(ops.ops_for(mla_spec))
    for op, func in {**funcs, **mla}.items():
        assert func.attrs["global_symbol"] == f"pagedkv_{op}"


def test_config_validation():
    assert tk.KernelSpec(8, 2, 64).v_head_dim == 64
    with pytest.raises(ValueError, match="multiple"):
        tk.KernelSpec(6, 4, 64)
    with pytest.raises(ValueError, match="dtype"):
        tk.KernelSpec(4, 4, 64, 64, "int8")


def test_unknown_target_kind_names_the_op():
    with pytest.raises(NotImplementedError, match="attn_decode_paged"):
        tk.make_attn_decode_paged(tk.KernelSpec(4, 4, 64), tvm.target.Target({"kind": "vulkan"}))


# ---------------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------------
def masked_q(n, hq, d, dtype, masking):
    """Random queries, scaled by the soft-cap if any: scores (about N(0, 1) unscaled) then often pass it."""
    scale = masking.get("logits_soft_cap", 0.0) or 1.0
    return (RNG.standard_normal((n, hq, d)) * scale).astype(dtype)


def run_decode_paged(shape, dtype, ps, apply_rope, lens, masking=None, kv=None, paths=()):
    """``attn_decode_paged`` over sequences of ``lens`` keys vs the reference; ``masking``: KernelSpec's
    sliding_window / logits_soft_cap; ``kv``: a prepared ``PagedKV`` (else a random one); ``paths``:
    KernelSpec's forced code paths."""
    hq, hkv, d = shape
    masking = masking or {}
    kv = kv or PagedKV(lens, hkv, d, ps, dtype)
    nb = len(lens)
    q = masked_q(nb, hq, d, dtype, masking)
    k_pos_offset = RNG.integers(0, 40, nb).astype(np.int32)
    q_pos = (k_pos_offset + np.maximum(np.array(lens) - 1, 0)).astype(np.int32)
    rope_scale, rope_theta = rope_params()
    sm_scale = float(RNG.uniform(0.5, 1.5) / math.sqrt(d))
    off = view_offset(ps)
    o = dev(np.full((nb, hq, d), np.nan, dtype), off)
    lse = dev(np.full((nb, hq), np.nan, np.float32), off)
    kernel("attn_decode_paged", tk.KernelSpec(hq, hkv, d, d, dtype, **masking, paths=paths))(
        dev(q, off), dev(kv.pages), dev(kv.page_indptr, off), dev(kv.page_values, off),
        dev(kv.last_page_len, off), dev(k_pos_offset, off), dev(q_pos, off), o, lse,
        apply_rope, rope_scale, rope_theta, sm_scale)
    refs = [attention_ref(q[b:b + 1], kv.k[b], kv.v[b], False, sm_scale, q_pos[b:b + 1],
                          k_pos_offset[b] + np.arange(n), (rope_scale, rope_theta) if apply_rope else None,
                          **masking)
            for b, n in enumerate(lens)]
    check_attention(o.numpy(), lse.numpy(), np.concatenate([r[0] for r in refs]),
                    np.concatenate([r[1] for r in refs]), dtype)


@pytest.mark.parametrize("apply_rope", [0, 1])
@pytest.mark.parametrize("ps", [16, 8])
@pytest.mark.parametrize("shape,dtype", DECODE_PAIRS, ids=_pair_ids(DECODE_PAIRS))
def test_attn_decode_paged(shape, dtype, ps, apply_rope):
    lens = [0, 1, ps, 3 * ps + 5, 9 * ps + 1, int(RNG.integers(1, 4 * ps))]
    run_decode_paged(shape, dtype, ps, apply_rope, lens)


def prefill_entries(ps):
    """(qlen, kvlen) per entry: empty kv, qlen > kvlen (causal rows with no key), qlen 0, page
    crossings, several query tiles, one random."""
    return [(3, 0), (1, 1), (5, 2), (0, 7), (ps + 3, 3 * ps + 5), (40, 70),
            (int(RNG.integers(1, 20)), int(RNG.integers(1, 5 * ps)))]


def run_prefill_paged(shape, dtype, ps, causal, apply_rope, entries, masking=None, paths=()):
    """``attn_prefill_paged`` over ``entries`` ((qlen, kvlen) each) against the reference."""
    hq, hkv, d = shape
    masking = masking or {}
    kv = PagedKV([kl for _, kl in entries], hkv, d, ps, dtype)
    qlens = np.array([ql for ql, _ in entries])
    q_indptr = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    n = int(q_indptr[-1])
    q = masked_q(n, hq, d, dtype, masking)
    k_pos_offset = RNG.integers(0, 40, len(entries)).astype(np.int32)
    q_pos = RNG.integers(0, 150, n).astype(np.int32)
    rope_scale, rope_theta = rope_params()
    sm_scale = float(RNG.uniform(0.5, 1.5) / math.sqrt(d))
    off = view_offset(ps)
    o = dev(np.full((n, hq, d), np.nan, dtype), off)
    lse = dev(np.full((n, hq), np.nan, np.float32), off)
    kernel("attn_prefill_paged", tk.KernelSpec(hq, hkv, d, d, dtype, **masking, paths=paths))(
        dev(q, off), dev(q_indptr, off), dev(kv.pages), dev(kv.page_indptr, off), dev(kv.page_values, off),
        dev(kv.last_page_len, off), dev(k_pos_offset, off), dev(q_pos, off), o, lse,
        causal, apply_rope, rope_scale, rope_theta, sm_scale)
    refs = [attention_ref(q[q_indptr[b]:q_indptr[b + 1]], kv.k[b], kv.v[b], causal, sm_scale,
                          q_pos[q_indptr[b]:q_indptr[b + 1]], k_pos_offset[b] + np.arange(kl),
                          (rope_scale, rope_theta) if apply_rope else None, **masking)
            for b, (_, kl) in enumerate(entries)]
    check_attention(o.numpy(), lse.numpy(), np.concatenate([r[0] for r in refs]),
                    np.concatenate([r[1] for r in refs]), dtype)


@pytest.mark.parametrize("apply_rope", [0, 1])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("ps", [16, 8])
@pytest.mark.parametrize("shape,dtype", PAGED_PAIRS, ids=_pair_ids(PAGED_PAIRS))
def test_attn_prefill_paged(shape, dtype, ps, causal, apply_rope):
    run_prefill_paged(shape, dtype, ps, causal, apply_rope, prefill_entries(ps))


def ragged_entries():
    """(qlen, kvlen) per entry for the ragged prefill: as ``prefill_entries``, plus qlen > kvlen."""
    return [(1, 1), (5, 5), (3, 0), (0, 4), (37, 37), (6, 20), (20, 6),
            (int(RNG.integers(1, 50)), int(RNG.integers(1, 50)))]


def run_prefill_ragged(shape, dtype, causal, apply_rope, entries, masking=None, paths=()):
    """``attn_prefill_ragged`` (``shape = (Hq, Hkv, D, Dv)``) over ``entries`` against the reference."""
    hq, hkv, d, dv = shape
    masking = masking or {}
    qlens = np.array([e[0] for e in entries])
    kvlens = np.array([e[1] for e in entries])
    q_indptr = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kvlens)]).astype(np.int32)
    n, m = int(q_indptr[-1]), int(kv_indptr[-1])
    q = masked_q(n, hq, d, dtype, masking)
    k, v = randn(m, hkv, d, dtype=dtype), randn(m, hkv, dv, dtype=dtype)
    k_pos_offset = RNG.integers(0, 40, len(entries)).astype(np.int32)
    q_pos = RNG.integers(0, 150, n).astype(np.int32)
    rope_scale, rope_theta = rope_params()
    sm_scale = float(RNG.uniform(0.5, 1.5) / math.sqrt(d))
    off = 3 * causal
    o = dev(np.full((n, hq, dv), np.nan, dtype), off)
    lse = dev(np.full((n, hq), np.nan, np.float32), off)
    kernel("attn_prefill_ragged", tk.KernelSpec(hq, hkv, d, dv, dtype, **masking, paths=paths))(
        dev(q, off), dev(k, off), dev(v, off), dev(q_indptr, off), dev(kv_indptr, off), dev(q_pos, off),
        dev(k_pos_offset, off), o, lse, causal, apply_rope, rope_scale, rope_theta, sm_scale)
    refs = [attention_ref(q[q_indptr[b]:q_indptr[b + 1]], k[kv_indptr[b]:kv_indptr[b + 1]],
                          v[kv_indptr[b]:kv_indptr[b + 1]], causal, sm_scale,
                          q_pos[q_indptr[b]:q_indptr[b + 1]], k_pos_offset[b] + np.arange(kvlens[b]),
                          (rope_scale, rope_theta) if apply_rope else None, **masking)
            for b in range(len(entries))]
    check_attention(o.numpy(), lse.numpy(), np.concatenate([r[0] for r in refs]),
                    np.concatenate([r[1] for r in refs]), dtype)


@pytest.mark.parametrize("apply_rope", [0, 1])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("shape,dtype", RAGGED_PAIRS, ids=_pair_ids(RAGGED_PAIRS))
def test_attn_prefill_ragged(shape, dtype, causal, apply_rope):
    run_prefill_ragged(shape, dtype, causal, apply_rope, ragged_entries())


# ---------------------------------------------------------------------------------------------------
# sliding window and logits soft-cap: compile-time, so one kernel per case with the runtime options
# (page size, causal) parametrized over it; RoPE is independent of them, so half the runs take it
# ---------------------------------------------------------------------------------------------------
#: ((Hq, Hkv, D), dtype, sliding_window, logits_soft_cap): windows 3 (under a page), 17, 40 (over a
#: 32-key tile) and 200 (over every sequence), caps 5 and 30. Window only, cap only and both each take
#: both dtypes, GQA groups 1 and 4 and head dims 64 and 128; then groups 7 and 3; then both options in
#: bfloat16 (the capped scores' tanh and the window mask are float32 whatever the storage dtype).
MASK_CASES = [
    ((4, 4, 64), "float32", 3, 0.0), ((8, 2, 128), "float16", 40, 0.0),
    ((8, 2, 64), "float32", 0, 5.0), ((4, 4, 128), "float16", 0, 30.0),
    ((8, 2, 128), "float32", 17, 30.0), ((4, 4, 64), "float16", 200, 5.0),
    ((14, 2, 128), "float32", 40, 5.0), ((3, 1, 64), "float16", 17, 30.0),
    ((8, 2, 128), "bfloat16", 40, 5.0),
]


def _mask_id(case):
    shape, dtype, window, cap = case
    return f"{'x'.join(map(str, shape))}-{dtype}-w{window}-cap{cap:g}"


@pytest.mark.parametrize("ps", [16, 8])
@pytest.mark.parametrize("case", MASK_CASES, ids=_mask_id)
def test_attn_decode_paged_masking(case, ps):
    shape, dtype, window, cap = case
    lens = [0, 1, 5, ps, 3 * ps + 5, 70, 150, int(RNG.integers(1, 150))]
    run_decode_paged(shape, dtype, ps, int(ps == 8), lens, {"sliding_window": window, "logits_soft_cap": cap})


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("ps", [16, 8])
@pytest.mark.parametrize("case", MASK_CASES, ids=_mask_id)
def test_attn_prefill_paged_masking(case, ps, causal):
    shape, dtype, window, cap = case
    entries = prefill_entries(ps) + [(70, 70), (25, 150)]
    run_prefill_paged(shape, dtype, ps, causal, int(ps == 8), entries,
                      {"sliding_window": window, "logits_soft_cap": cap})


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("case", MASK_CASES + [((8, 2, 128, 64), "float32", 17, 5.0)], ids=_mask_id)
def test_attn_prefill_ragged_masking(case, causal):
    shape, dtype, window, cap = case  # (Hq, Hkv, D[, Dv])
    entries = ragged_entries() + [(70, 70), (25, 150), (90, 40)]
    run_prefill_ragged((shape + shape[2:])[:4], dtype, causal, causal, entries,
                       {"sliding_window": window, "logits_soft_cap": cap})


@pytest.mark.parametrize("ps", [16, 8])
def test_attn_decode_window_skips_old_keys(ps):
    """A windowed decode reads only the key tiles that reach into the window: K/V of older keys are
    NaN in the pages (a read would poison the output), the reference uses their true values."""
    shape, dtype, window, _ = MASK_CASES[1]  # window 40 > one 32-key tile
    lens = [150, 100, 73, 40, 9]
    kv = PagedKV(lens, shape[1], shape[2], ps, dtype)
    tile = 32  # keys per kv tile of the CPU kernels (TilePlan.tk)
    for b, n in enumerate(lens):
        for j in range(max(0, n - window) // tile * tile):
            kv.pages[kv.page_values[kv.page_indptr[b] + j // ps], :, :, j % ps] = np.nan
    run_decode_paged(shape, dtype, ps, 0, lens, {"sliding_window": window}, kv=kv)


def test_attn_prefill_ragged_gqa8_long():
    """Group 8, one long causal entry (many query tiles and kv tiles, zig-zag work order)."""
    hq, hkv, d, dtype = 16, 2, 64, "float32"
    n = 301
    q, k, v = randn(n, hq, d), randn(n, hkv, d), randn(n, hkv, d)
    indptr = np.array([0, n], np.int32)
    zeros = np.zeros(1, np.int32)
    o = dev(np.full((n, hq, d), np.nan, dtype))
    lse = dev(np.full((n, hq), np.nan, np.float32))
    kernel("attn_prefill_ragged", tk.KernelSpec(hq, hkv, d, d, dtype))(
        dev(q), dev(k), dev(v), dev(indptr), dev(indptr), dev(np.arange(n, dtype=np.int32)), dev(zeros),
        o, lse, 1, 0, 1.0, 10000.0, 0.125)
    o_ref, lse_ref = attention_ref(q, k, v, True, 0.125)
    check_attention(o.numpy(), lse.numpy(), o_ref, lse_ref, dtype)


# ---------------------------------------------------------------------------------------------------
# split_rotary and merge_state
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("apply_rope", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 4, 64), (14, 2, 128), (3, 1, 96)], ids=lambda s: "x".join(map(str, s)))
def test_split_rotary(shape, dtype, apply_rope):
    hq, hkv, d = shape
    n = int(RNG.integers(1, 40))
    qkv = randn(n, hq + 2 * hkv, d, dtype=dtype)
    q_pos = RNG.integers(0, 250, n).astype(np.int32)
    rope_scale, rope_theta = rope_params()
    outs = [dev(np.full((n, h, d), np.nan, dtype), 7) for h in (hq, hkv, hkv)]
    kernel("split_rotary", tk.KernelSpec(hq, hkv, d, d, dtype))(
        dev(qkv, 3), dev(q_pos, 2), *outs, apply_rope, rope_scale, rope_theta)
    parts = [qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]]
    pos = torch.as_tensor(q_pos)
    for i, (out, part) in enumerate(zip(outs, parts)):
        ref = torch.as_tensor(part.astype(np.float64))
        if apply_rope and i < 2:
            ref = rope_ref(ref.transpose(0, 1), pos, rope_scale, rope_theta).transpose(0, 1)
            assert rel_err(out.numpy(), ref) < TOL[dtype]
        else:
            assert np.array_equal(out.numpy(), part)  # a plain copy is exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads_dv", [(8, 64), (3, 96), (16, 512)], ids=lambda s: "x".join(map(str, s)))
def test_merge_state(heads_dv, dtype):
    h, dv = heads_dv
    n = 23
    o_a, o_b = randn(n, h, dv, dtype=dtype), randn(n, h, dv, dtype=dtype)
    lse_a = (RNG.standard_normal((n, h)) * 8).astype(np.float32)
    lse_b = (RNG.standard_normal((n, h)) * 8).astype(np.float32)
    # empty states: only a, only b, both (rows 0, 1, 2)
    for row, (ea, eb) in enumerate([(True, False), (False, True), (True, True)]):
        if ea:
            o_a[row], lse_a[row] = 0, EMPTY_LSE
        if eb:
            o_b[row], lse_b[row] = 0, EMPTY_LSE
    ta, tla = dev(o_a, 4), dev(lse_a, 4)
    kernel("merge_state", tk.KernelSpec(h, h, dv, dv, dtype))(ta, tla, dev(o_b, 1), dev(lse_b, 2))
    oa64, ob64 = o_a.astype(np.float64), o_b.astype(np.float64)
    la64, lb64 = lse_a.astype(np.float64), lse_b.astype(np.float64)
    empty_a, empty_b = la64 <= EMPTY_LSE / 2, lb64 <= EMPTY_LSE / 2
    mx = np.maximum(la64, lb64)
    wa = np.where(empty_a, 0.0, np.exp2(la64 - mx))
    wb = np.where(empty_b, 0.0, np.exp2(lb64 - mx))
    both = empty_a & empty_b
    tot = np.where(both, 1.0, wa + wb)
    o_ref = (oa64 * wa[..., None] + ob64 * wb[..., None]) / tot[..., None]
    lse_ref = np.where(both, EMPTY_LSE, mx + np.log2(tot))
    o, lse = ta.numpy(), tla.numpy()
    assert rel_err(o, o_ref) < TOL[dtype]
    assert np.all(lse[both] == np.float32(EMPTY_LSE)) and np.all(o[both] == 0)
    assert rel_err(lse[~both], lse_ref[~both]) < TOL[dtype]


# ---------------------------------------------------------------------------------------------------
# page movement (exact copies; untouched slots must stay bit-identical, NaN included)
# ---------------------------------------------------------------------------------------------------
PAGE_SHAPES = [(2, 64), (1, 128)]


def page_pool(num_pages, hkv, d, ps, dtype, fill):
    pool = np.full((num_pages, 2, hkv, ps, d), np.nan, dtype)
    if fill:
        pool[:] = randn(*pool.shape, dtype=dtype)
    return pool



@pytest.mark.parametrize("ps", [16, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv_d", PAGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_append_and_gather_kv(hkv_d, dtype, ps):
    hkv, d = hkv_d
    cfg = tk.KernelSpec(hkv, hkv, d, d, dtype)
    pool = page_pool(7, hkv, d, ps, dtype, fill=False)
    n = int(RNG.integers(1, 7 * ps))
    slots = RNG.choice(7 * ps, n, replace=False).astype(np.int32)
    k, v = randn(n, hkv, d, dtype=dtype), randn(n, hkv, d, dtype=dtype)
    tpool = dev(pool)
    kernel("append_kv", cfg)(tpool, dev(k, 3), dev(v, 5), dev(slots, 1))
    expect = pool.copy()
    for i, s in enumerate(slots):
        expect[s // ps, 0, :, s % ps] = k[i]
        expect[s // ps, 1, :, s % ps] = v[i]
    assert np.array_equal(tpool.numpy(), expect, equal_nan=True)
    # gather them back in a different order, into NaN-filled views
    order = RNG.permutation(n)
    kg, vg = dev(np.full((n, hkv, d), np.nan, dtype), 2), dev(np.full((n, hkv, d), np.nan, dtype), 6)
    kernel("gather_kv", cfg)(tpool, dev(slots[order], 4), kg, vg)
    assert np.array_equal(kg.numpy(), k[order]) and np.array_equal(vg.numpy(), v[order])


@pytest.mark.parametrize("ps", [16, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv_d", PAGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_copy_page(hkv_d, dtype, ps):
    hkv, d = hkv_d
    pool = page_pool(5, hkv, d, ps, dtype, fill=True)
    pool[4] = np.nan
    src, dst, ntok = 1, 4, int(RNG.integers(1, ps))
    tpool = dev(pool)
    kernel("copy_page", tk.KernelSpec(hkv, hkv, d, d, dtype))(tpool, src, dst, ntok)
    expect = pool.copy()
    expect[dst, :, :, :ntok] = pool[src, :, :, :ntok]
    assert np.array_equal(tpool.numpy(), expect, equal_nan=True)


@pytest.mark.parametrize("ps", [16, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv_d", PAGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_compact_copy(hkv_d, dtype, ps):
    hkv, d = hkv_d
    pool = page_pool(6, hkv, d, ps, dtype, fill=True)
    n = int(RNG.integers(1, 3 * ps))
    chosen = RNG.choice(6 * ps, 2 * n, replace=False).astype(np.int32)
    src, dst = chosen[:n], chosen[n:]  # disjoint, as the runtime guarantees
    tpool = dev(pool)
    kernel("compact_copy", tk.KernelSpec(hkv, hkv, d, d, dtype))(tpool, dev(src, 3), dev(dst, 1))
    expect = pool.copy()
    for s, t in zip(src, dst):
        expect[t // ps, :, :, t % ps] = pool[s // ps, :, :, s % ps]
    assert np.array_equal(tpool.numpy(), expect, equal_nan=True)


def _pair_shape(pairs, dtype):
    """The first (Hq, Hkv, D) an op's covering pairs compile in ``dtype`` (its kernel is built already)."""
    return next(shape[:3] for shape, dt in pairs if dt == dtype and (len(shape) == 3 or shape[3] == shape[2]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attn_tiny_calls(dtype):
    """Calls small enough to run on the calling thread (no thread pool): all three attention kernels, each on a
    shape its covering pairs compile in this dtype (no kernels of their own)."""
    ps, sm_scale = 16, 0.125
    # decode: two sequences of 3 and 0 keys
    hq, hkv, d = _pair_shape(DECODE_PAIRS, dtype)
    kv = PagedKV([3, 0], hkv, d, ps, dtype)
    q = randn(2, hq, d, dtype=dtype)
    zeros2 = np.zeros(2, np.int32)
    o, lse = dev(np.full((2, hq, d), np.nan, dtype)), dev(np.full((2, hq), np.nan, np.float32))
    kernel("attn_decode_paged", tk.KernelSpec(hq, hkv, d, d, dtype))(
        dev(q), dev(kv.pages), dev(kv.page_indptr), dev(kv.page_values), dev(kv.last_page_len), dev(zeros2),
        dev(zeros2), o, lse, 0, 1.0, 1e4, sm_scale)
    refs = [attention_ref(q[b:b + 1], kv.k[b], kv.v[b], False, sm_scale) for b in range(2)]
    check_attention(o.numpy(), lse.numpy(), np.concatenate([r[0] for r in refs]),
                    np.concatenate([r[1] for r in refs]), dtype)
    # prefill: one entry, 2 queries over 2 new keys (ragged) / 3 cached keys (paged)
    indptr, zero1, pos = np.array([0, 2], np.int32), np.zeros(1, np.int32), np.array([3, 4], np.int32)
    for op, pairs in (("attn_prefill_ragged", RAGGED_PAIRS), ("attn_prefill_paged", PAGED_PAIRS)):
        hq, hkv, d = _pair_shape(pairs, dtype)
        cfg = tk.KernelSpec(hq, hkv, d, d, dtype)
        q = randn(2, hq, d, dtype=dtype)
        o, lse = dev(np.full((2, hq, d), np.nan, dtype)), dev(np.full((2, hq), np.nan, np.float32))
        if op == "attn_prefill_ragged":
            k, v = randn(2, hkv, d, dtype=dtype), randn(2, hkv, d, dtype=dtype)
            kernel(op, cfg)(dev(q), dev(k), dev(v), dev(indptr), dev(indptr), dev(pos), dev(zero1), o, lse,
                            1, 0, 1.0, 1e4, sm_scale)
            o_ref, lse_ref = attention_ref(q, k, v, True, sm_scale)
        else:
            kv = PagedKV([3], hkv, d, ps, dtype)
            kernel(op, cfg)(dev(q), dev(indptr), dev(kv.pages), dev(kv.page_indptr), dev(kv.page_values),
                            dev(kv.last_page_len), dev(zero1), dev(pos), o, lse, 1, 0, 1.0, 1e4, sm_scale)
            o_ref, lse_ref = attention_ref(q, kv.k[0], kv.v[0], True, sm_scale)
        check_attention(o.numpy(), lse.numpy(), o_ref, lse_ref, dtype)
