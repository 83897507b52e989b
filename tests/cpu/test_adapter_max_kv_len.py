"""The runtime adapter kind ``direct_max_kv_len`` (``src/backend.cc``): it calls the op's one function with the
kernel ABI and then ``max_kv_len``, the longest entry of the call's pass (``pagedkv.ops.ADAPTER_ARGS``).

A probe backend serves ``attn_decode_paged`` on the CPU with a kernel that writes the value it was given into
every output row; decode forwards of mixed lengths (one pass each) must then read back the longest entry's
keys, the new token included, forward by forward.
"""

from __future__ import annotations

import pytest
import torch
from tvm.script import tirx as T

import pagedkv
from pagedkv import backends, ops
from pagedkv.backends import Backend, OpBuild
from pagedkv.config import KVCacheConfig
from pagedkv.tir_kernels import abi_prim_func, adapter_of

CFG = KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", max_batch_size=6,
                    max_total_seq_len=1024, page_size=8, prefill_chunk_size=256)


def probe_decode(config: KVCacheConfig):
    """``attn_decode_paged`` that writes ``o = max_kv_len`` and ``lse = 0`` for every entry and head."""
    HQ, D, dtype = config.num_qo_heads, config.head_dim, config.dtype

    @T.macro
    def body(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, apply_rope,
             rope_scale, rope_theta, sm_scale, max_kv_len, dims):
        b, _p, _ps, _nnz = dims
        for i, h in T.grid(b, HQ):
            lse[i, h] = T.float32(0)
            for d in T.serial(D):
                o[i, h, d] = T.Cast(dtype, max_kv_len)

    return abi_prim_func(ops.ATTN_DECODE_PAGED, ops.shape_values(config), dtype, body,
                         symbol="probe_attn_decode_paged", adapter="direct_max_kv_len")


class ProbeBackend(Backend):
    tag = "maxkvprobe"
    ops = (ops.ATTN_DECODE_PAGED,)

    def validate_configuration(self, op, config, target):
        return self._unsupported_op(op)

    def build(self, op, config, target):
        func = probe_decode(config)
        return OpBuild(op=op, backend=self.tag, prim_funcs=(("probe_attn_decode_paged", func),),
                       adapter=adapter_of(func))


@pytest.fixture(scope="module")
def probe_cache():
    # registered into a copy of the registry, restored afterwards: later tests see only the real backends
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
        mp.setattr(backends, "_INSTANCES", dict(backends._INSTANCES))
        backends.register_backend(ProbeBackend.tag, f"{__name__}:ProbeBackend", priority=-10, replace=True)
        yield pagedkv.create(CFG, backend={ops.ATTN_DECODE_PAGED: ProbeBackend.tag, "*": "tir"}, poison=True)


def test_probe_declares_the_adapter():
    func = probe_decode(CFG)
    assert adapter_of(func) == "direct_max_kv_len"
    assert [str(p.name) for p in func.params][-2:] == ["sm_scale", "max_kv_len"]


def test_decode_gets_the_longest_entry(probe_cache):
    cache, gen = probe_cache, torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    width = CFG.num_qo_heads + 2 * CFG.num_kv_heads
    prompts = [int(x) for x in torch.randint(1, 60, (5,), generator=gen)]
    for s, n in enumerate(prompts):  # prefill each alone (the probe serves decode only)
        cache.add_sequence(s)
        cache.begin_forward([s], [n])
        cache.attention_with_fused_qkv(0, torch.randn(n, width, CFG.head_dim, generator=gen), sm_scale=0.25)
        cache.end_forward()
    lengths = dict(enumerate(prompts))
    for step in range(4):  # decode batches of changing membership and order
        ids = torch.randperm(5, generator=gen)[:2 + step].tolist()
        cache.begin_forward(ids, [1] * len(ids))
        o = cache.attention_with_fused_qkv(0, torch.randn(len(ids), width, CFG.head_dim, generator=gen),
                                           sm_scale=0.25)
        cache.end_forward()
        for s in ids:
            lengths[s] += 1
        want = max(lengths[s] for s in ids)
        assert torch.all(o == want), (step, ids, want, o.flatten()[:4])
    for s in range(5):
        cache.remove_sequence(s)
