"""The model configs (``LlamaConfig``, ``DeepseekV3Config``) refuse fields out of range when constructed (issue 44:
config floats finite and in range): a NaN ``rope_theta`` or a negative ``rms_norm_eps`` would otherwise compile and
give plausible numbers, a zero dim fail far from its cause."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pagedkv.models.deepseek_v3_params import DeepseekV3Config
from pagedkv.models.llama_params import LlamaConfig

LLAMA = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)
DEEPSEEK = DeepseekV3Config(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16, q_lora_rank=24)
BAD_FLOATS = [math.nan, math.inf, -1.0, 0.0, "1e4", True]


@pytest.mark.parametrize("cfg", [LLAMA, DEEPSEEK], ids=["llama", "deepseek"])
@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps"])
@pytest.mark.parametrize("bad", BAD_FLOATS, ids=repr)
def test_float_fields_must_be_finite_and_positive(cfg, field, bad):
    with pytest.raises(ValueError, match=rf"{type(cfg).__name__}\.{field} must be a finite number > 0"):
        dataclasses.replace(cfg, **{field: bad})


@pytest.mark.parametrize(("cfg", "field", "bad"), [
    (LLAMA, "vocab_size", 0), (LLAMA, "head_dim", -16), (LLAMA, "num_key_value_heads", 2.0),
    (LLAMA, "sliding_window", -1), (DEEPSEEK, "kv_lora_rank", 0), (DEEPSEEK, "v_head_dim", None),
    (DEEPSEEK, "q_lora_rank", 0), (DEEPSEEK, "qk_nope_head_dim", -1)])
def test_dims_must_be_ints_in_range(cfg, field, bad):
    with pytest.raises(ValueError, match=rf"{type(cfg).__name__}\.{field} must be an int >= [01]"):
        dataclasses.replace(cfg, **{field: bad})


def test_valid_configs_and_gqa_multiple():
    assert dataclasses.replace(LLAMA, sliding_window=0, rope_theta=500000).rope_theta == 500000
    assert dataclasses.replace(DEEPSEEK, q_lora_rank=None, qk_nope_head_dim=0).q_lora_rank is None
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads=3"):
        dataclasses.replace(LLAMA, num_key_value_heads=3)


DECODER = LLAMA.decoder_config()


@pytest.mark.parametrize(("field", "bad", "message"), [
    ("hidden_act", "relu", "hidden_act must be one of"), ("attn_logit_softcap", -1.0, "attn_logit_softcap must be"),
    ("final_logit_softcap", math.nan, "final_logit_softcap must be"), ("sm_scale", "0.1", "sm_scale must be"),
    ("embedding_multiplier", 0.0, "embedding_multiplier must be a finite number > 0"),
    ("num_key_value_heads", 3, "num_attention_heads=4 is not a multiple of num_key_value_heads=3")])
def test_decoder_config_fields_are_checked(field, bad, message):
    """The shared decoder's options (``DecoderConfig``) refuse values out of range, naming the field."""
    with pytest.raises(ValueError, match=rf"DecoderConfig\.{message}"):
        dataclasses.replace(DECODER, **{field: bad})


def test_moe_spec_checks_top_k():
    from pagedkv.models.decoder_config import MoeSpec

    with pytest.raises(ValueError, match="MoeSpec.top_k=5 exceeds num_experts=4"):
        MoeSpec(num_experts=4, top_k=5)


def test_llama_decoder_config_keeps_the_cache_config():
    """``LlamaForCausalLM`` builds on the shared decoder: its options give the cache config Llama's own."""
    assert DECODER.kv_cache_config("float32") == LLAMA.kv_cache_config("float32")
    mistral = dataclasses.replace(LLAMA, sliding_window=8)
    assert mistral.decoder_config().kv_cache_config("float16") == mistral.kv_cache_config("float16")


def test_decoder_layer_windows_become_layer_groups():
    """Per-layer windows give the cache one layer group per window; equal ones the plain ``sliding_window``; a
    list of the wrong length, or beside a ``sliding_window``, is refused."""
    mixed = dataclasses.replace(DECODER, layer_windows=(12, 0)).kv_cache_config("float32")
    assert mixed.sliding_window == 0 and [(g.layers, g.sliding_window) for g in mixed.layer_groups] == [
        ((0,), 12), ((1,), 0)]
    same = dataclasses.replace(DECODER, layer_windows=(12, 12)).kv_cache_config("float32")
    assert same.sliding_window == 12 and same.layer_groups is None
    with pytest.raises(ValueError, match=r"DecoderConfig\.layer_windows must hold one int >= 0 per layer \(2\)"):
        dataclasses.replace(DECODER, layer_windows=(12,))
    with pytest.raises(ValueError, match=r"DecoderConfig\.sliding_window must be 0 with layer_windows"):
        dataclasses.replace(DECODER, layer_windows=(12, 0), sliding_window=4)


def test_decoder_layer_rope_moves_the_rotation_into_the_model():
    """Per-layer rotations (Gemma 3's two bases): the cache rotates nothing (``rope_mode="none"``); a rotation the
    model does not apply itself (LongRoPE's per-forward switch, interleaved pairs) is refused naming the layer."""
    from pagedkv.rope_spec import RopeSpec

    local, linear = (10000.0, RopeSpec()), (1e6, RopeSpec(rope_type="linear", factor=8.0))
    cfg = dataclasses.replace(DECODER, layer_rope=(local, linear)).kv_cache_config("float32")
    assert cfg.rope_mode == "none" and cfg.rope == RopeSpec()
    longrope = RopeSpec(rope_type="longrope", short_factor=(1.0,) * 8, long_factor=(2.0,) * 8, factor=2.0,
                        original_max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"DecoderConfig\.layer_rope\[1\]: the model rotates default"):
        dataclasses.replace(DECODER, layer_rope=(local, (1e4, longrope)))
    with pytest.raises(ValueError, match=r"DecoderConfig\.layer_rope must hold one"):
        dataclasses.replace(DECODER, layer_rope=(local,))
