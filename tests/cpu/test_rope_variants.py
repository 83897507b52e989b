"""RoPE variants in the cache's own rotation (issue 45 item 4): ``pagedkv.rope_spec``, its float64 reference
(``pagedkv.testing.reference_rope``, checked against transformers), the CPU kernels (``split_rotary`` and inline
attention) against the reference, the runtime's LongRoPE switch and linear factor through a cache, the config's
refusals and the backends' reasons. The CUDA kernels (emulated): ``test_rope_cuda_emulated.py``.

Tiny shapes (head dim 32, float32; relative error ``|out - ref| / |ref|`` < 1e-5): three variant specs cover every
feature: llama3 (whole head, halves), yarn (rotary_dim 16: pass-through dims, attention factor) and longrope
(rotary_dim 16, interleaved pairs, two sets, attention factor).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np
import pytest
import torch

import tvm

from pagedkv import KVCacheConfig
from pagedkv import tir_kernels as tk
from pagedkv.backends.flashinfer import FlashInferBackend
from pagedkv.backends.tir import TIRBackend
from pagedkv.rope_spec import RopeSpec, attention_factor, hf_rope_fields, inv_freq, rope_table
from pagedkv.testing.reference_ops import attention
from pagedkv.testing.reference_rope import ref_attention_factor, ref_inv_freq, rope_variant

D, THETA, HQ, HKV = 32, 10000.0, 4, 2
TARGET = tk.host_target()
LONG_OMAX = 24
VARIANTS = {
    "llama3": RopeSpec(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64),  # wavelengths 6..3.5e4: all three llama3 regions
    "yarn_partial": RopeSpec(rope_type="yarn", rotary_dim=16, factor=4.0, original_max_position_embeddings=64),
    "longrope_interleaved": RopeSpec(rope_type="longrope", rotary_dim=16, interleaved=True, factor=4.0,
                                     original_max_position_embeddings=LONG_OMAX,
                                     short_factor=tuple(1 + 0.1 * i for i in range(8)),
                                     long_factor=tuple(1 + 0.7 * i for i in range(8))),
}


def _rel(out, ref) -> float:
    out = torch.as_tensor(np.asarray(out, dtype=np.float64))
    return float((out - ref).abs().max() / ref.abs().max())


def _sets(spec):
    """(apply_rope, long) pairs a spec's kernels take: LongRoPE's two sets, one set otherwise."""
    return [(1, False), (2, True)] if spec.rope_type == "longrope" else [(1, False)]


@functools.lru_cache(maxsize=None)
def _kernel(op: str, spec: RopeSpec, dtype: str = "float32"):
    ks = tk.KernelSpec(HQ, HKV, D, dtype=dtype, rope=rope_table(spec, D, THETA, 1.0))
    lib = tvm.compile(tvm.IRModule({f"pagedkv_{op}": tk.FACTORIES[op](ks, TARGET)}), target=TARGET)
    return lib[f"pagedkv_{op}"]


# ---------------------------------------------------------------------------------------------------------
# the reference against transformers
# ---------------------------------------------------------------------------------------------------------
def _llama(rope_scaling, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=D, rope_theta=THETA, rope_scaling=rope_scaling,
                       **kw)


def _phi3(seq_len_long: bool):
    from transformers import Phi3Config

    cfg = Phi3Config(hidden_size=128, num_attention_heads=4, rope_theta=THETA, max_position_embeddings=4 * LONG_OMAX,
                     original_max_position_embeddings=LONG_OMAX,
                     rope_scaling={"type": "longrope", "short_factor": [1 + 0.1 * i for i in range(16)],
                                   "long_factor": [1 + 0.7 * i for i in range(16)]})
    return cfg, (LONG_OMAX + 1 if seq_len_long else None)


HF_CASES = {
    "llama3": lambda: (_llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}), None),
    "yarn": lambda: (_llama({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), None),
    "yarn_gpt_oss": lambda: (_llama({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64}), None),
    "yarn_deepseek": lambda: (_llama({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                                      "original_max_position_embeddings": 64}), None),
    "linear_partial": lambda: (_llama({"rope_type": "linear", "factor": 4.0}, partial_rotary_factor=0.5), None),
    "longrope_short": lambda: _phi3(False),
    "longrope_long": lambda: _phi3(True),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_reference_frequencies_match_transformers(case):
    """``ref_inv_freq`` / ``ref_attention_factor`` (and the kernels' host table, ``rope_spec.inv_freq``) equal
    transformers' ``ROPE_INIT_FUNCTIONS`` (evaluated in float32 there) for each rope_type, the spec built by
    ``hf_rope_fields``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg, seq_len = HF_CASES[case]()
    fields = hf_rope_fields(cfg)
    spec, theta = fields["rope"], fields["rope_theta"]
    assert spec.rope_type == case.split("_")[0] and theta == THETA
    hf_freq, hf_af = ROPE_INIT_FUNCTIONS[spec.rope_type](cfg, "cpu", seq_len=seq_len)
    long = seq_len is not None
    ref = ref_inv_freq(spec, D, theta, long=long)  # every case has 4 heads of 32
    assert ref.shape == hf_freq.shape
    assert _rel(hf_freq.double(), ref) < 1e-6
    assert _rel(inv_freq(spec, D, theta, long=long), ref) < 1e-12
    assert math.isclose(ref_attention_factor(spec), hf_af, rel_tol=1e-6)
    assert math.isclose(attention_factor(spec), hf_af, rel_tol=1e-12)


def test_reference_rotation_matches_transformers_models():
    """The reference's rotation equals transformers' models' own: Llama (llama3, yarn: cos / sin with the
    attention factor, rotate_half), Phi-3 (longrope below and past the switch), GPT-NeoX (partial rotary_dim,
    halves) and GPT-J (partial rotary_dim, interleaved pairs)."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox import modeling_gpt_neox as neox
    from transformers.models.gptj import modeling_gptj as gptj
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.phi3 import modeling_phi3 as phi3

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 40, D, generator=gen)  # [batch, heads, tokens, D]
    pos = torch.arange(40)[None] * 3  # positions past LONG_OMAX too

    def ours(cfg, p=pos):
        f = hf_rope_fields(cfg)
        return rope_variant(x[0].transpose(0, 1), p[0], f["rope_theta"], 1.0, f["rope"],
                            long=int(p.max()) + 1 > (f["rope"].original_max_position_embeddings or 1e9)).transpose(0, 1)

    for name, module in (("llama3", llama), ("yarn_deepseek", llama), ("longrope_short", phi3)):
        cfg = HF_CASES[name]()[0]
        for p in (pos, pos[:, :8]):  # phi3: past original_max_position_embeddings, then below it
            emb = (phi3.Phi3RotaryEmbedding if module is phi3 else llama.LlamaRotaryEmbedding)(cfg)
            cos, sin = emb(x, p)
            want = module.apply_rotary_pos_emb(x[:, :, :p.shape[1]], x[:, :, :p.shape[1]], cos, sin)[0]
            got = rope_variant(x[0, :, :p.shape[1]].transpose(0, 1), p[0], THETA, 1.0, hf_rope_fields(cfg)["rope"],
                               long=int(p.max()) + 1 > LONG_OMAX and module is phi3).transpose(0, 1)
            assert _rel(want[0].double(), got) < 1e-5, name
    nx = GPTNeoXConfig(hidden_size=128, num_attention_heads=4, rotary_pct=0.5, rope_theta=THETA)
    assert hf_rope_fields(nx)["rope"] == RopeSpec(rotary_dim=16)
    cos, sin = neox.GPTNeoXRotaryEmbedding(nx)(x, pos)
    assert _rel(neox.apply_rotary_pos_emb(x, x, cos, sin)[0][0].double(), ours(nx)) < 1e-5
    sincos = gptj.create_sinusoidal_positions(200, 16)[pos]  # GPT-J: rotary_dim 16, theta 10000, interleaved
    sin, cos = torch.split(sincos, 8, dim=-1)
    xt = x.transpose(1, 2)  # [batch, tokens, heads, D], as GPT-J's attention rotates it
    want = torch.cat([gptj.apply_rotary_pos_emb(xt[..., :16], sin, cos), xt[..., 16:]], dim=-1).transpose(1, 2)
    spec = RopeSpec(rotary_dim=16, interleaved=True)
    assert _rel(want[0].double(), rope_variant(x[0].transpose(0, 1), pos[0], THETA, 1.0, spec).transpose(0, 1)) < 1e-5


# ---------------------------------------------------------------------------------------------------------
# the CPU kernels against the reference
# ---------------------------------------------------------------------------------------------------------
def _split_rotary(spec, apply_rope, qkv, pos):
    outs = [tvm.runtime.tensor(np.full((qkv.shape[0], h, D), np.nan, np.float32)) for h in (HQ, HKV, HKV)]
    _kernel("split_rotary", spec)(tvm.runtime.tensor(qkv), tvm.runtime.tensor(pos), *outs, apply_rope, 1.0, THETA)
    return [o.numpy() for o in outs]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_split_rotary_cpu(name):
    spec = VARIANTS[name]
    rng = np.random.default_rng()
    qkv = rng.standard_normal((11, HQ + 2 * HKV, D)).astype(np.float32)
    pos = rng.integers(0, 3 * LONG_OMAX, 11).astype(np.int32)
    for apply_rope, long in _sets(spec):
        q, k, v = _split_rotary(spec, apply_rope, qkv, pos)
        for out, part in ((q, qkv[:, :HQ]), (k, qkv[:, HQ:HQ + HKV])):
            assert _rel(out, rope_variant(torch.from_numpy(part), pos, THETA, 1.0, spec, long=long)) < 1e-5, name
            r = spec.rotary_dim or D
            assert np.array_equal(out[..., r:], part[..., r:])  # the dims past rotary_dim pass through exactly
        assert np.array_equal(v, qkv[:, HQ + HKV:])
    q0, _k, _v = _split_rotary(spec, 0, qkv, pos)  # apply_rope 0: a plain copy
    assert np.array_equal(q0, qkv[:, :HQ])


def test_attention_factor_applied_once():
    """A rotation keeps each pair's norm, so the rotated dims' norm is exactly the attention factor times the
    input's: the kernel's and the reference's ratio is yarn's factor (1.139 here), not 1 (dropped) nor its square
    (applied to q and k twice)."""
    spec = VARIANTS["yarn_partial"]
    af = attention_factor(spec)
    assert 1.1 < af < 1.2
    qkv = np.random.default_rng().standard_normal((5, HQ + 2 * HKV, D)).astype(np.float32)
    pos = np.arange(5, dtype=np.int32) * 7
    q, _k, _v = _split_rotary(spec, 1, qkv, pos)
    ref = rope_variant(torch.from_numpy(qkv[:, :HQ]), pos, THETA, 1.0, spec)
    for out in (q, ref.numpy()):
        ratio = np.linalg.norm(out[..., :16], axis=-1) / np.linalg.norm(qkv[:, :HQ, :16], axis=-1)
        assert np.allclose(ratio, af, rtol=1e-5), ratio


def test_interleaved_and_halves_differ():
    """The pairing is not a relabeling the tests would miss: halves and interleaved rotations of one input differ,
    and each kernel matches its own reference only."""
    il = VARIANTS["longrope_interleaved"]
    halves = dataclasses.replace(il, interleaved=False)
    qkv = np.random.default_rng().standard_normal((4, HQ + 2 * HKV, D)).astype(np.float32)
    pos = np.arange(4, dtype=np.int32) * 5 + 3
    for spec, other in ((il, halves), (halves, il)):
        q = _split_rotary(spec, 1, qkv, pos)[0]
        part = torch.from_numpy(qkv[:, :HQ])
        assert _rel(q, rope_variant(part, pos, THETA, 1.0, spec)) < 1e-5
        assert _rel(q, rope_variant(part, pos, THETA, 1.0, other)) > 0.1


@pytest.mark.parametrize("name", list(VARIANTS))
def test_inline_attention_cpu(name):
    """``attn_prefill_ragged`` with inline RoPE (apply_rope 1, and 2 for LongRoPE's long set): q at their
    positions, keys at ``k_pos_offset + j``, causal, two entries."""
    spec = VARIANTS[name]
    rng = np.random.default_rng()
    ql, kl, off = [5, 3], [9, 3], [40, 100]
    q = rng.standard_normal((8, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((12, HKV, D)).astype(np.float32) for _ in range(2))
    qi, ki = np.array([0, 5, 8], np.int32), np.array([0, 9, 12], np.int32)
    qpos = np.concatenate([off[b] + kl[b] - ql[b] + np.arange(ql[b]) for b in range(2)]).astype(np.int32)
    sm = D ** -0.5
    for apply_rope, long in _sets(spec):
        o = tvm.runtime.tensor(np.full((8, HQ, D), np.nan, np.float32))
        lse = tvm.runtime.tensor(np.full((8, HQ), np.nan, np.float32))
        args = [tvm.runtime.tensor(a) for a in (q, k, v, qi, ki, qpos, np.array(off, np.int32))]
        _kernel("attn_prefill_ragged", spec)(*args, o, lse, 1, apply_rope, 1.0, THETA, sm)
        for b in range(2):
            rot = functools.partial(rope_variant, theta=THETA, scale=1.0, spec=spec, long=long)
            rq = rot(torch.from_numpy(q[qi[b]:qi[b + 1]]), qpos[qi[b]:qi[b + 1]])
            rk = rot(torch.from_numpy(k[ki[b]:ki[b + 1]]), off[b] + np.arange(kl[b]))
            ro, rl = attention(rq, rk, torch.from_numpy(v[ki[b]:ki[b + 1]]).double(), sm, True)
            assert _rel(o.numpy()[qi[b]:qi[b + 1]], ro) < 1e-5, (name, apply_rope, b)
            assert np.allclose(lse.numpy()[qi[b]:qi[b + 1]], rl.numpy(), atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# through a cache: the runtime's LongRoPE switch and linear factor
# ---------------------------------------------------------------------------------------------------------
def _scenario_config(rope_mode: str, rope: RopeSpec) -> KVCacheConfig:
    return KVCacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype="float32",
                         rope_mode=rope_mode, rope_theta=THETA, rope=rope, page_size=8, max_batch_size=2,
                         max_total_seq_len=96, prefill_chunk_size=32)


@pytest.mark.parametrize("rope_mode", ["normal", "inline"])
def test_cache_longrope_switches_per_forward(rope_mode):
    """Forwards below ``original_max_position_embeddings`` (24) rotate with the short factors, a forward whose
    longest sequence passes it (and every later one) with the long ones: "normal" keeps earlier keys as stored,
    "inline" rotates every key with the forward's set (the reference does both, ``ReferenceCache._rope_long``)."""
    import pagedkv
    from pagedkv.testing.scenarios import ScenarioRunner, add, check, forward

    cache = pagedkv.create(_scenario_config(rope_mode, VARIANTS["longrope_interleaved"]), backend="tir", poison=True)
    runner = ScenarioRunner(cache, torch.Generator().manual_seed(1), D ** -0.5)
    runner.run([add(0), add(1), forward({0: 10}), forward({0: 1, 1: 5}), check(), forward({0: 16}),
                forward({0: 1, 1: 1}), check()], f"longrope {rope_mode}")


def test_cache_linear_scales_positions():
    """"linear" runs the plain kernels with ``rope_scale / factor`` from the runtime (no table): the kernels of
    ``testing.shapes.SHAPES[0]`` (4 / 4 heads x 64, float32), which the kernel cache holds from the scenario tests."""
    import pagedkv
    from pagedkv.testing.scenarios import ScenarioRunner, add, check, forward

    cfg = dataclasses.replace(_scenario_config("normal", RopeSpec(rope_type="linear", factor=4.0)), num_kv_heads=4,
                              head_dim=64)
    assert tk.KernelSpec.from_config(cfg) == tk.KernelSpec(4, 4, 64, dtype="float32")
    runner = ScenarioRunner(pagedkv.create(cfg, backend="tir", poison=True), torch.Generator().manual_seed(2),
                            64 ** -0.5)
    runner.run([add(0), forward({0: 12}), forward({0: 1}), check()], "linear")


# ---------------------------------------------------------------------------------------------------------
# the config: fields, schema, refusals with reasons; the backends' reasons
# ---------------------------------------------------------------------------------------------------------
BASE = dict(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)


@pytest.mark.parametrize("rope, reason", [
    (RopeSpec(rotary_dim=15), "rotary_dim 15 is odd"),
    (RopeSpec(rotary_dim=34), "rotary_dim 34 is larger than head_dim 32"),
    (RopeSpec(rotary_dim=-2), "rotary_dim must be an int >= 0"),
    (RopeSpec(rope_type="dynamic", factor=2.0), "unknown rope_type 'dynamic'; the cache rotates default, linear"),
    (RopeSpec(rope_type="llama3", factor=8.0), "rope_type 'llama3' needs low_freq_factor, high_freq_factor, "
                                               "original_max_position_embeddings"),
    (RopeSpec(rope_type="yarn", original_max_position_embeddings=64), "rope_type 'yarn' needs factor"),
    (RopeSpec(rope_type="linear"), "rope_type 'linear' needs factor"),
    (RopeSpec(rope_type="linear", factor=2.0, beta_fast=32.0), "rope_type 'linear' takes no beta_fast"),
    (RopeSpec(rope_type="linear", factor=0.0), "factor must be a finite number > 0, got 0.0"),
    (RopeSpec(rope_type="yarn", factor=float("nan"), original_max_position_embeddings=8), "factor must be a finite"),
    (dataclasses.replace(VARIANTS["llama3"], high_freq_factor=1.0), "llama3 needs high_freq_factor > low_freq_factor"),
    (dataclasses.replace(VARIANTS["longrope_interleaved"], long_factor=(1.0,) * 7), "long_factor has 7 entries; "
                                                                                    "rotary_dim 16 has 8 pairs"),
    (dataclasses.replace(VARIANTS["longrope_interleaved"], factor=None), "longrope needs factor"),
    (dataclasses.replace(VARIANTS["longrope_interleaved"], short_factor=(1.0,) * 7 + (-1.0,)), "short_factor must "
                                                                                               "be a list"),
])
def test_config_refuses_bad_rope(rope, reason):
    with pytest.raises(ValueError, match=re.escape(f"rope: {reason}")):
        KVCacheConfig(**BASE, rope=rope)


def test_config_rope_schema_and_json():
    """A variant needs schema 6 and round-trips through JSON (older configs keep their schema and load as
    before); a whole-head rotary_dim is stored as 0; a schema-5 config naming ``rope`` is refused; longrope with
    CUDA graphs is refused (its switch is a per-forward argument)."""
    plain = KVCacheConfig(**BASE)
    assert plain.schema_version == 1 and plain.rope.is_default and "rope" not in plain.to_dict()
    assert plain.replace(rope=RopeSpec(rotary_dim=D)).schema_version == 1
    for spec in VARIANTS.values():
        cfg = plain.replace(rope=spec)
        assert cfg.schema_version == 6 and KVCacheConfig.from_json(cfg.to_json()) == cfg
    d = plain.replace(rope=VARIANTS["llama3"]).to_dict()
    assert d["rope"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match=r"keys \['rope'\] need schema_version >= 6"):
        KVCacheConfig.from_dict({**d, "schema_version": 5})
    with pytest.raises(ValueError, match=r"unknown RoPE fields \['beta'\]"):
        KVCacheConfig.from_dict({**d, "rope": {"rope_type": "yarn", "beta": 1}})
    with pytest.raises(ValueError, match="longrope' with cuda_graph_batch is not supported"):
        plain.replace(rope=VARIANTS["longrope_interleaved"], cuda_graph_batch=1)


def test_hf_rope_fields_reach_the_llama_model():
    """A Llama 3.1 config's llama3 scaling reaches the cache of ``pagedkv.models.llama`` (through
    ``apps.smollm2.llama_config``); an HF rope_type the cache does not rotate is refused with the reason."""
    from pagedkv.apps.smollm2 import llama_config

    hf = _llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 64}, vocab_size=64, intermediate_size=64, num_hidden_layers=1)
    cfg = llama_config(hf).kv_cache_config("float32")
    assert cfg.rope == VARIANTS["llama3"] and cfg.rope_theta == THETA and cfg.schema_version == 6
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not rotated by the cache"):
        hf_rope_fields(_llama({"rope_type": "dynamic", "factor": 2.0}))


def test_backends_say_why():
    """CUDA inline RoPE pairs the halves of the whole head: the TIR backend serves every rope_type so (the lanes
    decode and the SIMT prefill take the table; the kernel table says why tc / staged do not) and refuses a partial
    rotary_dim or interleaved pairs with the reason ("normal" serves them); FlashInfer's own RoPE has none of the
    variants. The CPU serves both modes."""
    from pagedkv import kernel_table

    cuda = {"kind": "cuda", "arch": "sm_90a"}
    cfg = KVCacheConfig(**BASE, dtype="float16", rope_mode="inline", rope=VARIANTS["yarn_partial"])
    tir = TIRBackend()
    why = tir.validate_configuration("attn_decode_paged", cfg, cuda)
    assert any("has no inline RoPE for rotary_dim 16" in r and "rope_mode 'normal'" in r for r in why)
    interleaved = cfg.replace(rope=RopeSpec(interleaved=True))
    assert any("for interleaved pairs" in r for r in tir.validate_configuration("attn_prefill_paged", interleaved, cuda))
    assert not tir.validate_configuration("attn_decode_paged", cfg.replace(rope_mode="normal"), cuda)
    assert not tir.validate_configuration("split_rotary", cfg, cuda)
    assert not tir.validate_configuration("attn_decode_paged", cfg, "llvm")
    for rope in (RopeSpec(rope_type="linear", factor=2.0), VARIANTS["llama3"]):  # plain kernels / the lanes' table
        assert not tir.validate_configuration("attn_decode_paged", cfg.replace(rope=rope), cuda)
    spec = dataclasses.replace(tk.KernelSpec.from_config(cfg.replace(rope=VARIANTS["llama3"])), target_arch="sm_90a")
    choice = kernel_table.choose("attn_decode_paged", spec, rope=True)
    assert choice.name == "lanes" and "inline RoPE of a RoPE variant" in choice.explain()
    fi = FlashInferBackend().validate_configuration("attn_decode_paged", cfg, cuda)
    assert any("no rope_type 'yarn'" in r for r in fi) and any("not rotary_dim 16" in r for r in fi)


def test_runtime_writes_rope_back():
    """The runtime's effective config (``pagedkv.config_json``) keeps the variant, and so the config."""
    import pagedkv

    cfg = _scenario_config("inline", VARIANTS["longrope_interleaved"])
    cache = pagedkv.create(cfg, backend="tir")
    assert KVCacheConfig.from_json(str(cache._call("config_json"))) == cfg
