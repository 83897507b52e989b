"""The MLA TIR kernels on the CPU against the float64 PyTorch reference.

Shapes: DeepSeek-V2-Lite's (16 heads, kv_lora_rank 512, rope 64) and two small ones (3 and 4 heads,
latent 64 + 32). Same rules as ``test_kernels.py`` (whose helpers this reuses): fresh random inputs,
NaN-filled outputs and spare page slots, relative-error bounds 1e-5 (fp32) / 1e-2 (fp16, bf16). The
reference is MHA attention with one kv head whose K is the latent and V its first ``kv_lora_rank``
elements, which is what absorbed MLA computes.

Run: ``.venv/bin/python -m pytest tests/cpu/test_mla_kernels.py -q``
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import test_kernels as K
from test_kernels import _fresh_rng, attention_ref, check_attention, dev, kernel, randn, tk, view_offset  # noqa: F401

# (H, kv_lora_rank, qk_rope_head_dim)
MLA_SHAPES = [(16, 512, 64), (3, 64, 32), (4, 64, 32)]
DTYPES = ["float32", "float16", "bfloat16"]


def mla_cfg(h, r, rope, dtype):
    """The kernel config of an MLA layer (self-attention dims: nope 64 + rope, v 64)."""
    return tk.KernelSpec(h, h, 64 + rope, 64, dtype, kv_lora_rank=r, qk_rope_head_dim=rope)


class LatentPages:
    """A random latent pool ``[P, 1, 1, ps, DL]`` holding ``lens[b]`` tokens per entry on shuffled pages."""

    def __init__(self, lens, dl, ps, dtype):
        npages = [-(-n // ps) for n in lens]
        pool = sum(npages) + 3  # spare pages stay NaN
        self.pages = np.full((pool, 1, 1, ps, dl), np.nan, dtype=dtype)
        order = K.RNG.permutation(pool).astype(np.int32)
        self.page_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
        self.page_values = order[: sum(npages)].copy()
        self.last_page_len = np.array([n - (p - 1) * ps if p else 0 for n, p in zip(lens, npages)], np.int32)
        self.kv = []
        for b, n in enumerate(lens):
            kv = randn(n, dl, dtype=dtype)
            for j in range(n):
                self.pages[self.page_values[self.page_indptr[b] + j // ps], 0, 0, j % ps] = kv[j]
            self.kv.append(kv)

    def ref(self, b, q, causal, sm_scale, r):
        """Reference (o, lse) of entry ``b`` for queries ``q[qlen, H, DL]``."""
        k = self.kv[b][:, None, :]
        return attention_ref(q, k, k[..., :r], causal, sm_scale)


def _sm_scale(rope):
    # The model's scale (1/sqrt(nope + rope) of the original heads), randomized so an ignored argument fails.
    return float(K.RNG.uniform(0.5, 1.5) / math.sqrt(128 + rope))


def run_mla_decode(shape, dtype, ps, lens, paths=()):
    """``mla_attn_decode_paged`` over sequences of ``lens`` latents vs the reference; ``paths``: forced code
    paths (KernelSpec.paths)."""
    h, r, rope = shape
    dl = r + rope
    kv = LatentPages(lens, dl, ps, dtype)
    nb = len(lens)
    q = randn(nb, h, dl, dtype=dtype)
    sm_scale = _sm_scale(rope)
    off = view_offset(ps)
    o = dev(np.full((nb, h, r), np.nan, dtype), off)
    lse = dev(np.full((nb, h), np.nan, np.float32), off)
    cfg = dataclasses.replace(mla_cfg(h, r, rope, dtype), paths=paths)
    kernel("mla_attn_decode_paged", cfg)(
        dev(q, off), dev(kv.pages), dev(kv.page_indptr, off), dev(kv.page_values, off),
        dev(kv.last_page_len, off), o, lse, sm_scale)
    refs = [kv.ref(b, q[b:b + 1], False, sm_scale, r) for b in range(nb)]
    check_attention(o.numpy(), lse.numpy(), np.concatenate([x[0] for x in refs]),
                    np.concatenate([x[1] for x in refs]), dtype)


def run_mla_prefill(shape, dtype, ps, causal, entries, paths=()):
    """``mla_attn_prefill_paged`` over ``entries`` ((qlen, kvlen) each) vs the reference."""
    h, r, rope = shape
    dl = r + rope
    kv = LatentPages([kl for _, kl in entries], dl, ps, dtype)
    q_indptr = np.concatenate([[0], np.cumsum([ql for ql, _ in entries])]).astype(np.int32)
    n = int(q_indptr[-1])
    q = randn(n, h, dl, dtype=dtype)
    sm_scale = _sm_scale(rope)
    off = view_offset(ps)
    o = dev(np.full((n, h, r), np.nan, dtype), off)
    lse = dev(np.full((n, h), np.nan, np.float32), off)
    cfg = dataclasses.replace(mla_cfg(h, r, rope, dtype), paths=paths)
    kernel("mla_attn_prefill_paged", cfg)(
        dev(q, off), dev(q_indptr, off), dev(kv.pages), dev(kv.page_indptr, off), dev(kv.page_values, off),
        dev(kv.last_page_len, off), o, lse, causal, sm_scale)
    refs = [kv.ref(b, q[q_indptr[b]:q_indptr[b + 1]], causal, sm_scale, r) for b in range(len(entries))]
    check_attention(o.numpy(), lse.numpy(), np.concatenate([x[0] for x in refs]),
                    np.concatenate([x[1] for x in refs]), dtype)


@pytest.mark.parametrize("ps", [16, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MLA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mla_attn_decode_paged(shape, dtype, ps):
    run_mla_decode(shape, dtype, ps, [0, 1, ps, 3 * ps + 5, 9 * ps + 1, int(K.RNG.integers(1, 4 * ps))])


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("ps", [16, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MLA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mla_attn_prefill_paged(shape, dtype, ps, causal):
    entries = [(3, 0), (1, 1), (5, 2), (0, 7), (ps + 3, 3 * ps + 5), (19, 40),
               (int(K.RNG.integers(1, 12)), int(K.RNG.integers(1, 5 * ps)))]
    run_mla_prefill(shape, dtype, ps, causal, entries)


#: (H, kv_lora_rank, qk_rope_head_dim, dtype) of the path tests: V2-Lite's 16 heads (one head chunk) and
#: 64 heads in 4 chunks of 16 (4 work items per sequence: 20 sequences give more items than the 64
#: parallel chunks, so chunks run several items).
MLA_PATH_CASES = [((16, 512, 64), "float16"), ((64, 64, 32), "float32")]
#: 20 decode lengths and 18 prefill entries, long and short mixed, long first (reversed: short first).
MLA_DECODE_LENS = [150, 3, 67, 28, 0, 1, 90, 16, 33, 5, 200, 12, 64, 41, 7, 130, 2, 48, 100, 9]
MLA_PREFILL_ENTRIES = [(40, 150), (1, 1), (3, 0), (5, 70), (0, 7), (17, 17), (33, 90), (2, 40), (9, 9),
                       (1, 130), (25, 25), (6, 64), (12, 200), (4, 4), (31, 31), (1, 16), (20, 45), (7, 100)]


@pytest.mark.parametrize("reverse", [False, True], ids=["long-first", "short-first"])
@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("case", MLA_PATH_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}")
def test_mla_attn_paths(case, threads, reverse):
    """Decode and prefill on each forced thread path (``cpu_threads``); long first: page size 16, causal;
    short first: page size 8 (buffers as views), non-causal."""
    shape, dtype = case
    paths = {"cpu_threads": threads}
    ps = 8 if reverse else 16
    run_mla_decode(shape, dtype, ps, MLA_DECODE_LENS[::-1] if reverse else MLA_DECODE_LENS, paths)
    run_mla_prefill(shape, dtype, ps, int(not reverse),
                    MLA_PREFILL_ENTRIES[::-1] if reverse else MLA_PREFILL_ENTRIES, paths)


@pytest.mark.parametrize("ps", [16, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_append_gather_and_copy(dtype, ps):
    """Latent page moves are exact; untouched slots (NaN included) stay bit-identical."""
    h, r, rope = MLA_SHAPES[0]
    dl = r + rope
    cfg = mla_cfg(h, r, rope, dtype)
    pool = np.full((5, 1, 1, ps, dl), np.nan, dtype)
    slots = K.RNG.permutation(5 * ps)[:2 * ps + 3].astype(np.int32)
    slots[4] = -1  # skipped
    kv = randn(len(slots), dl, dtype=dtype)
    tpool = dev(pool)
    kernel("mla_append_kv", cfg)(tpool, dev(kv, 3), dev(slots, 1))
    expect = pool.copy()
    for s, row in zip(slots, kv):
        if s >= 0:
            expect[s // ps, 0, 0, s % ps] = row
    assert np.array_equal(tpool.numpy(), expect, equal_nan=True)
    keep = slots[slots >= 0]
    out = dev(np.full((len(keep), dl), np.nan, dtype), 2)
    kernel("mla_gather_kv", cfg)(tpool, dev(keep), out)
    assert np.array_equal(out.numpy(), kv[slots >= 0])
    src, dst, ntok = int(slots[0] // ps), int(slots[1] // ps), int(K.RNG.integers(1, ps))
    if src != dst:
        kernel("copy_page", cfg)(tpool, src, dst, ntok)
        expect[dst, :, :, :ntok] = expect[src, :, :, :ntok]
        assert np.array_equal(tpool.numpy(), expect, equal_nan=True)
