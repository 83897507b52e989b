"""The scenario suite: every registered backend that accepts a shape on ``llvm``, every scenario of
``pagedkv.testing.scenarios``, against the PyTorch reference (``pagedkv.testing.reference``).

Shape matrix (``pagedkv.testing.shapes``; each config compiled once and reused by every scenario): GQA group
sizes 1, 3, 4, 7, head dims 64 / 128, float32 / float16, page sizes 16 / 8 and RoPE modes none / normal /
inline each appear at least twice, bfloat16 on two MHA shapes and one MLA shape (relative error under 1e-2,
as fp16: measured up to ~4e-3, about 8x fp16's, bf16 keeping 3 mantissa bits fewer), and every scenario
crosses page boundaries for both page sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import backend_choice, cpu_backends
from pagedkv import KVCacheConfig, ops
from pagedkv.testing import reference as R
from pagedkv.testing.scenarios import (SCENARIOS, ScenarioRunner, add, check, fork, forward,
                                       random_sm_scale)
from pagedkv.testing.shapes import CPU_SCENARIO_SHAPES, MLA_SHAPES  # shared with the GPU suite and the bundle


def _backend_shape_params(shapes=CPU_SCENARIO_SHAPES):
    out = []
    for shape in shapes:
        for tag in cpu_backends(shape.config()):
            out.append(pytest.param(tag, shape, id=f"{tag}-{shape.id}"))
    return out


BACKEND_SHAPES = _backend_shape_params()
MLA_BACKEND_SHAPES = _backend_shape_params(MLA_SHAPES)



@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("backend,shape", BACKEND_SHAPES + MLA_BACKEND_SHAPES)
def test_scenario(backend, shape, scenario, make_cache, gen):
    cfg = shape.config()
    cache = make_cache(cfg, backend)
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    runner.run(SCENARIOS[scenario](shape.ps), scenario)


RANDOM_SHAPES = [p for p in BACKEND_SHAPES if p.values[1].id in
                 ("h8x2-d64-f32-p8-inline-t500000s1", "h6x2-d64-f16-p8-normal", "h4x4-d64-f32-p16-none",
                  "h3x1-d64-f16-p8-inline-w20-cap2.5")]
RANDOM_SHAPES += MLA_BACKEND_SHAPES[:1]


@pytest.mark.parametrize("backend,shape", RANDOM_SHAPES)
def test_random_scenario(backend, shape, make_cache, gen, seed):
    """80 random valid steps (the seed picks them), checked like the written scenarios."""
    import random

    from pagedkv.testing.scenarios import random_step

    cache = make_cache(shape.config(), backend)
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    rng = random.Random(seed)
    steps = []
    for _ in range(80):
        steps.append(random_step(runner.ref, rng))
        runner.run([steps[-1]], f"random step {len(steps) - 1} (steps so far: {steps})")
    runner.run([check()], "random end")


def _fine_grained_steps(P: int):
    return [
        add(0), add(1), add(2),
        forward({0: P + 3, 1: 1, 2: 5}),     # prefill from empty sequences: cross attention sees nothing
        fork(0, 3, P + 1),
        forward({0: 2, 3: 3, 1: 2}),         # prefill over cached tokens, 0 and 3 share a page
        forward({0: 1, 3: 1, 1: 1, 2: 1}),   # decode: cross attention includes the new token
        forward({2: P, 3: 1}),
        check(),
    ]


@pytest.mark.parametrize("backend,shape", BACKEND_SHAPES)
def test_fine_grained_path(backend, shape, make_cache, gen):
    """self_attention + cross_attention (+ merge_attn_output_inplace in prefill) == the fused result."""
    cache = make_cache(shape.config(), backend)
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d), fine_grained=True)
    runner.run(_fine_grained_steps(shape.ps), "fine_grained")


@pytest.mark.parametrize("backend,shape", BACKEND_SHAPES[:2])
def test_query_positions(backend, shape, make_cache):
    """get_query_positions: sequence length before the forward + index, in batch order (hand-computed)."""
    cache = make_cache(shape.config(), backend)
    P = shape.ps
    width = shape.hq + 2 * shape.hkv

    def run(batch, expected):
        cache.begin_forward(list(batch), list(batch.values()))
        assert cache.get_query_positions().tolist() == expected
        for layer in range(2):
            cache.attention_with_fused_qkv(layer, torch.randn(sum(batch.values()), width, shape.d)
                                           .to(getattr(torch, shape.dtype)), 0.1)
        cache.end_forward()

    cache.add_sequence(0)
    cache.add_sequence(1)
    run({0: 3, 1: 2}, [0, 1, 2, 0, 1])
    run({1: 2, 0: 1}, [2, 3, 3])
    cache.fork_sequence(0, 5, 2)
    run({5: 3, 0: 1}, [2, 3, 4, 4])
    cache.popn(5, 4)
    run({5: 1, 1: 1}, [1, 4])
    run({1: P}, list(range(5, 5 + P)))


@pytest.mark.parametrize("backend,shape", BACKEND_SHAPES[:3])
def test_debug_set_kv(backend, shape, make_cache, gen):
    """debug_set_kv overwrites stored k/v (read back by debug_get_kv and used by the next forward)."""
    cfg = shape.config()
    cache = make_cache(cfg, backend)
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    P = shape.ps
    runner.run([add(0), add(1), forward({0: 2 * P + 3, 1: 4})], "setup")
    k = runner.randn(2, P, shape.hkv, shape.d)
    v = runner.randn(2, P, shape.hkv, shape.d)
    cache.debug_set_kv(0, 2, k, v)  # tokens [2, P + 2): across a page boundary
    runner.ref.debug_set_kv(0, 2, k.cpu(), v.cpu())
    got_k, got_v = cache.debug_get_kv(0, 2, P + 2)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    runner.run([check(), forward({0: 1, 1: 1}), forward({1: 2, 0: 3}), check()], "after set")


@pytest.mark.parametrize("backend,shape", MLA_BACKEND_SHAPES[:2])
def test_mla_debug_set_kv(backend, shape, make_cache, gen):
    """debug_set_mla_kv overwrites stored latents (read back and used by the next forwards)."""
    cache = make_cache(shape.config(), backend)
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, shape.d))
    P = shape.ps
    runner.run([add(0), add(1), forward({0: 2 * P + 3, 1: 4}), fork(0, 2, P + 1)], "setup")
    kv = runner.randn(2, P, shape.r + shape.rope)
    cache.debug_set_mla_kv(0, 2, kv)  # tokens [2, P + 2): across a page boundary, partly shared with 2
    runner.ref.debug_set_kv(0, 2, kv.cpu()[:, :, None, :], kv.cpu()[:, :, None, :shape.r])
    assert torch.equal(cache.debug_get_mla_kv(0, 2, P + 2), kv)
    runner.run([check(), forward({0: 1, 1: 1, 2: 1}), forward({1: 2, 0: 3}), check()], "after set")


@pytest.mark.parametrize("backend,shape", BACKEND_SHAPES + MLA_BACKEND_SHAPES)
def test_op_backends(backend, shape, make_cache):
    """Every op is served, by the backend under test wherever it accepts the config."""
    from pagedkv import backends

    cfg = shape.config()
    cache = make_cache(cfg, backend)
    table = cache.op_backends
    assert set(table) == set(ops.ops_for(cfg))
    b = backends.get_backend(backend)
    for op in ops.ops_for(cfg):
        expected = backend if not b.validate_configuration(op, cfg, "llvm") else "tir"
        assert table[op] == expected, f"{op}: {table[op]} != {expected} ({backend_choice(backend)})"


# ---------------------------------------------------------------------------------------------------------
# the reference itself (textbook identities and hand-computed values; no runtime involved)
# ---------------------------------------------------------------------------------------------------------
def test_reference_attention_matches_sdpa():
    q = torch.randn(6, 8, 32, dtype=torch.float64)
    k = torch.randn(11, 2, 32, dtype=torch.float64)
    v = torch.randn(11, 2, 32, dtype=torch.float64)
    for causal in (False, True):
        o, lse = R.attention(q, k, v, 0.2, causal)
        mask = torch.ones(6, 11, dtype=torch.bool)
        if causal:
            mask = mask.tril(diagonal=11 - 6)  # bottom-right aligned
        kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        expect = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask, scale=0.2).transpose(0, 1)
        assert torch.allclose(o, expect, atol=1e-12)
        s = torch.einsum("nhd,mhd->hnm", q, kk) * 0.2
        s = s.masked_fill(~mask, -math.inf)
        assert torch.allclose(lse, (torch.logsumexp(s, -1) / math.log(2)).T, atol=1e-12)


def test_reference_attention_empty_rows():
    q = torch.randn(3, 2, 8, dtype=torch.float64)
    o, lse = R.attention(q, torch.zeros(0, 1, 8), torch.zeros(0, 1, 8), 1.0, False)
    assert torch.all(o == 0) and torch.all(lse == R.EMPTY_LSE)
    # causal with fewer keys than queries: the first query sees nothing
    o, lse = R.attention(q, torch.randn(2, 1, 8), torch.randn(2, 1, 8), 1.0, True)
    assert torch.all(o[0] == 0) and torch.all(lse[0] == R.EMPTY_LSE) and torch.all(lse[1:] > -100)


def test_reference_merge_states():
    q = torch.randn(4, 4, 16, dtype=torch.float64)
    k = torch.randn(9, 2, 16, dtype=torch.float64)
    v = torch.randn(9, 2, 16, dtype=torch.float64)
    full = R.attention(q, k, v, 0.3, False)
    a = R.attention(q, k[:5], v[:5], 0.3, False)
    b = R.attention(q, k[5:], v[5:], 0.3, False)
    empty = R.attention(q, k[:0], v[:0], 0.3, False)
    for x, y in [(a, b), (b, a)]:
        o, lse = R.merge_states(*x, *y)
        assert torch.allclose(o, full[0], atol=1e-12) and torch.allclose(lse, full[1], atol=1e-12)
    o, lse = R.merge_states(*empty, *full)
    assert torch.allclose(o, full[0]) and torch.allclose(lse, full[1])
    o, lse = R.merge_states(*empty, *empty)
    assert torch.all(o == 0) and torch.all(lse == R.EMPTY_LSE)


def test_reference_rope():
    # hand-computed: D = 4, x = e0, position 2, theta 100, scale 0.5 -> angles 1 and 0.1
    x = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    got = R.rope(x, [2], 100.0, 0.5)
    expect = torch.tensor([[[math.cos(1.0), 0.0, math.sin(1.0), 0.0]]], dtype=torch.float64)
    assert torch.allclose(got, expect, atol=1e-15)
    y = torch.tensor([[[0.0, 0.0, 0.0, 1.0]]], dtype=torch.float64)  # x[i + D/2] rotates with -sin
    assert torch.allclose(R.rope(y, [2], 100.0, 0.5),
                          torch.tensor([[[0.0, -math.sin(0.1), 0.0, math.cos(0.1)]]], dtype=torch.float64))
    q, k = torch.randn(1, 1, 64, dtype=torch.float64), torch.randn(1, 1, 64, dtype=torch.float64)
    assert torch.equal(R.rope(q, [0], 1e4, 1.0), q)
    dot = lambda p, r: (R.rope(q, [p], 1e4, 1.0) * R.rope(k, [r], 1e4, 1.0)).sum()  # noqa: E731
    assert torch.allclose(dot(9, 4), dot(25, 20), atol=1e-12)  # depends on the position difference only


def test_reference_page_accounting():
    """Hand-counted pages of the documented fork / popn / remove rules (page size 4, pool of 12)."""
    cfg = KVCacheConfig(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=4, dtype="float32",
                        page_size=4, max_batch_size=4, max_total_seq_len=32, prefill_chunk_size=32)
    ref = R.ReferenceCache(cfg)
    assert ref.num_available_pages == 8 + 4

    def append(seq, n):
        ref.begin_forward([seq], [n])
        ref.attention_with_fused_qkv(0, torch.randn(n, 3, 4), 1.0)
        ref.end_forward()

    ref.add_sequence(0)
    append(0, 10)                   # 3 pages
    assert ref.num_available_pages == 9
    ref.fork_sequence(0, 1, 8)      # boundary: shares 2 pages, copies nothing
    assert ref.num_available_pages == 9
    ref.fork_sequence(0, 2, 6)      # mid-page: shares 1 page, copies 2 tokens into a new page
    assert ref.num_available_pages == 8
    append(1, 1)                    # 1's own page
    assert ref.num_available_pages == 7
    append(2, 2)                    # fits in 2's copied page (2 + 2 tokens)
    assert ref.num_available_pages == 7
    ref.popn(0, 2)                  # 0 keeps [0, 8) shared: frees its last page
    assert ref.num_available_pages == 8 and ref.get_sequence_length(0) == 8
    ref.popn(1, 3)                  # into the shared prefix, mid-page: re-rooted at 6 with a copied page
    assert ref.num_available_pages == 8 and ref.get_sequence_length(1) == 6
    ref.remove_sequence(0)          # frees page [4, 8): only 0 still used it (1 shares [0, 4))
    assert ref.num_available_pages == 9
    ref.remove_sequence(1)
    ref.remove_sequence(2)
    assert ref.num_available_pages == 12
    with pytest.raises(R.ReferenceCacheError):
        ref.popn(7, 1)
