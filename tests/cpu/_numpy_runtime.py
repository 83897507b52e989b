"""The numpy kernels of every op of the ABI, the reference they are checked against, and the harness that runs
the C++ runtime on them (``test_runtime_numpy.py``, ``test_sinks_runtime.py``)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pagedkv import runtime_library_path
from pagedkv.ops import OPS_BY_KIND

OPS = OPS_BY_KIND["mha"]

LIB = runtime_library_path()

EMPTY_LSE = -1e30


# ----------------------------------------------------------------------------------------------------------
# Loading

_G = {}


def g(name):
    """The global ``pagedkv.<name>`` (the library is loaded once, after TVM's runtime)."""
    if not _G:
        import tvm  # noqa: F401  (registers runtime.TVMTensor* globals)
        import tvm_ffi

        tvm_ffi.load_module(str(LIB))
        _G["ffi"] = tvm_ffi
    return _G["ffi"].get_global_func("pagedkv." + name)


def T(a: np.ndarray):
    """A tvm_ffi tensor sharing memory with the (contiguous) numpy array ``a``."""
    g("create")
    return _G["ffi"].from_dlpack(np.ascontiguousarray(a))


def N(t) -> np.ndarray:
    return np.from_dlpack(t)


# ----------------------------------------------------------------------------------------------------------
# The kernel ABI in numpy (float64 math, outputs cast to the output dtype; lse base 2)

def rope(x, pos, scale, theta):
    """Rotate-half RoPE of x[..., n, H, D] at positions pos[n]."""
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / d)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * scale * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attend(q, k, v, sm_scale, causal, sinks=None, window=0, sink_size=0):
    """q[a,Hq,D], k/v[m,Hkv,D] -> o[a,Hq,D], lse[a,Hq] (base 2); bottom-right causal; empty -> (0, -1e30).
    ``sinks[Hq]``: one more logit per head (natural log) whose value is 0, seen by every row. ``window``: row t (at
    key position m - a + t) sees keys j > m - a + t - window only, or j < ``sink_size``."""
    a, hq, d = q.shape
    m = k.shape[0]
    o = np.zeros((a, hq, v.shape[-1]))
    lse = np.full((a, hq), EMPTY_LSE)
    if m == 0 and sinks is None:
        return o, lse
    group = hq // k.shape[1]
    kk = np.repeat(k, group, axis=1)  # [m, Hq, D]
    vv = np.repeat(v, group, axis=1)
    s = np.einsum("ahd,mhd->ahm", q, kk) * sm_scale
    if causal:
        mask = np.arange(m)[None, :] <= (m - a + np.arange(a))[:, None]
        s = np.where(mask[:, None, :], s, -np.inf)
    if window:
        j, p = np.arange(m)[None, :], (m - a + np.arange(a))[:, None]
        s = np.where(((j > p - window) | (j < sink_size))[:, None, :], s, -np.inf)
    if sinks is not None:
        s = np.concatenate([s, np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None], (a, hq, 1))], axis=-1)
        vv = np.concatenate([vv, np.zeros((1,) + vv.shape[1:])])
    mx = s.max(-1, keepdims=True)
    valid = np.isfinite(mx[..., 0])
    e = np.exp(s - np.where(np.isfinite(mx), mx, 0))
    tot = e.sum(-1)
    o = np.where(valid[..., None], np.einsum("ahm,mhd->ahd", e, vv) / np.maximum(tot, 1e-300)[..., None], 0)
    lse = np.where(valid, (mx[..., 0] + np.log(np.maximum(tot, 1e-300))) / math.log(2), EMPTY_LSE)
    return o, lse


class NumpyKernels:
    """The ABI ops as Python functions; ``calls`` logs (op, info) for tests that look at orchestration."""

    def __init__(self, window=0):
        self.calls = []
        self.window = window  # the config's sliding_window: a compile-time option of the kernels

    def table(self, drop=()):
        # late-bound, so a test can swap one op for a spy after creation
        def entry(op):
            return [op, "tir", _G["ffi"].convert(lambda *args: getattr(self, op)(*args))]

        return [entry(op) for op in OPS if op not in drop]

    def split_rotary(self, qkv, q_pos, q, k, v, apply_rope, rope_scale, rope_theta):
        self.calls.append(("split_rotary", None))
        x, qa, ka = N(qkv).astype(np.float64), N(q), N(k)
        hq, hkv = qa.shape[1], ka.shape[1]
        qq, kk = x[:, :hq], x[:, hq:hq + hkv]
        if apply_rope:
            qq, kk = rope(qq, N(q_pos), rope_scale, rope_theta), rope(kk, N(q_pos), rope_scale, rope_theta)
        qa[...] = qq
        ka[...] = kk
        N(v)[...] = x[:, hq + hkv:]

    def append_kv(self, pages, k, v, slot):
        self.calls.append(("append_kv", None))
        p = N(pages)
        ps = p.shape[3]
        for i, s in enumerate(N(slot)):
            p[s // ps, 0, :, s % ps] = N(k)[i]
            p[s // ps, 1, :, s % ps] = N(v)[i]

    def gather_kv(self, pages, slot, k, v):
        p = N(pages)
        ps = p.shape[3]
        for i, s in enumerate(N(slot)):
            N(k)[i] = p[s // ps, 0, :, s % ps]
            N(v)[i] = p[s // ps, 1, :, s % ps]

    def attn_prefill_ragged(self, q, k, v, q_indptr, kv_indptr, q_pos, k_pos_offset, o, lse,
                            causal, apply_rope, rope_scale, rope_theta, sm_scale):
        self.calls.append(("attn_prefill_ragged", None))
        qi, ki, qp, kpo = N(q_indptr), N(kv_indptr), N(q_pos), N(k_pos_offset)
        for b in range(len(qi) - 1):
            qq = N(q)[qi[b]:qi[b + 1]].astype(np.float64)
            kk = N(k)[ki[b]:ki[b + 1]].astype(np.float64)
            if apply_rope:
                qq = rope(qq, qp[qi[b]:qi[b + 1]], rope_scale, rope_theta)
                kk = rope(kk, kpo[b] + np.arange(len(kk)), rope_scale, rope_theta)
            ob, lb = attend(qq, kk, N(v)[ki[b]:ki[b + 1]].astype(np.float64), sm_scale, causal, window=self.window)
            N(o)[qi[b]:qi[b + 1]] = ob
            N(lse)[qi[b]:qi[b + 1]] = lb

    @staticmethod
    def _paged_kv(pages, page_indptr, page_values, last_page_len, b):
        p = N(pages)
        pi, pv, ll = N(page_indptr), N(page_values), N(last_page_len)
        ids = pv[pi[b]:pi[b + 1]]
        if len(ids) == 0:
            return np.zeros((0,) + p.shape[2:3] + p.shape[4:]), np.zeros((0,) + p.shape[2:3] + p.shape[4:])
        kv = p[ids].astype(np.float64)  # [np, 2, Hkv, ps, D]
        kv = kv.transpose(1, 0, 3, 2, 4).reshape(2, -1, p.shape[2], p.shape[4])
        n = (len(ids) - 1) * p.shape[3] + ll[b]
        return kv[0, :n], kv[1, :n]

    def attn_prefill_paged(self, q, q_indptr, pages, page_indptr, page_values, last_page_len, k_pos_offset,
                           q_pos, o, lse, causal, apply_rope, rope_scale, rope_theta, sm_scale):
        qi, qp, kpo = N(q_indptr), N(q_pos), N(k_pos_offset)
        self.calls.append(("attn_prefill_paged", tuple(qi)))
        for b in range(len(qi) - 1):
            kk, vv = self._paged_kv(pages, page_indptr, page_values, last_page_len, b)
            qq = N(q)[qi[b]:qi[b + 1]].astype(np.float64)
            if apply_rope:
                qq = rope(qq, qp[qi[b]:qi[b + 1]], rope_scale, rope_theta)
                kk = rope(kk, kpo[b] + np.arange(len(kk)), rope_scale, rope_theta)
            ob, lb = attend(qq, kk, vv, sm_scale, causal, window=self.window)
            N(o)[qi[b]:qi[b + 1]] = ob
            N(lse)[qi[b]:qi[b + 1]] = lb

    def attn_decode_paged(self, q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o,
                          lse, apply_rope, rope_scale, rope_theta, sm_scale):
        qp, kpo = N(q_pos), N(k_pos_offset)
        self.calls.append(("attn_decode_paged", len(N(last_page_len))))
        for b in range(N(q).shape[0]):
            kk, vv = self._paged_kv(pages, page_indptr, page_values, last_page_len, b)
            qq = N(q)[b:b + 1].astype(np.float64)
            if apply_rope:
                qq = rope(qq, qp[b:b + 1], rope_scale, rope_theta)
                kk = rope(kk, kpo[b] + np.arange(len(kk)), rope_scale, rope_theta)
            ob, lb = attend(qq, kk, vv, sm_scale, False, window=self.window)
            N(o)[b] = ob[0]
            N(lse)[b] = lb[0]

    # The partial-state variants are the same functions: each writes o in the dtype it is given (float32 then).
    attn_prefill_ragged_partial = attn_prefill_ragged
    attn_prefill_paged_partial = attn_prefill_paged
    attn_decode_paged_partial = attn_decode_paged

    def merge_state(self, o_a, lse_a, o_b, lse_b):
        self.calls.append(("merge_state", None))
        self._merge(o_a, lse_a, o_b, lse_b)

    def merge_state_partial(self, o_a, lse_a, o_b, lse_b, o):
        self.calls.append(("merge_state_partial", tuple(str(N(x).dtype) for x in (o_a, o_b, o))))
        self._merge(o_a, lse_a, o_b, lse_b)
        N(o)[...] = N(o_a)

    @staticmethod
    def _merge(o_a, lse_a, o_b, lse_b):
        la, lb = N(lse_a).astype(np.float64), N(lse_b).astype(np.float64)
        m = np.maximum(la, lb)
        wa, wb = np.exp2(la - m), np.exp2(lb - m)
        oa, ob = N(o_a).astype(np.float64), N(o_b).astype(np.float64)
        N(o_a)[...] = (oa * wa[..., None] + ob * wb[..., None]) / (wa + wb)[..., None]
        N(lse_a)[...] = np.where(m <= EMPTY_LSE, EMPTY_LSE, m + np.log2(wa + wb))

    def apply_sinks(self, o, lse, sinks):
        self.calls.append(("apply_sinks", str(N(o).dtype)))
        self._merge_sinks(o, lse, sinks)

    def merge_state_partial_sinks(self, o_a, lse_a, o_b, lse_b, sinks, o):
        self.calls.append(("merge_state_partial_sinks", tuple(str(N(x).dtype) for x in (o_a, o_b, o))))
        self._merge(o_a, lse_a, o_b, lse_b)
        self._merge_sinks(o_a, lse_a, sinks)
        N(o)[...] = N(o_a)

    @staticmethod
    def _merge_sinks(o, lse, sinks):
        """(o, lse) merged with each head's sink state (o = 0, lse = sinks[h] * log2(e))."""
        sink_lse = np.broadcast_to(N(sinks).astype(np.float64) / math.log(2), N(lse).shape).astype(np.float32)
        NumpyKernels._merge(o, lse, np.zeros_like(N(o)), sink_lse)

    def copy_page(self, pages, src_page, dst_page, num_tokens):
        self.calls.append(("copy_page", (src_page, dst_page, num_tokens)))
        p = N(pages)
        p[dst_page, :, :, :num_tokens] = p[src_page, :, :, :num_tokens]

    def compact_copy(self, pages, src_slot, dst_slot):
        p = N(pages)
        ps = p.shape[3]
        for s, d in zip(N(src_slot), N(dst_slot)):
            p[d // ps, :, :, d % ps] = p[s // ps, :, :, s % ps]


# ----------------------------------------------------------------------------------------------------------
# Config, reference and harness

def config(**kw):
    c = dict(schema_version=1, num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=8, dtype="float32",
             rope_mode="normal", rope_theta=10000.0, rope_scale=1.0, page_size=4, max_batch_size=4,
             max_total_seq_len=64, prefill_chunk_size=32)
    c.update(kw)
    c.setdefault("v_head_dim", c["head_dim"])
    c.setdefault("layer_kinds", ["mha"] * c["num_layers"])
    return c


def create(cfg, kernels=None, runtime_fields=(), runtime_values=(), drop=(), table=None):
    kernels = kernels or NumpyKernels()
    d = dict(cfg)
    for f in runtime_fields:
        del d[f]
    d["runtime_fields"] = list(runtime_fields)
    g("create")
    table = table if table is not None else kernels.table(drop)
    return g("create")(json.dumps(d), list(runtime_values), table, T(np.zeros((1,), np.float32)))


class Harness:
    """A cache on numpy kernels plus a float64 reference of every sequence's raw (unrotated) k and v."""

    def __init__(self, seed=0, poison=True, drop=(), **kw):
        self.cfg = config(**kw)
        self.k = NumpyKernels(window=self.cfg.get("sliding_window", 0))
        self.cache = create(self.cfg, self.k, drop=drop)
        if poison:
            g("debug_poison_pages")(self.cache, True)
        self.rng = np.random.default_rng(seed)
        self.ref = {}  # seq -> (k[L, len, Hkv, D], v[...]) raw
        c = self.cfg
        self.L, self.hq, self.hkv, self.d = c["num_layers"], c["num_qo_heads"], c["num_kv_heads"], c["head_dim"]
        self.np_dtype = np.dtype(c["dtype"])
        self.num_pages = -(-c["max_total_seq_len"] // c["page_size"]) + c["max_batch_size"]

    def call(self, name, *args):
        return g(name)(self.cache, *args)

    # -- sequence ops, applied to cache and reference --
    def add(self, s):
        self.call("add_sequence", s)
        self.ref[s] = (np.zeros((self.L, 0, self.hkv, self.d)),) * 2

    def fork(self, p, c, pos=-1):
        self.call("fork_sequence", p, c, pos)
        n = self.ref[p][0].shape[1] if pos == -1 else pos
        self.ref[c] = tuple(x[:, :n].copy() for x in self.ref[p])

    def popn(self, s, n):
        self.call("popn", s, n)
        keep = self.ref[s][0].shape[1] - n
        self.ref[s] = tuple(x[:, :keep].copy() for x in self.ref[s])

    def remove(self, s):
        self.call("remove_sequence", s)
        del self.ref[s]

    def length(self, s):
        return self.call("get_sequence_length", s)

    # -- forward --
    def forward(self, batch: dict, sm_scale=0.3, check=True, tol=None, sinks=None):
        """One forward of every layer through attention_with_fused_qkv (``_sinks`` with ``sinks``), checked
        against the reference."""
        ids, lens = list(batch), list(batch.values())
        self.call("begin_forward", ids, lens)
        n = sum(lens)
        width = self.hq + 2 * self.hkv
        outs = []
        for layer in range(self.L):
            qkv = self.rng.standard_normal((n, width, self.d)).astype(self.np_dtype)
            o = np.full((n, self.hq, self.d), np.nan, self.np_dtype)
            if sinks is None:
                self.call("attention_with_fused_qkv", layer, sm_scale, T(qkv), T(o))
            else:
                self.call("attention_with_fused_qkv_sinks", layer, sm_scale, T(qkv), T(sinks), T(o))
            outs.append((qkv.astype(np.float64), o.astype(np.float64)))
        qpos = N(self.call("get_query_positions")).copy()
        self.call("end_forward")
        expect_pos = np.concatenate([np.arange(self.ref[s][0].shape[1], self.ref[s][0].shape[1] + a)
                                     for s, a in batch.items()])
        np.testing.assert_array_equal(qpos, expect_pos)
        self._apply_reference(batch, outs, sm_scale, check, tol, sinks)

    def _apply_reference(self, batch, outs, sm_scale, check, tol, sinks=None):
        hq, hkv = self.hq, self.hkv
        tol = tol or (2e-5 if self.np_dtype == np.float32 else 2e-2)
        new_k, new_v = {s: [] for s in batch}, {s: [] for s in batch}
        for layer, (qkv, o) in enumerate(outs):
            row = 0
            for s, a in batch.items():
                x = qkv[row:row + a]
                k_all = np.concatenate([self.ref[s][0][layer], x[:, hq:hq + hkv]])
                v_all = np.concatenate([self.ref[s][1][layer], x[:, hq + hkv:]])
                new_k[s].append(x[:, hq:hq + hkv])
                new_v[s].append(x[:, hq + hkv:])
                if check:
                    expect = self.reference_attention(x[:, :hq], k_all, v_all, sm_scale, sinks,
                                                      window=self.layer_window(layer))
                    np.testing.assert_allclose(o[row:row + a], expect, rtol=tol, atol=tol,
                                               err_msg=f"layer {layer} seq {s}")
                row += a
        for s in batch:
            self.ref[s] = (np.concatenate([self.ref[s][0], np.stack(new_k[s])], axis=1),
                           np.concatenate([self.ref[s][1], np.stack(new_v[s])], axis=1))

    def rotate(self, x, pos):
        if self.cfg["rope_mode"] == "none":
            return x
        return rope(x, pos, self.cfg["rope_scale"], self.cfg["rope_theta"])

    def layer_window(self, layer):
        """The sliding window of ``layer`` (the config's; layer groups: its group's)."""
        return self.cfg.get("sliding_window", 0)

    def reference_attention(self, q, k_all, v_all, sm_scale, sinks=None, window=None):
        """Causal attention of the last len(q) tokens of a sequence over all of its tokens (and the sinks)."""
        m, a = len(k_all), len(q)
        qr = self.rotate(q, np.arange(m - a, m))
        kr = self.rotate(k_all, np.arange(m))
        window = self.cfg.get("sliding_window", 0) if window is None else window
        return attend(qr, kr, v_all, sm_scale, True, sinks, window, self.cfg.get("sink_size", 0))[0]

    # -- state checks --
    def dump(self, s):
        n = self.length(s)
        k = np.full((self.L, n, self.hkv, self.d), np.nan, self.np_dtype)
        v = np.full_like(k, np.nan)
        self.call("debug_get_kv", s, 0, n, T(k), T(v))
        return k, v

    def check_state(self):
        tol = 2e-5 if self.np_dtype == np.float32 else 2e-2
        for s, (rk, rv) in self.ref.items():
            assert self.length(s) == rk.shape[1], f"length of {s}"
            k, v = self.dump(s)
            stored_k = rk if self.cfg["rope_mode"] != "normal" else \
                np.stack([self.rotate(x, np.arange(x.shape[0])) for x in rk]) if rk.shape[1] else rk
            np.testing.assert_allclose(k, stored_k, rtol=tol, atol=tol, err_msg=f"k of {s}")
            np.testing.assert_allclose(v, rv, rtol=tol, atol=tol, err_msg=f"v of {s}")
        assert self.call("get_total_sequence_length") == sum(x[0].shape[1] for x in self.ref.values())

    def snapshot(self):
        out = {"pages": self.call("get_num_available_pages"), "total": self.call("get_total_sequence_length")}
        for s in sorted(self.ref):
            out[s] = (self.length(s), *self.dump(s))
        return out

    def rejects(self, fn, pattern):
        before = self.snapshot()
        with pytest.raises(Exception, match=pattern):
            fn()
        after = self.snapshot()
        assert before.keys() == after.keys()
        for key in before:
            if isinstance(before[key], tuple):
                assert before[key][0] == after[key][0]
                np.testing.assert_array_equal(before[key][1], after[key][1])
                np.testing.assert_array_equal(before[key][2], after[key][2])
            else:
                assert before[key] == after[key], key

def _fork_tree(h):
    h.add(0)
    h.forward({0: 13})
    h.fork(0, 1, 8)        # page boundary: shares 2 full pages, no copy
    h.fork(0, 2, -1)       # mid-page at the parent's end: copies 1 token
    h.fork(1, 3, 6)        # mid-page inside a shared block, depth 3
    h.fork(3, 4, -1)       # 6 tokens: one full page shared, 2 tokens copied
    h.check_state()
    h.forward({0: 1, 1: 1, 2: 1, 3: 1})   # decode with shared prefixes (grouped passes)
    h.forward({4: 3, 3: 2, 1: 5})         # prefill with shared prefixes
    h.forward({2: 1, 0: 1, 4: 1, 3: 1})
    h.check_state()
    h.fork(4, 5, 2)        # fork inside the root's first page
    h.forward({5: 4, 0: 2})
    h.check_state()
