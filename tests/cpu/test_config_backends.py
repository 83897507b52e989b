"""KVCacheConfig validation and JSON, and backend resolution (explicit, priority list, automatic)."""

from __future__ import annotations

import json

import pytest

import pagedkv
from pagedkv import KVCacheConfig, backends, ops
from pagedkv.backends import Backend, NoBackendError
from pagedkv.config import RUNTIME_FIELDS, SCHEMA_VERSION

BASE = dict(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype="float32")


# -- config ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,fragments", [
    (dict(num_layers=0), ["num_layers must be a positive int, got 0"]),
    (dict(head_dim=-64), ["head_dim must be a positive int, got -64"]),
    (dict(page_size=2.5), ["page_size must be a positive int, got 2.5"]),
    (dict(max_batch_size=0), ["max_batch_size", "got 0"]),
    (dict(num_qo_heads=6, num_kv_heads=4), ["num_qo_heads (6) is not a multiple of num_kv_heads (4)"]),
    (dict(dtype="int8"), ["dtype 'int8'"]),
    (dict(rope_mode="sideways"), ["rope_mode 'sideways'"]),
    (dict(head_dim=63), ["even head_dim, got 63"]),
    (dict(v_head_dim=32), ["v_head_dim"]),
    (dict(layer_kinds=("mha",)), ["layer_kinds has 1 entries for 2 layers"]),
    (dict(layer_kinds=("mha", "xla")), ["unknown layer kinds ['xla']"]),
    (dict(layer_kinds=("mha", "mla")), ["one layer kind", "'mha' at layers [0] and 'mla' at [1]"]),
    (dict(kv_lora_rank=64), ["kv_lora_rank need MLA layers"]),
    (dict(schema_version=8), ["schema_version 8 is outside [1, 7]"]),
    (dict(attention_sinks=True, schema_version=4), ["schema_version 4 is outside [5, 7]"]),
    (dict(attention_sinks=1), ["attention_sinks must be a bool, got 1"]),
    (dict(sink_size=2), ["sink_size 2 needs a sliding_window"]),
    (dict(sink_size=9, sliding_window=8), ["sink_size 9 must be <= sliding_window 8"]),
    (dict(sink_size=-1, sliding_window=8), ["sink_size must be an int >= 0 (0: off), got -1"]),
    (dict(sink_size=2, sliding_window=8, cuda_graph_batch=4), ["sink_size with cuda_graph_batch"]),
    (dict(sink_size=2, sliding_window=8, schema_version=4), ["schema_version 4 is outside [5, 7]"]),
    (dict(cuda_graph_batch=-1), ["cuda_graph_batch must be an int >= 0 (0: off), got -1"]),
    (dict(cuda_graph_batch=True), ["cuda_graph_batch must be an int >= 0"]),
    (dict(cuda_graph_batch=2, max_batch_size=4), ["max_batch_size=4 is larger than cuda_graph_batch=2"]),
    (dict(cuda_graph_batch=4, schema_version=3), ["schema_version 3 is outside [4, 7]"]),
    (dict(sliding_window=-1), ["sliding_window must be an int >= 0 (0: off), got -1"]),
    (dict(sliding_window=2.5), ["sliding_window must be an int >= 0"]),
    (dict(sliding_window=True), ["sliding_window must be an int >= 0"]),
    (dict(logits_soft_cap=-1.0), ["logits_soft_cap must be a finite number >= 0 (0: off), got -1.0"]),
    (dict(logits_soft_cap=float("nan")), ["logits_soft_cap must be a finite number"]),
    (dict(logits_soft_cap=float("inf")), ["logits_soft_cap must be a finite number"]),
    (dict(sliding_window=8, schema_version=2), ["schema_version 2 is outside [3, 7]"]),
    # RoPE's numbers enter every angle: NaN, inf, zero or negative would rotate silently wrong
    (dict(rope_theta=0.0), ["rope_theta must be a finite number > 0, got 0.0"]),
    (dict(rope_theta=-10000.0), ["rope_theta must be a finite number > 0, got -10000.0"]),
    (dict(rope_theta=float("nan")), ["rope_theta must be a finite number > 0, got nan"]),
    (dict(rope_theta=float("inf"), rope_mode="none"), ["rope_theta must be a finite number > 0, got inf"]),
    (dict(rope_theta="1e4"), ["rope_theta must be a finite number > 0, got '1e4'"]),
    (dict(rope_theta=True), ["rope_theta must be a finite number > 0, got True"]),
    (dict(rope_scale=0), ["rope_scale must be a finite number > 0, got 0"]),
    (dict(rope_scale=-0.5), ["rope_scale must be a finite number > 0, got -0.5"]),
    (dict(rope_scale=float("nan")), ["rope_scale must be a finite number > 0, got nan"]),
    (dict(rope_scale=float("-inf")), ["rope_scale must be a finite number > 0, got -inf"]),
    (dict(layer_kinds=("mla", "mla")), ["MLA needs kv_lora_rank >= 1", "MLA needs rope_mode 'none'"]),
    (dict(num_layers=0, dtype="int8", rope_mode="x"), ["num_layers", "'int8'", "rope_mode 'x'"]),  # all reported
])
def test_config_validation(changes, fragments):
    with pytest.raises(ValueError) as info:
        KVCacheConfig(**{**BASE, **changes})
    msg = str(info.value)
    assert msg.startswith("invalid KVCacheConfig: ")
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


def test_config_valid_and_derived():
    cfg = KVCacheConfig(**BASE)
    assert cfg.problems() == []
    assert cfg.group_size == 4 and cfg.v_dim == 64 and cfg.kinds == ("mha", "mha")
    assert cfg.schema_version == 1  # the lowest schema that holds an MHA config
    assert KVCacheConfig(**{**BASE, "rope_mode": "none", "head_dim": 63}).problems() == []  # odd dim: no RoPE
    with pytest.raises(ValueError, match="num_layers"):
        cfg.replace(num_layers=-1)


def _from_dict(d: dict) -> KVCacheConfig:
    d = dict(d)
    d.pop("runtime_fields")
    d["layer_kinds"] = tuple(d["layer_kinds"])
    return KVCacheConfig(**d)


def test_config_json_round_trip():
    cfg = KVCacheConfig(**BASE, rope_mode="inline", rope_theta=5e5, rope_scale=0.25, page_size=8,
                        max_batch_size=3, max_total_seq_len=100, prefill_chunk_size=40)
    text = cfg.to_json()
    d = json.loads(text)
    assert d["schema_version"] == 1 and d["runtime_fields"] == [] and "kv_lora_rank" not in d
    assert d["v_head_dim"] == 64 and d["layer_kinds"] == ["mha", "mha"]
    back = _from_dict(d)
    assert back.to_json() == text
    assert back.to_dict() == cfg.to_dict()
    # v_head_dim and layer_kinds are written out explicitly
    assert back.replace(v_head_dim=None, layer_kinds=None) == cfg


def test_config_runtime_fields():
    cfg = KVCacheConfig(**BASE)
    d = cfg.to_dict(runtime_fields=("max_batch_size", "page_size"))
    assert d["runtime_fields"] == ["max_batch_size", "page_size"]
    assert "max_batch_size" not in d and "page_size" not in d
    with pytest.raises(ValueError, match="'num_layers' cannot be a runtime field"):
        cfg.to_json(runtime_fields=("num_layers",))
    assert set(RUNTIME_FIELDS) >= {"max_batch_size", "page_size"}


#: one small config for every test here that builds kernels (compiled once per session)
SMALL = KVCacheConfig(**BASE, rope_mode="none", page_size=8, max_batch_size=2, max_total_seq_len=32,
                      prefill_chunk_size=24)


def test_runtime_config_json_round_trip():
    """The runtime's effective config (``pagedkv.config_json``) is the one it was given."""
    cfg = SMALL
    cache = pagedkv.create(cfg, backend="tir", target="llvm")
    effective = json.loads(str(cache._call("config_json")))
    expected = cfg.to_dict()
    assert {key: effective.get(key) for key in expected} == expected


def test_runtime_values_fill_runtime_fields():
    """Fields listed in ``runtime_fields`` take their values from ``runtime_values``, in that order."""
    import torch
    import tvm_ffi

    from pagedkv._lib import get_global
    from pagedkv.cache import _compile_op_table

    cfg = SMALL
    _module, table = _compile_op_table(cfg, "llvm", tuple(backends.resolve(cfg, "llvm", "tir").choice.items()))
    text = cfg.to_json(runtime_fields=("max_batch_size", "max_total_seq_len"))
    handle = get_global("pagedkv.create")(text, (5, 64), table, tvm_ffi.from_dlpack(torch.empty(1)))
    effective = json.loads(str(get_global("pagedkv.config_json")(handle)))
    assert effective["max_batch_size"] == 5 and effective["max_total_seq_len"] == 64
    assert effective["runtime_fields"] == []
    assert get_global("pagedkv.get_num_available_pages")(handle) == 64 // 8 + 5


# -- backends -------------------------------------------------------------------------------------------
class RefusingBackend(Backend):
    """Refuses every op, with two reasons naming the op."""

    tag = "refuser"
    ops = ops.OPS

    def validate_configuration(self, op, config, target):
        return [f"refuser cannot do {op}", f"refuser dislikes {config.dtype}"]

    def build(self, op, config, target):  # pragma: no cover - never called for a refusing backend
        raise AssertionError("build called on a backend that refused")


class MergeOnlyBackend(Backend):
    """Serves merge_state only (resolution only; never built)."""

    tag = "mergeonly"
    ops = (ops.MERGE_STATE,)

    def validate_configuration(self, op, config, target):
        return self._unsupported_op(op)

    def build(self, op, config, target):  # pragma: no cover
        raise AssertionError("not built in these tests")


class MisTaggedBackend(RefusingBackend):
    tag = "something-else"


@pytest.fixture
def registry(monkeypatch):
    """Register test backends into a copy of the registry, restored after the test."""
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    monkeypatch.setattr(backends, "_INSTANCES", dict(backends._INSTANCES))

    def register(tag, cls, priority=0):
        backends.register_backend(tag, f"{__name__}:{cls.__name__}", priority=priority, replace=True)

    return register


CFG = KVCacheConfig(**BASE)


def test_resolve_explicit_tir():
    res = backends.resolve(CFG, "llvm", "tir")
    assert res.choice == {op: "tir" for op in ops.ops_for(CFG)}
    assert list(res.choice) == list(ops.ops_for(CFG))
    assert res.reasons == {}
    assert res.report() == ", ".join(f"{op}=tir" for op in ops.ops_for(CFG))
    # a float32 cache's op table leaves out the partial-state ops (its kernels already write float32), and a cache
    # without attention_sinks the sink ops
    left_out = (set(ops.PARTIAL_OPS) | set(ops.SINK_OPS)) & set(ops.OPS_BY_KIND["mha"])
    assert set(ops.OPS_BY_KIND["mha"]) - set(res.choice) == left_out
    half = CFG.replace(dtype="float16", attention_sinks=True)
    assert list(backends.resolve(half, "llvm", "tir").choice) == list(ops.OPS_BY_KIND["mha"])
    assert ops.SINK_OPS[0] in backends.resolve(CFG.replace(attention_sinks=True), "llvm", "tir").choice
    assert backends.resolve(CFG, "llvm", ["tir"]).choice == res.choice


def test_resolve_unknown_tag():
    with pytest.raises(ValueError, match="unknown backend 'nope'.*registered: .*tir"):
        backends.resolve(CFG, "llvm", "nope")
    with pytest.raises(ValueError, match="'nope'"):
        backends.resolve(CFG, "llvm", ["tir", "nope"])


def test_resolve_unknown_op():
    with pytest.raises(ValueError, match="unknown op 'frobnicate'"):
        backends.resolve(CFG, "llvm", "tir", ops=["frobnicate"])


def test_resolve_refusing_backend_lists_reasons(registry):
    registry("refuser", RefusingBackend)
    with pytest.raises(NoBackendError) as info:
        backends.resolve(CFG, "llvm", "refuser")
    msg = str(info.value)
    assert f"op {ops.OPS[0]!r}" in msg and "'llvm'" in msg
    assert f"refuser: refuser cannot do {ops.OPS[0]}; refuser dislikes float32" in msg


def test_no_backend_error_lists_every_backend(registry):
    registry("refuser", RefusingBackend)
    # tir refuses the vulkan target; refuser refuses everything
    with pytest.raises(NoBackendError) as info:
        backends.resolve(CFG, {"kind": "vulkan"}, ["refuser", "tir"])
    msg = str(info.value)
    assert "refuser: refuser cannot do split_rotary; refuser dislikes float32" in msg
    assert "tir: TIR kernels are not scheduled for target kind 'vulkan'" in msg
    assert "'vulkan'" in msg
    # on CUDA, tir names the head dim its attention kernels cannot take
    with pytest.raises(NoBackendError) as info:
        backends.resolve(CFG.replace(head_dim=72), {"kind": "cuda", "arch": "sm_90"}, ["tir"])
    assert "head_dim 72" in str(info.value) and "attn_prefill_ragged" in str(info.value)
    # reasons are listed in the priority order given
    with pytest.raises(NoBackendError) as info:
        backends.resolve(CFG.replace(dtype="bfloat16"), {"kind": "vulkan"}, ["tir", "refuser"])
    msg = str(info.value)
    assert "tir: TIR kernels are not scheduled" in msg and "refuser dislikes bfloat16" in msg
    assert msg.index("tir:") < msg.index("refuser:")


@pytest.mark.parametrize("target", ["llvm", {"kind": "cuda", "arch": "sm_90"}], ids=["llvm", "cuda"])
def test_tir_serves_bfloat16(registry, target):
    """bfloat16 caches (Llama 3, Qwen, DeepSeek-V3 checkpoints) get TIR kernels for every op, MHA and MLA."""
    registry("refuser", RefusingBackend)
    mla = KVCacheConfig.mla(num_layers=1, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, dtype="bfloat16")
    for cfg in (CFG.replace(dtype="bfloat16", head_dim=128), mla):
        res = backends.resolve(cfg, target, ["refuser", "tir"])
        assert set(res.choice.values()) == {"tir"}, res.report()
        assert set(res.choice) == set(ops.ops_for(cfg))


def test_automatic_selection(registry):
    registry("mergeonly", MergeOnlyBackend, priority=100)
    registry("refuser", RefusingBackend, priority=50)
    assert backends.registered_backends()[:2] == ["mergeonly", "refuser"]
    res = backends.resolve(CFG, "llvm")
    assert res.choice == {op: ("mergeonly" if op == ops.MERGE_STATE else "tir") for op in ops.ops_for(CFG)}
    assert "merge_state=mergeonly" in res.report() and "split_rotary=tir" in res.report()
    # the backends passed over for an op are recorded with their reasons (flashinfer's too: not on llvm)
    assert {t: r for t, r in res.reasons["split_rotary"].items() if t != "flashinfer"} == {
        "mergeonly": ["backend 'mergeonly' does not implement op 'split_rotary'"],
        "refuser": ["refuser cannot do split_rotary", "refuser dislikes float32"],
    }
    assert ops.MERGE_STATE not in res.reasons  # served by the first candidate


def test_automatic_selection_creates_cache():
    cache = pagedkv.create(SMALL, target="llvm")
    assert cache.op_backends == cache.resolution.choice
    assert set(cache.op_backends) == set(ops.ops_for(SMALL))
    assert cache.resolution.report() == ", ".join(f"{op}={t}" for op, t in cache.resolution.choice.items())


def test_register_backend_errors(registry):
    with pytest.raises(ValueError, match="non-empty string"):
        backends.register_backend("", "x:Y")
    with pytest.raises(ValueError, match="'module:Class'.*'nocolon'"):
        backends.register_backend("x", "nocolon")
    with pytest.raises(ValueError, match="'tir' is already registered"):
        backends.register_backend("tir", "pagedkv.backends.tir:TIRBackend")
    registry("mistagged", MisTaggedBackend)
    with pytest.raises(ValueError, match="tag 'something-else', registered as 'mistagged'"):
        backends.get_backend("mistagged")


MLA = dict(num_layers=2, num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=48)


def test_mla_config_fields_and_json():
    cfg = KVCacheConfig.mla(**MLA, dtype="float32")
    assert cfg.is_mla and cfg.latent_dim == 96 and cfg.head_dim == 64 and cfg.v_dim == 48
    assert cfg.kinds == ("mla", "mla") and cfg.num_kv_heads == 4 and cfg.rope_mode == "none"
    d = json.loads(cfg.to_json())
    assert d["schema_version"] == 2 and SCHEMA_VERSION == 7
    assert (d["kv_lora_rank"], d["qk_nope_head_dim"], d["qk_rope_head_dim"]) == (64, 32, 32)
    assert _from_dict(d) == cfg
    with pytest.raises(ValueError, match=r"MLA head_dim \(60\) must be qk_nope_head_dim"):
        cfg.replace(head_dim=60)
    with pytest.raises(ValueError, match="MLA num_kv_heads"):
        cfg.replace(num_kv_heads=1)
    with pytest.raises(ValueError, match="rope_mode 'none'"):
        cfg.replace(rope_mode="normal")
    with pytest.raises(ValueError, match="schema_version 1 is outside"):
        cfg.replace(schema_version=1)
    with pytest.raises(ValueError, match="MLA caches take no sliding_window or logits_soft_cap"):
        cfg.replace(sliding_window=8)
    with pytest.raises(ValueError, match="MLA caches take no sliding_window or logits_soft_cap"):
        cfg.replace(logits_soft_cap=30.0)
    with pytest.raises(ValueError, match="cuda_graph_batch is not supported for MLA caches"):
        cfg.replace(cuda_graph_batch=4)


def test_attention_options_schema_and_json():
    """The options need schema 3; a config without them keeps its lower schema (old runtimes load it)."""
    plain = KVCacheConfig(**BASE)
    assert plain.schema_version == 1 and "sliding_window" not in json.loads(plain.to_json())
    windowed = plain.replace(sliding_window=4096)
    capped = plain.replace(logits_soft_cap=50.0)
    assert windowed.schema_version == capped.schema_version == 3
    assert windowed.replace(sliding_window=0).schema_version == 1  # back to the lowest
    d = json.loads(windowed.replace(logits_soft_cap=30).to_json())
    assert (d["sliding_window"], d["logits_soft_cap"]) == (4096, 30.0)
    assert _from_dict(d).to_dict() == windowed.replace(logits_soft_cap=30.0).to_dict()
    # an explicit newer schema is kept, with the options' defaults written out
    d = json.loads(plain.replace(schema_version=3).to_json())
    assert (d["schema_version"], d["sliding_window"], d["logits_soft_cap"]) == (3, 0, 0.0)


def test_cuda_graph_batch_schema_and_json():
    """cuda_graph_batch needs schema 4; configs without it keep their lower schema."""
    graph = KVCacheConfig(**BASE).replace(cuda_graph_batch=8)
    assert graph.schema_version == 4 < SCHEMA_VERSION
    d = json.loads(graph.to_json())
    assert d["cuda_graph_batch"] == 8 and _from_dict(d).to_dict() == graph.to_dict()
    assert graph.replace(cuda_graph_batch=0).schema_version == 1
    assert "cuda_graph_batch" not in json.loads(graph.replace(cuda_graph_batch=0).to_json())


def test_attention_sinks_schema_and_json():
    """attention_sinks needs schema 5, MHA and MLA; configs without it keep their lower schema, and
    their JSON has no such key (libraries compiled with them load in older runtimes)."""
    sinks = KVCacheConfig(**BASE).replace(attention_sinks=True)
    assert sinks.schema_version == 5 < SCHEMA_VERSION
    d = json.loads(sinks.to_json())
    assert d["attention_sinks"] is True and _from_dict(d).to_dict() == sinks.to_dict()
    assert sinks.replace(attention_sinks=False).schema_version == 1
    assert "attention_sinks" not in json.loads(sinks.replace(attention_sinks=False).to_json())
    mla = KVCacheConfig.mla(num_layers=1, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=16, attention_sinks=True)
    assert mla.schema_version == 5 and ops.APPLY_SINKS in ops.ops_for(mla)
    assert KVCacheConfig.from_dict(d) == sinks
    with pytest.raises(TypeError, match="attention_sinks must be a bool"):
        KVCacheConfig.from_dict({**d, "attention_sinks": 1})
    with pytest.raises(ValueError, match=r"keys \['attention_sinks', 'sink_size'\] need schema_version >= 5"):
        KVCacheConfig.from_dict({**d, "schema_version": 4})
    tokens = KVCacheConfig(**BASE, sliding_window=64, sink_size=4)
    assert tokens.schema_version == 5 and KVCacheConfig.from_json(tokens.to_json()) == tokens
    assert tokens.replace(sink_size=0).schema_version == 3
