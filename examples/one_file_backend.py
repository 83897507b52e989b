"""A pagedkv backend written in one file: a plain TIR decode kernel for the CPU, registered at run time.

Its function follows the kernel ABI of ``attn_decode_paged`` (the op table, ``pagedkv.ops``), so the runtime
calls it with the ``direct`` adapter: no C++. The PrimFunc's parameters come from the op table
(``abi_prim_func``); the backend only writes the body, says when it cannot serve, and builds it.

    python examples/one_file_backend.py     # decodes with it and checks the result against the "tir" backend
"""

from __future__ import annotations

import sys

import torch
from tvm.script import tirx as T

import pagedkv
from pagedkv import backends, ops
from pagedkv.backends import Backend, OpBuild
from pagedkv.config import KVCacheConfig
from pagedkv.tir_kernels import abi_prim_func

LOG2E = 1.4426950408889634


def naive_decode(config: KVCacheConfig):
    """``pagedkv_attn_decode_paged``: one query head at a time, keys one by one, online softmax in base 2."""
    HQ, D, G, dtype = config.num_qo_heads, config.head_dim, config.group_size, config.dtype

    @T.macro
    def body(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, apply_rope,
             rope_scale, rope_theta, sm_scale, dims):
        b, _p, ps, _nnz = dims
        for i in T.parallel(b):
            for h in T.serial(HQ):
                st = T.alloc_buffer((3,), "float32")  # running max, running sum, score
                acc = T.alloc_buffer((D,), "float32")
                npages: T.let[T.int32] = page_indptr[i + 1] - page_indptr[i]
                kvlen: T.let[T.int32] = T.if_then_else(npages == 0, 0, (npages - 1) * ps + last_page_len[i])
                st[0] = T.float32(-3.0e38)
                st[1] = T.float32(0)
                for d in T.serial(D):
                    acc[d] = T.float32(0)
                for j in T.serial(kvlen):
                    pg: T.let[T.int32] = page_values[page_indptr[i] + j // ps]
                    st[2] = T.float32(0)
                    for d in T.serial(D):
                        st[2] = st[2] + T.Cast("float32", q[i, h, d]) * T.Cast("float32", pages[pg, 0, h // G, j % ps, d])
                    s: T.let[T.float32] = st[2] * sm_scale * T.float32(LOG2E)
                    m_new: T.let[T.float32] = T.max(st[0], s)
                    alpha: T.let[T.float32] = T.exp2(st[0] - m_new)
                    w: T.let[T.float32] = T.exp2(s - m_new)
                    st[1] = st[1] * alpha + w
                    for d in T.serial(D):
                        acc[d] = acc[d] * alpha + w * T.Cast("float32", pages[pg, 1, h // G, j % ps, d])
                    st[0] = m_new
                for d in T.serial(D):
                    o[i, h, d] = T.Cast(dtype, T.if_then_else(kvlen > 0, acc[d] / st[1], T.float32(0)))
                lse[i, h] = T.if_then_else(kvlen > 0, st[0] + T.log2(st[1]), T.float32(-1.0e30))

    return abi_prim_func(ops.ATTN_DECODE_PAGED, ops.shape_values(config), dtype, body,
                         symbol=f"naive_{ops.ATTN_DECODE_PAGED}")


class NaiveDecodeBackend(Backend):
    """Serves ``attn_decode_paged`` on the CPU, without inline RoPE or attention options."""

    tag = "naive"
    ops = (ops.ATTN_DECODE_PAGED,)

    def validate_configuration(self, op, config, target):
        reasons = self._unsupported_op(op)
        if backends.target_kind(target) != "llvm":
            reasons.append(f"a CPU kernel; target kind is {backends.target_kind(target)!r}")
        if config.is_mla:
            reasons.append("MHA only")
        if config.rope_mode == "inline" or config.sliding_window or config.logits_soft_cap:
            reasons.append("no inline RoPE, sliding window or soft-cap")
        return reasons

    def describe(self, op, config, target):
        return "one query head at a time (examples/one_file_backend.py)"

    def build(self, op, config, target):
        return OpBuild(op=op, backend=self.tag, prim_funcs=((f"naive_{op}", naive_decode(config)),))


def main() -> int:
    # a class path is imported on first use; this file is importable as `one_file_backend` when run
    backends.register_backend("naive", "one_file_backend:NaiveDecodeBackend", priority=-1, replace=True)
    cfg = KVCacheConfig(num_layers=1, num_qo_heads=6, num_kv_heads=2, head_dim=32, dtype="float32",
                        max_batch_size=4, max_total_seq_len=512, page_size=8, prefill_chunk_size=128)
    from pagedkv.support import support_matrix

    cells, auto = support_matrix(cfg, "llvm")  # what `pagedkv backends` prints, for the one op
    for c in (c for c in cells if c.op == ops.ATTN_DECODE_PAGED):
        print(f"{c.backend:10s} " + (f"serves: {c.how}" if c.served else "cannot: " + "; ".join(c.reasons)))
    print(f"automatic selection: {auto[ops.ATTN_DECODE_PAGED]} (naive has the lowest priority)")
    ours = pagedkv.create(cfg, backend={ops.ATTN_DECODE_PAGED: "naive", "*": "tir"}, poison=True)
    ref = pagedkv.create(cfg, backend="tir", poison=True)
    print("op backends:", ours.op_backends)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    lengths = [13, 5, 30]
    for step, n in enumerate([lengths, [1, 1, 1], [1, 1, 1]]):
        qkv = torch.randn(sum(n), cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim, generator=gen)
        outs = []
        for cache in (ours, ref):
            if step == 0:
                for s in range(len(n)):
                    cache.add_sequence(s)
            cache.begin_forward(list(range(len(n))), n)
            outs.append(cache.attention_with_fused_qkv(0, qkv, sm_scale=cfg.head_dim ** -0.5))
            cache.end_forward()
        err = float((outs[0] - outs[1]).norm() / outs[1].norm())
        worst = max(worst, err)
        print(f"forward {step} ({'prefill' if step == 0 else 'decode'}): relative difference to tir {err:.2e}")
    ok = worst < 1e-5
    print("OK" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
