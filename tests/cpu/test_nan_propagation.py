"""NaN inputs give NaN outputs on the CPU TIR backend (issue 44; the semantics: ``pagedkv.testing.nan_rows``).

Before the fix a NaN query row came out as a finite row (the CPU kernels' exp2 turned a NaN score into 0, and the
stores took a NaN row sum for "no keys": o = 0, lse = -1e30), and a NaN v made every row of its key tile NaN, the
rows that do not see the key included (``0 * NaN`` in P V). Here, through the cache's entry points on NaN-poisoned
caches (every page slot not holding a key is NaN): a NaN q row, a NaN k or v of one token (the causal rows before
it and the rows whose sliding window excludes it stay finite and correct), NaN in popped slots, an all-NaN forward,
a prefix-shared forward (passes merged: the plain merge at float32, the partial-state ops at float16), and MLA
(cross attention over a forked sequence, self attention, the model's merge of the two, a NaN state with the
empty one). Rows without NaN are compared with the float64 reference. Configs are the scenario suite's
(``pagedkv.testing.shapes``: their kernels are built by it anyway).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.testing import nan_rows
from pagedkv.testing.reference import merge_states
from pagedkv.testing.reference_mla import reference_for
from pagedkv.testing.scenarios import assert_close
from pagedkv.testing.shapes import MLA_SHAPES, SHAPES

SM_SCALE = 0.15
NAN = float("nan")


def _config(shape_id):
    return next(s for s in SHAPES + MLA_SHAPES if s.id == shape_id).config()


F32, F16, WINDOW = "h4x4-d64-f32-p16-none", "h6x2-d64-f16-p8-normal", "h4x1-d64-f32-p8-normal-w13"
MLA = "mla-h4-r64-rope32-nope64-v64-f16-p16"


class Run:
    """A cache and references fed the same forwards: ``ref`` the same inputs, ``more`` variants of them (a NaN v
    test's value-zeroed and NaN-k copies), each from a function of the inputs."""

    def __init__(self, cache, gen, **variants):
        self.cache, self.gen, self.cfg = cache, gen, cache.config
        self.refs = {"ref": (reference_for(self.cfg), None)}
        self.refs.update({name: (reference_for(self.cfg), f) for name, f in variants.items()})

    def caches(self):
        return [self.cache] + [r for r, _f in self.refs.values()]

    def qkv(self, n):
        c = self.cfg
        shape = (c.num_layers, n, c.num_qo_heads + 2 * c.num_kv_heads, c.head_dim)
        return torch.randn(*shape, generator=self.gen).to(getattr(torch, c.dtype))

    def call(self, method, *args):
        for c in self.caches():
            getattr(c, method)(*args)

    def forward(self, batch: dict, x: torch.Tensor) -> dict:
        """One forward of ``batch`` ({sequence: new tokens}) with inputs ``x[L, n, ...]``; layer 0's o per name
        ("cache", "ref", the variants), float64."""
        self.call("begin_forward", list(batch), list(batch.values()))
        out = {}
        for layer in range(self.cfg.num_layers):
            out_l = {"cache": self.cache.attention_with_fused_qkv(layer, x[layer].clone(), SM_SCALE)}
            for name, (ref, f) in self.refs.items():
                xr = x if f is None else f(x.clone())
                out_l[name] = ref.attention_with_fused_qkv(layer, xr[layer].clone(), SM_SCALE)
            out = out or {k: v.double() for k, v in out_l.items()}
        self.call("end_forward")
        return out

    def check(self, out, what, expect=None, whole=True):
        """The NaN rows of ``out["cache"]`` (``nan_rows.check``), the others against ``out["ref"]``."""
        keep = nan_rows.check(out["cache"], None, out["ref"], what, expect=expect, whole=whole)
        assert keep.any(), f"{what}: no row to compare"
        ref = out.get("vals", out["ref"])
        assert_close(out["cache"][keep], ref[keep], self.cfg.dtype, what)
        return keep


def _qkv_index(cfg, what, head):
    """Index into dim 2 of a fused qkv of q head ``head``, or k / v of kv head ``head``."""
    return {"q": head, "k": cfg.num_qo_heads + head, "v": cfg.num_qo_heads + cfg.num_kv_heads + head}[what]


def _poison(x, cfg, what, token, head):
    x[:, token, _qkv_index(cfg, what, head), 5] = NAN
    return x


@pytest.mark.parametrize("shape_id", [F32, F16])
def test_nan_q_row_gives_that_row_only(shape_id, make_cache, gen):
    """A NaN in one q row: that (token, head) row of o is NaN in a fresh prefill (ragged), a continuation (paged
    prefill) and a decode; every other row matches the reference. The sequences' unused slots are NaN: fresh
    pages (the cache is poisoned) and slots written with NaN k / v and then popped (past the length, in the last
    page, and never overwritten by the next forwards' 5 tokens)."""
    cfg = _config(shape_id)
    run = Run(make_cache(cfg), gen)
    run.call("add_sequence", 0)
    run.call("add_sequence", 1)
    x = _poison(run.qkv(29), cfg, "q", 17, 1)
    out = run.forward({0: 20, 1: 9}, x)
    run.check(out, "fresh prefill", expect=_rows(out, (17, 1)))
    # NaN k / v in tokens 9 .. 12 of sequence 1, then popped: unused slots holding NaN.
    nan_kv = torch.full((cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim), NAN).to(getattr(torch, cfg.dtype))
    run.cache.debug_set_kv(1, 5, nan_kv, nan_kv)
    for c in run.caches():
        c.popn(1, 4)
    out = run.forward({0: 3, 1: 2}, _poison(run.qkv(5), cfg, "q", 4, 0))
    run.check(out, "continuation", expect=_rows(out, (4, 0)))
    out = run.forward({0: 1, 1: 1}, _poison(run.qkv(2), cfg, "q", 0, cfg.num_qo_heads - 1))
    run.check(out, "decode", expect=_rows(out, (0, cfg.num_qo_heads - 1)))


def _rows(out, *rows):
    expect = torch.zeros(out["ref"].shape[:2], dtype=torch.bool)
    for r in rows:
        expect[r] = True
    return expect


def _group_rows(cfg, n, tokens, kv_head):
    """[n, Hq] mask: rows of ``tokens`` in the query heads of ``kv_head``."""
    g = cfg.num_qo_heads // cfg.num_kv_heads
    expect = torch.zeros((n, cfg.num_qo_heads), dtype=torch.bool)
    expect[list(tokens), kv_head * g:(kv_head + 1) * g] = True
    return expect


@pytest.mark.parametrize("what", ["k", "v"])
@pytest.mark.parametrize("shape_id", [F32, WINDOW])
def test_nan_key_reaches_only_rows_that_see_it(shape_id, what, make_cache, gen):
    """A NaN in the k (or v) of token 12 of a 30-token prefill: the rows of its kv head's queries that see it are
    NaN (k: whole row; v: at least where v is), the causal rows before it (and, with the window of 13, the rows
    past it) match the reference, in the prefill (its causal tile holds rows on both sides), a continuation
    (paged prefill) and a decode. The v reference: the inputs with that v zeroed (``vals``; unseen, any value
    serves), the seen rows those of the same NaN in k (``mask``)."""
    cfg = _config(shape_id)
    kv_head = cfg.num_kv_heads - 1
    variants = {} if what == "k" else {
        "vals": lambda x: x.nan_to_num_(0.0),
        "mask": lambda x: _poison(x.nan_to_num_(0.0), cfg, "k", 12, kv_head) if x.shape[1] == 30 else x}
    run = Run(make_cache(cfg), gen, **variants)
    run.call("add_sequence", 0)
    window = cfg.sliding_window or 10**6
    for step, (n, x) in enumerate([(30, _poison(run.qkv(30), cfg, what, 12, kv_head)), (4, run.qkv(4)),
                                   (1, run.qkv(1))]):
        out = run.forward({0: n}, x)
        first = 0 if step == 0 else (30, 34)[step - 1]  # the position of the forward's first token
        seen = [t for t in range(n) if 12 <= first + t < 12 + window]
        expect = _group_rows(cfg, n, seen, kv_head)
        assert torch.equal(nan_rows.attending(out["mask" if what == "v" else "ref"]), expect)  # the test's rows
        run.check(out, f"{what} step {step}", expect=expect, whole=what == "k")


@pytest.mark.parametrize("shape_id", [F32, F16])
def test_all_nan_forward_gives_all_nan(shape_id, make_cache, gen):
    """An all-NaN prefill: every row of its sequence NaN (before: NaN rows and a row of zeros); the next decode
    with finite inputs sees its NaN keys: NaN; the other sequence of both forwards matches the reference."""
    cfg = _config(shape_id)
    run = Run(make_cache(cfg), gen)
    run.call("add_sequence", 0)
    run.call("add_sequence", 1)
    x = run.qkv(20)
    x[:, :12] = NAN
    out = run.forward({0: 12, 1: 8}, x)
    run.check(out, "all-NaN prefill", expect=_all_heads(cfg, 20, range(12)))
    out = run.forward({0: 1, 1: 1}, run.qkv(2))
    run.check(out, "decode after it", expect=_all_heads(cfg, 2, [0]))


def _all_heads(cfg, n, tokens):
    expect = torch.zeros((n, cfg.num_qo_heads), dtype=torch.bool)
    expect[list(tokens)] = True
    return expect


@pytest.mark.parametrize("shape_id", [F32, F16])
def test_nan_through_prefix_shared_forward(shape_id, make_cache, gen):
    """Sequences 1 and 2 fork sequence 0 (16 tokens, a NaN k in token 3): a decode and a continuation of 0, 1, 2
    and an unrelated sequence 3 merge a shared-prefix pass with the own pass (float32: ``merge_state``; float16:
    the partial-state ops): every row of 0, 1, 2 of that kv head's queries NaN, sequence 3's rows but a NaN q row
    match the reference."""
    cfg = _config(shape_id)
    run = Run(make_cache(cfg), gen)
    for sid in (0, 3):
        run.call("add_sequence", sid)
    run.forward({0: 16, 3: 5}, _poison(run.qkv(21), cfg, "k", 3, 0))
    for child in (1, 2):
        run.call("fork_sequence", 0, child)
    for n in (1, 3):
        x = _poison(run.qkv(4 * n), cfg, "q", 3 * n, 1)  # sequence 3's first new token
        out = run.forward({0: n, 1: n, 2: n, 3: n}, x)
        expect = _group_rows(cfg, 4 * n, range(3 * n), 0)
        expect[3 * n, 1] = True
        run.check(out, f"shared forward of {n}", expect=expect)


def test_mla_nan_rows_through_cross_self_and_merge(make_cache, gen):
    """MLA: a NaN latent (in v's dims) of sequence 0, which sequence 1 forks: a decode's cross attention (the shared
    pass and the own pass merged) gives NaN rows for 0 and 1 (o and lse), a NaN q row of sequence 2 its row;
    self attention is the empty state there, and merged with it (the model's merge) the NaN rows stay NaN. A
    prefill's self attention with a NaN q row: that row NaN, merged with the empty cross state (a fresh
    sequence) too. Other rows match the reference."""
    cfg = _config(MLA)
    cache, ref = make_cache(cfg), reference_for(cfg)
    h, dt = cfg.num_qo_heads, getattr(torch, cfg.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dt)

    def both(method, *args):
        return getattr(cache, method)(*args), getattr(ref, method)(*args)

    both("add_sequence", 0)
    both("add_sequence", 2)
    both("begin_forward", [0, 2], [16, 4])
    for layer in range(cfg.num_layers):
        kv = randn(20, cfg.latent_dim)
        kv[5, 7] = NAN
        both("append_mla_kv", layer, kv)
    both("end_forward")
    both("fork_sequence", 0, 1)
    both("begin_forward", [0, 1, 2], [1, 1, 1])
    both("append_mla_kv", 0, randn(3, cfg.latent_dim))
    q = randn(3, h, cfg.latent_dim)
    q[2, 1, 9] = NAN
    (o, lse), (ro, rl) = both("cross_attention", 0, q, SM_SCALE)
    expect = _all_heads(cfg, 3, [0, 1])
    expect[2, 1] = True
    _check_state(o, lse, ro, rl, cfg, "MLA cross attention", expect)
    (os_, ls), (ros, rls) = both("self_attention", 0, *(randn(3, h, d) for d in (cfg.head_dim, cfg.head_dim,
                                                                                cfg.v_dim)), SM_SCALE)
    o_c = o[..., :cfg.v_dim].contiguous()  # the merge of the cross state projected to v_head_dim (any map)
    cache.merge_attn_output_inplace(os_, ls, o_c, lse)
    mo, ml = merge_states(ros, rls, ro[..., :cfg.v_dim], rl)
    _check_state(os_, ls, mo, ml, cfg, "MLA self + cross merged (self empty)", expect)
    for layer in range(1, cfg.num_layers):
        both("append_mla_kv", layer, randn(3, cfg.latent_dim))
    both("end_forward")
    both("add_sequence", 4)
    both("begin_forward", [4], [6])
    qs = randn(6, h, cfg.head_dim)
    qs[4, 2, 3] = NAN
    (os_, ls), (ros, rls) = both("self_attention", 0, qs, randn(6, h, cfg.head_dim), randn(6, h, cfg.v_dim),
                                 SM_SCALE)
    expect = _rows({"ref": ros}, (4, 2))
    _check_state(os_, ls, ros, rls, cfg, "MLA self attention", expect)
    (oc, lc), _ = both("cross_attention", 0, randn(6, h, cfg.latent_dim), SM_SCALE)  # no cached key: empty
    assert torch.all(oc == 0) and torch.all(lc == -1e30)
    cache.merge_attn_output_inplace(os_, ls, oc[..., :cfg.v_dim].contiguous(), lc)
    _check_state(os_, ls, ros, rls, cfg, "MLA self merged with the empty cross state", expect)
    for layer in range(cfg.num_layers):
        both("append_mla_kv", layer, randn(6, cfg.latent_dim))
    both("end_forward")


def _check_state(o, lse, ref_o, ref_lse, cfg, what, expect):
    keep = nan_rows.check(o, lse, ref_o, what, expect=expect)
    assert_close(o.double()[keep], ref_o[keep], cfg.dtype, what)
    assert_close(lse.double()[keep], ref_lse[keep], "float32", f"{what} lse")
