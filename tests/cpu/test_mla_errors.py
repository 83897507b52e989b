"""MLA calls that must fail: each raises naming the offending value and leaves the cache as it was
(latent dumps and page accounting equal the reference's, which never saw the bad call; a following
forward still matches)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pagedkv import KVCacheConfig, backends, ops
from pagedkv._lib import get_global
from pagedkv.cache import _compile_op_table
from pagedkv.testing.scenarios import ScenarioRunner, add, check, forward
from pagedkv.testing.scenarios_mla import check_mla_state, mla_layer

CFG = KVCacheConfig.mla(num_layers=2, num_heads=3, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                        v_head_dim=48, dtype="float32", page_size=8, max_batch_size=2, max_total_seq_len=32,
                        prefill_chunk_size=24)
MHA = KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64, dtype="float32", page_size=8,
                    max_batch_size=2, max_total_seq_len=32, prefill_chunk_size=24)


@pytest.fixture
def runner(make_cache, gen):
    """An MLA cache holding sequences 0 (10 tokens) and 1 (3 tokens), mirrored by the reference."""
    r = ScenarioRunner(make_cache(CFG, "tir"), gen, 0.13)
    r.run([add(0), add(1), forward({0: 10, 1: 3})], "setup")
    return r


def rejects(r: ScenarioRunner, call, pattern: str, *, in_forward: dict | None = None):
    """``call()`` fails naming ``pattern``; nothing changed; the cache keeps matching the reference."""
    if in_forward:
        r.ref.begin_forward(list(in_forward), list(in_forward.values()))
        r.cache.begin_forward(list(in_forward), list(in_forward.values()))
    with pytest.raises(Exception) as info:
        call()
    assert re.search(pattern, str(info.value)), f"message does not name {pattern!r}: {info.value}"
    if in_forward:  # the rest of the forward the failed call was part of
        r.where = "the forward of the rejected call"
        for layer in range(CFG.num_layers):
            mla_layer(r, layer, sum(in_forward.values()))
        r.cache.end_forward()
        r.ref.end_forward()
    check_mla_state(r.cache, r.ref, "after the rejected call")
    r.run([forward({0: 1, 1: 1}), check()], "forward after the rejected call")


def test_append_mla_kv_bad_shape(runner):
    c = runner.cache
    rejects(runner, lambda: c.append_mla_kv(0, runner.randn(2, 95)), r"kv.*96|95", in_forward={0: 1, 1: 1})
    rejects(runner, lambda: c.append_mla_kv(0, runner.randn(3, 96)), r"\b3\b|\b2\b", in_forward={0: 1, 1: 1})
    rejects(runner, lambda: c.append_mla_kv(2, runner.randn(2, 96)), r"layer 2", in_forward={0: 1, 1: 1})


def test_mla_tensor_arguments(runner):
    """The Python wrapper names a wrong tensor argument (type, dtype) before anything runs."""
    c = runner.cache
    must = "'kv' must be a torch.Tensor of dtype float32 (the cache's dtype) on cpu, got"
    rejects(runner, lambda: c.append_mla_kv(0, None), re.escape(f"append_mla_kv: {must} None"),
            in_forward={0: 1, 1: 1})
    rejects(runner, lambda: c.append_mla_kv(0, runner.randn(2, 96).numpy()),
            re.escape(f"append_mla_kv: {must} numpy.ndarray"), in_forward={0: 1, 1: 1})
    kv = runner.randn(CFG.num_layers, 2, CFG.latent_dim)
    rejects(runner, lambda: c.debug_set_mla_kv(0, 0, kv.to(torch.int32)), re.escape(f"debug_set_mla_kv: {must} int32"))
    rejects(runner, lambda: c.debug_set_mla_kv(0, 0, kv[:, :, :95]), re.escape(
        "debug_set_mla_kv: 'kv' must have shape [num_layers = 2, m, kv_lora_rank + qk_rope_head_dim = 96], "
        "got [2, 2, 95]"))


def test_append_mla_kv_outside_forward(runner):
    rejects(runner, lambda: runner.cache.append_mla_kv(0, runner.randn(2, 96)), "begin_forward")


def test_cross_and_self_attention_bad_dims(runner):
    c = runner.cache
    q_mha = runner.randn(2, 3, 64)  # the non-absorbed q passed to the absorbed call
    rejects(runner, lambda: c.cross_attention(0, q_mha, 0.1), r"'q'", in_forward={0: 1, 1: 1})
    rejects(runner, lambda: c.cross_attention(0, runner.randn(2, 3, 96), 0.1, v_head_dim=48), r"'o'",
            in_forward={0: 1, 1: 1})
    q, k = runner.randn(3, 3, 64), runner.randn(3, 3, 64)
    rejects(runner, lambda: c.self_attention(0, q, k, runner.randn(3, 3, 64), 0.1), r"'v'",
            in_forward={0: 2, 1: 1})


def test_calls_of_the_other_layer_kind(runner, make_cache):
    c = runner.cache
    rejects(runner, lambda: c.attention_with_fused_qkv(0, runner.randn(2, 9, 64), 0.1), "mla",
            in_forward={0: 1, 1: 1})
    rejects(runner, lambda: c.debug_get_kv(0), "debug_get_kv is for mha layers")
    mha = make_cache(MHA, "tir")
    mha.add_sequence(0)
    mha.begin_forward([0], [1])
    with pytest.raises(Exception, match="append_mla_kv is for mla layers; this cache's layers are mha"):
        mha.append_mla_kv(0, torch.randn(1, 96))
    mha.abort_forward()  # no layer wrote k/v, which end_forward rejects


def _table(config):
    res = backends.resolve(config, "llvm", "tir")
    return [list(e) for e in _compile_op_table(config, "llvm", tuple(res.choice.items()))[1]]


def _create(config_json, table):
    import tvm_ffi

    return get_global("pagedkv.create")(config_json, (), table, tvm_ffi.from_dlpack(torch.empty((1,))))


def test_create_rejects_mixed_and_mismatched_tables():
    mla_table, mha_table = _table(CFG), _table(MHA)
    _create(CFG.to_json(), mla_table)  # the right table works
    with pytest.raises(Exception, match="'split_rotary' is not an op of mla layers"):
        _create(CFG.to_json(), mla_table + [e for e in mha_table if e[0] == ops.SPLIT_ROTARY])
    with pytest.raises(Exception, match="'mla_append_kv' is not an op of mha layers"):
        _create(MHA.to_json(), mha_table + [e for e in mla_table if e[0] == ops.MLA_APPEND_KV])
    with pytest.raises(Exception, match="missing op 'mla_attn_decode_paged'"):
        _create(CFG.to_json(), [e for e in mla_table if e[0] != ops.MLA_ATTN_DECODE_PAGED])


@pytest.mark.parametrize("change, pattern", [
    ({"layer_kinds": ["mla", "mha"]}, "one layer kind"),
    ({"schema_version": 1}, "unknown field 'kv_lora_rank' for schema_version 1"),
    ({"rope_mode": "normal"}, "rope_mode 'none'"),
    ({"head_dim": 60}, "head_dim"),
    ({"num_kv_heads": 1}, "num_kv_heads"),
    ({"kv_lora_rank": 0}, "kv_lora_rank >= 1"),
    ({"schema_version": 3, "sliding_window": 64}, "MLA caches take no sliding_window or logits_soft_cap"),
    ({"schema_version": 3, "logits_soft_cap": 30.0}, "MLA caches take no sliding_window or logits_soft_cap"),
])
def test_create_rejects_bad_mla_config(change, pattern):
    d = json.loads(CFG.to_json())
    d.update(change)
    with pytest.raises(Exception, match=pattern):
        _create(json.dumps(d), _table(CFG))
