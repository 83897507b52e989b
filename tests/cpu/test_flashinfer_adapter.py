"""The runtime's "flashinfer" adapter for attn_decode_paged (src/flashinfer_adapter.cc), on the CPU with
stand-in plan/run functions: plan runs once per forward and decode pass (in begin_forward, not per layer),
run once per layer and pass with that pass's plan info, both with exactly the pinned 0.7.4 argument counts
(``pagedkv.flashinfer.abi``), the scale passed through and flashinfer's "off" values for window and
soft-cap. Numerics need the GPU (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from pagedkv import KVCacheConfig
from pagedkv._lib import get_global
from pagedkv.cache import KVCache, _compile_op_table, _to_ffi
from pagedkv.flashinfer import abi


@pytest.fixture
def fake_cache():
    import tvm_ffi

    cfg = KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
                        page_size=4, max_batch_size=2, max_total_seq_len=64, prefill_chunk_size=16,
                        rope_scale=2.0, rope_theta=5000.0)
    ops = ["split_rotary", "append_kv", "gather_kv", "attn_prefill_ragged", "attn_prefill_paged",
           "attn_decode_paged", "merge_state", "copy_page", "compact_copy"]
    module, table = _compile_op_table(cfg, "llvm", tuple((op, "tir") for op in ops))
    calls = {"plan": [], "run": []}

    # Tensor arguments may be views of the caller's stack (DLTensor*): read them during the call.
    def record(abi_func, args):
        named = dict(zip((n for n, _ in abi_func.args), args))
        for name, typ in abi_func.args:
            if name in ("indptr", "paged_k_cache", "paged_v_cache"):
                t = named[name]  # a borrowed view: no dlpack export (it has no owner), read it here
                named[name] = (tuple(t.shape), tuple(t.strides), t.data_ptr(),
                               t.numpy().tolist() if name == "indptr" else None)
            elif typ == "Array<int>":
                named[name] = list(named[name])
        return len(args), named

    def plan(*args):
        calls["plan"].append(record(abi.DECODE_PLAN, args))
        return [1000 + len(calls["plan"])]  # a distinct plan info per plan call

    def run(*args):
        calls["run"].append(record(abi.DECODE_RUN, args))

    table = [e if e[0] != "attn_decode_paged" else ["attn_decode_paged", "flashinfer",
                                                     tvm_ffi.convert(plan), tvm_ffi.convert(run)]
             for e in table]
    ref = torch.empty((1,), dtype=torch.float32)
    handle = get_global("pagedkv.create")(cfg.to_json(), (), table, _to_ffi(ref))
    cache = KVCache(handle, cfg, torch.device("cpu"), None, keepalive=module)
    assert cache.op_backends["attn_decode_paged"] == "flashinfer"
    return cache, cfg, calls


def _step(cache, cfg, ids, lengths, sm_scale):
    cache.begin_forward(ids, lengths)
    n = sum(lengths)
    for layer in range(cfg.num_layers):
        qkv = torch.randn(n, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        cache.attention_with_fused_qkv(layer, qkv, sm_scale)
    cache.end_forward()


def test_plan_per_forward_and_pass_run_per_layer(fake_cache):
    cache, cfg, calls = fake_cache
    cache.add_sequence(0)
    _step(cache, cfg, [0], [6], 0.25)  # prefill: no decode plan
    assert calls == {"plan": [], "run": []}
    cache.add_sequence(1)
    _step(cache, cfg, [1], [3], 0.25)
    for step in range(2):
        _step(cache, cfg, [0, 1], [1, 1], 0.125)  # decode: one pass, two entries
        assert len(calls["plan"]) == step + 1, "plan once per forward, not per layer"
        assert len(calls["run"]) == cfg.num_layers * (step + 1)

    # page_indptr per step: 7 and 4 tokens at page size 4 are 2 + 1 pages, then 8 and 5 tokens 2 + 2
    for (count, named), indptr in zip(calls["plan"], ([0, 2, 3], [0, 2, 4])):
        assert count == abi.DECODE_PLAN.num_args
        assert named["batch_size"] == 2
        assert (named["num_qo_heads"], named["num_kv_heads"], named["page_size"]) == (4, 2, 4)
        assert (named["head_dim_qk"], named["head_dim_vo"]) == (16, 16)
        assert named["window_left"] == -1 and named["logits_soft_cap"] == 0.0
        assert named["enable_cuda_graph"] is False
        assert named["indptr"][3] == indptr  # the host array
    for i, (count, named) in enumerate(calls["run"]):
        assert count == abi.DECODE_RUN.num_args
        assert named["plan_info_vec"] == [1001 + i // cfg.num_layers]
        assert named["sm_scale"] == 0.125
        assert named["kv_layout_code"] == 1 and named["window_left"] == -1
        assert named["logits_soft_cap"] == 0.0 and named["maybe_alibi_slopes"] is None
        # pagedkv's angle p * rope_scale / theta^(2i/D) is flashinfer's p * rcp_scale * rcp_theta^(2i/D)
        assert named["rope_rcp_scale"] == 2.0 and named["rope_rcp_theta"] == pytest.approx(1 / 5000.0)
        (k_shape, k_stride, k_ptr, _), (v_shape, v_stride, v_ptr, _) = named["paged_k_cache"], named["paged_v_cache"]
        assert k_shape == v_shape and k_shape[1:] == (2, 4, 16)  # HND: [pages, Hkv, page_size, D]
        assert k_stride == v_stride == (2 * 2 * 4 * 16, 4 * 16, 16, 1)  # K and V interleaved per page
        assert v_ptr - k_ptr == 2 * 4 * 16 * 4  # V follows K inside each page (float32)


def test_decode_pass_grouping_shared_prefix_goes_to_prefill(fake_cache):
    cache, cfg, calls = fake_cache
    cache.add_sequence(0)
    _step(cache, cfg, [0], [8], 0.25)
    cache.fork_sequence(0, 1)
    _step(cache, cfg, [0, 1], [1, 1], 0.25)
    # The shared 8-token prefix is one entry of two queries (attn_prefill_paged); only the own pass is a
    # decode pass, planned once.
    assert len(calls["plan"]) == 1
    assert len(calls["run"]) == cfg.num_layers
