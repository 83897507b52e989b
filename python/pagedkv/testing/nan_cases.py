"""NaN propagation through the cache's entry points (issue 44), on any cache and device: the cases of
``tests/cpu/test_nan_propagation.py`` and its GPU twin. The semantics and the row checks are ``nan_rows``'; each
case compares the rows without NaN with the float64 reference (``pagedkv.testing.reference``) and raises
``nan_rows.NaNLost`` / ``NaNLeak`` (``AssertionError`` s) where a row's NaN is wrong.

Cases: ``q_row`` (a NaN q row; NaN in fresh and in popped slots), ``key`` (a NaN k or v of one token: the causal
rows before it and the rows whose sliding window excludes it stay correct), ``all_nan`` (an all-NaN forward),
``prefix_shared`` (a shared-prefix pass merged with the own pass), ``mla`` (cross attention over a fork, self
attention, the model's merge of the two, a NaN state with the empty one).
"""

from __future__ import annotations

import torch

from . import nan_rows
from .reference import merge_states
from .reference_mla import reference_for
from .scenarios import assert_close

SM_SCALE = 0.15
NAN = float("nan")


class Run:
    """A cache and references fed the same forwards: ``ref`` the same inputs, ``variants`` (name -> function of
    the inputs) copies of them (a NaN v case's value-zeroed and NaN-k inputs)."""

    def __init__(self, cache, gen, **variants):
        self.cache, self.gen, self.cfg = cache, gen, cache.config
        self.dev = getattr(cache, "device", "cpu")
        self.refs = {"ref": (reference_for(self.cfg), None)}
        self.refs.update({name: (reference_for(self.cfg), f) for name, f in variants.items()})

    def caches(self):
        return [self.cache] + [r for r, _f in self.refs.values()]

    def qkv(self, n):
        """Random fused inputs of ``n`` tokens for every layer, ``[L, n, Hq + 2 Hkv, D]`` (CPU)."""
        c = self.cfg
        shape = (c.num_layers, n, c.num_qo_heads + 2 * c.num_kv_heads, c.head_dim)
        return torch.randn(*shape, generator=self.gen).to(getattr(torch, c.dtype))

    def call(self, method, *args):
        for c in self.caches():
            getattr(c, method)(*args)

    def forward(self, batch: dict, x: torch.Tensor) -> dict:
        """One forward of ``batch`` ({sequence: new tokens}) with inputs ``x`` (``qkv``); layer 0's o per name
        ("cache", "ref", the variants), float64 on the CPU."""
        self.call("begin_forward", list(batch), list(batch.values()))
        out = {}
        for layer in range(self.cfg.num_layers):
            out_l = {"cache": self.cache.attention_with_fused_qkv(layer, x[layer].to(self.dev), SM_SCALE)}
            for name, (ref, f) in self.refs.items():
                xr = x if f is None else f(x.clone())
                out_l[name] = ref.attention_with_fused_qkv(layer, xr[layer].clone(), SM_SCALE)
            out = out or {k: v.to("cpu", torch.float64) for k, v in out_l.items()}
        self.call("end_forward")
        return out

    def check(self, out, what, expect, whole=True):
        """The NaN rows of ``out["cache"]`` (``nan_rows.check``), the others against ``out["vals"]`` (a v case) or
        ``out["ref"]``."""
        keep = nan_rows.check(out["cache"], None, out["ref"], what, expect=expect, whole=whole)
        assert keep.any(), f"{what}: no row to compare"
        assert_close(out["cache"][keep], out.get("vals", out["ref"])[keep], self.cfg.dtype, what)


def _poison(x, cfg, what, token, head):
    """``x`` with one element of q head ``head`` (or of k / v of kv head ``head``) of ``token`` NaN, every layer."""
    index = {"q": head, "k": cfg.num_qo_heads + head, "v": cfg.num_qo_heads + cfg.num_kv_heads + head}[what]
    x[:, token, index, 5] = NAN
    return x


def _rows(cfg, n, tokens=(), heads=None, cells=()):
    """[n, Hq] mask: ``tokens`` x ``heads`` (default every head), and the (token, head) ``cells``."""
    expect = torch.zeros((n, cfg.num_qo_heads), dtype=torch.bool)
    expect[list(tokens), slice(None) if heads is None else heads] = True
    for cell in cells:
        expect[cell] = True
    return expect


def _group(cfg, kv_head):
    """The query heads of ``kv_head``."""
    g = cfg.num_qo_heads // cfg.num_kv_heads
    return slice(kv_head * g, (kv_head + 1) * g)


def q_row(cache, gen):
    """A NaN in one q row: that (token, head) row of o is NaN in a fresh prefill (ragged), a continuation (paged
    prefill) and a decode; every other row matches the reference. The sequences' unused slots are NaN: fresh
    pages (caches are created poisoned in the tests) and slots written with NaN k / v and then popped (past the
    length, never all overwritten by the next forwards' tokens)."""
    run, cfg = Run(cache, gen), cache.config
    run.call("add_sequence", 0)
    run.call("add_sequence", 1)
    out = run.forward({0: 20, 1: 9}, _poison(run.qkv(29), cfg, "q", 17, 1))
    run.check(out, "fresh prefill", _rows(cfg, 29, cells=[(17, 1)]))
    # NaN k / v in tokens 5 .. 8 of sequence 1, then popped: unused slots holding NaN.
    nan_kv = torch.full((cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim), NAN).to(getattr(torch, cfg.dtype))
    cache.debug_set_kv(1, 5, nan_kv.to(run.dev), nan_kv.to(run.dev))
    run.call("popn", 1, 4)
    out = run.forward({0: 3, 1: 2}, _poison(run.qkv(5), cfg, "q", 4, 0))
    run.check(out, "continuation", _rows(cfg, 5, cells=[(4, 0)]))
    out = run.forward({0: 1, 1: 1}, _poison(run.qkv(2), cfg, "q", 0, cfg.num_qo_heads - 1))
    run.check(out, "decode", _rows(cfg, 2, cells=[(0, cfg.num_qo_heads - 1)]))


def key(cache, gen, what):
    """A NaN in the k (``what = "k"``) or v of token 12 of a 30-token prefill: the rows of its kv head's queries
    that see it are NaN (k: whole row; v: at least where v is), the causal rows before it (and, with a sliding
    window, the rows past it) match the reference, in the prefill (its causal tile holds rows on both sides), a
    continuation (paged prefill) and a decode. The v case's reference: the inputs with that v zeroed (``vals``;
    unseen, any value serves), its rows that see the key those of the same NaN in k (``mask``)."""
    cfg = cache.config
    kv_head = cfg.num_kv_heads - 1
    variants = {} if what == "k" else {
        "vals": lambda x: x.nan_to_num_(0.0),
        "mask": lambda x: _poison(x.nan_to_num_(0.0), cfg, "k", 12, kv_head) if x.shape[1] == 30 else x}
    run = Run(cache, gen, **variants)
    run.call("add_sequence", 0)
    window = cfg.sliding_window or 10**6
    steps = [(0, 30, _poison(run.qkv(30), cfg, what, 12, kv_head)), (30, 4, run.qkv(4)), (34, 1, run.qkv(1))]
    for first, n, x in steps:  # first: the position of the forward's first token
        out = run.forward({0: n}, x)
        expect = _rows(cfg, n, [t for t in range(n) if 12 <= first + t < 12 + window], _group(cfg, kv_head))
        assert torch.equal(nan_rows.attending(out["mask" if what == "v" else "ref"]), expect)  # the case's rows
        run.check(out, f"NaN {what}, forward at {first}", expect, whole=what == "k")


def all_nan(cache, gen):
    """An all-NaN prefill: every row of its sequence NaN (before issue 44: NaN rows and a row of zeros); the next
    decode with finite inputs sees its NaN keys: NaN; the other sequence of both forwards matches the
    reference."""
    run, cfg = Run(cache, gen), cache.config
    run.call("add_sequence", 0)
    run.call("add_sequence", 1)
    x = run.qkv(20)
    x[:, :12] = NAN
    run.check(run.forward({0: 12, 1: 8}, x), "all-NaN prefill", _rows(cfg, 20, range(12)))
    run.check(run.forward({0: 1, 1: 1}, run.qkv(2)), "decode after it", _rows(cfg, 2, [0]))


def prefix_shared(cache, gen):
    """Sequences 1 and 2 fork sequence 0 (16 tokens, a NaN k in token 3): a decode and a continuation of 0, 1, 2
    and an unrelated sequence 3 merge a shared-prefix pass with the own pass (``merge_state``, or the
    partial-state ops at 16-bit dtypes): every row of 0, 1, 2 of that kv head's queries NaN, sequence 3's rows but
    a NaN q row match the reference."""
    run, cfg = Run(cache, gen), cache.config
    for sid in (0, 3):
        run.call("add_sequence", sid)
    run.forward({0: 16, 3: 5}, _poison(run.qkv(21), cfg, "k", 3, 0))
    for child in (1, 2):
        run.call("fork_sequence", 0, child)
    for n in (1, 3):
        out = run.forward({0: n, 1: n, 2: n, 3: n}, _poison(run.qkv(4 * n), cfg, "q", 3 * n, 1))
        run.check(out, f"shared forward of {n}", _rows(cfg, 4 * n, range(3 * n), _group(cfg, 0), [(3 * n, 1)]))


def mla(cache, gen):
    """MLA: a NaN latent (in v's dims) of sequence 0, which sequence 1 forks: a decode's cross attention (the
    shared pass and the own pass merged) gives NaN rows for 0 and 1 (o and lse), a NaN q row of sequence 2 its
    row; self attention is the empty state there, and merged with it (the model's merge) the NaN rows stay NaN. A
    prefill's self attention with a NaN q row: that row NaN, merged with the empty cross state (a fresh
    sequence) too. Other rows match the reference."""
    cfg, ref, dev = cache.config, reference_for(cache.config), getattr(cache, "device", "cpu")
    h, dt = cfg.num_qo_heads, getattr(torch, cfg.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dt)

    def both(method, *args):
        """The call on the cache (tensors moved to its device, results to the CPU) and on the reference."""
        got = getattr(cache, method)(*(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args))
        got = tuple(t.cpu() for t in got) if isinstance(got, tuple) else got
        return got, getattr(ref, method)(*args)

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
    expect = _rows(cfg, 3, [0, 1], cells=[(2, 1)])
    _check_state(o, lse, ro, rl, cfg, "MLA cross attention", expect)
    qkv_self = [randn(3, h, d) for d in (cfg.head_dim, cfg.head_dim, cfg.v_dim)]
    (os_, ls), (ros, rls) = both("self_attention", 0, *qkv_self, SM_SCALE)
    _merge_check(cache, (os_, ls, o[..., :cfg.v_dim], lse), merge_states(ros, rls, ro[..., :cfg.v_dim], rl), cfg,
                 "MLA self + cross merged (self empty)", expect)
    for layer in range(1, cfg.num_layers):
        both("append_mla_kv", layer, randn(3, cfg.latent_dim))
    both("end_forward")
    both("add_sequence", 4)
    both("begin_forward", [4], [6])
    qs = randn(6, h, cfg.head_dim)
    qs[4, 2, 3] = NAN
    (os_, ls), (ros, rls) = both("self_attention", 0, qs, randn(6, h, cfg.head_dim), randn(6, h, cfg.v_dim),
                                 SM_SCALE)
    expect = _rows(cfg, 6, cells=[(4, 2)])
    _check_state(os_, ls, ros, rls, cfg, "MLA self attention", expect)
    (oc, lc), _ = both("cross_attention", 0, randn(6, h, cfg.latent_dim), SM_SCALE)  # no cached key: empty
    assert torch.all(oc == 0) and torch.all(lc == -1e30), "MLA cross attention of a fresh sequence: not empty"
    _merge_check(cache, (os_, ls, oc[..., :cfg.v_dim], lc), (ros, rls), cfg,
                 "MLA self merged with the empty cross state", expect)
    for layer in range(cfg.num_layers):
        both("append_mla_kv", layer, randn(6, cfg.latent_dim))
    both("end_forward")


def _merge_check(cache, state, ref_state, cfg, what, expect):
    """``merge_attn_output_inplace`` of ``state = (o_a, lse_a, o_b, lse_b)`` (the b side: any projection of the
    cross state to ``v_head_dim``, here its first dims) on the cache's device, checked against ``ref_state``."""
    dev = getattr(cache, "device", "cpu")
    o_a, lse_a, o_b, lse_b = (t.to(dev).contiguous().clone() for t in state)
    cache.merge_attn_output_inplace(o_a, lse_a, o_b, lse_b)
    _check_state(o_a.cpu(), lse_a.cpu(), *ref_state, cfg, what, expect)


def _check_state(o, lse, ref_o, ref_lse, cfg, what, expect):
    keep = nan_rows.check(o, lse, ref_o, what, expect=expect)
    assert_close(o.double()[keep], ref_o[keep], cfg.dtype, what)
    assert_close(lse.double()[keep], ref_lse[keep], "float32", f"{what} lse")


__all__ = ["SM_SCALE", "all_nan", "key", "mla", "prefix_shared", "q_row"]
