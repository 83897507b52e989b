"""DeepSeek-V3 (MLA) Relax model on the pagedkv MLA cache, compiled for ``llvm`` in float32 and in bfloat16
(DeepSeek-V3's checkpoint dtype; ``CASES``), exported as a library, run in a fresh process (TVM runtime + pagedkv) from
the case file the GPU bundle writes too (``pagedkv.testing.deepseek.write_case``): a batched prefill of two
sequences, a fork of one of them at a position inside its prompt, a batched prefill of the fork's
continuation beside a second chunk of another sequence, 16 batched decode steps of all three, and one more
token each through ``prefill`` (a decode forward for the cache). Every logits row is compared with HF
transformers' ``DeepseekV3ForCausalLM`` (float64, the same random weights rounded to the model dtype) run
on each sequence's full token history, within ``pagedkv.testing.deepseek.TOL`` / ``MEAN_TOL`` of the
dtype (the bf16 bounds are measured on this CPU build; see there)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv.compile import build_library  # noqa: E402
from pagedkv.testing import deepseek as D  # noqa: E402
from pagedkv.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, params_from_hf  # noqa: E402

RUNNER = textwrap.dedent("""
    import sys
    import numpy as np
    import pagedkv  # registers the pagedkv.* globals the library calls
    import tvm
    from tvm import relax
    from pagedkv.testing import deepseek as D
    lib_path, case_path, out_path = sys.argv[1:4]
    vm = relax.VirtualMachine(tvm.runtime.load_module(lib_path), tvm.cpu())
    meta, params, _ = D.read_case(case_path)
    np.savez(out_path, **D.run_scenario(vm, D.device_params(meta, params, tvm.cpu()), meta["steps"], tvm.cpu()))
""")


#: A covering set of (config, dtype): each config once, each dtype once (a whole model compile each): DeepSeek-V3's
#: layout in its checkpoint dtype, and the YaRN / no-q-LoRA layout in float32, whose tolerance is the tight one.
CASES = [("q_lora", "bfloat16"), ("yarn_no_q_lora", "float32")]
assert {name for name, _ in CASES} == set(D.CONFIGS), "a DeepSeek config without a library test"


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_deepseek_v3_library_in_fresh_process(tmp_path, name, dtype):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"\n[{name} {dtype}] seed {seed}")
    hf = D.round_weights(D.hf_model(name, seed), dtype)
    cfg = DeepseekV3Config.from_hf(hf.config)
    model = DeepseekV3ForCausalLM(cfg, dtype=dtype, target="llvm", backend="tir")
    lib, named_params = build_library(model, "llvm", tmp_path / "model.so")
    steps, rows, history = D.scenario(np.random.default_rng(seed), cfg.vocab_size)
    ref = D.hf_logits(hf, history)
    D.write_case(tmp_path / "case.npz", name, seed, params_from_hf(hf, named_params, dtype), steps, rows, ref,
                 dtype)
    (tmp_path / "runner.py").write_text(RUNNER)
    proc = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(lib), str(tmp_path / "case.npz"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    meta, _, expected = D.read_case(tmp_path / "case.npz")
    assert meta["dtype"] == dtype and meta["rows"] == json.loads(json.dumps(rows))
    D.check_logits(dict(np.load(tmp_path / "out.npz")), rows, expected, dtype, f"{name} {dtype}")


def test_rope_and_scale_match_hf():
    """RoPE inverse frequencies, the cos/sin attention factor and the softmax scale equal HF's (default and
    YaRN)."""
    for kwargs in D.CONFIGS.values():
        hf_cfg = transformers.DeepseekV3Config(**kwargs)
        hf = transformers.DeepseekV3ForCausalLM(hf_cfg)
        cfg = DeepseekV3Config.from_hf(hf_cfg)
        rot = hf.model.rotary_emb
        np.testing.assert_allclose(cfg.rope_inv_freq(), rot.inv_freq.numpy(), rtol=1e-6)
        assert cfg.rope_attention_factor() == pytest.approx(rot.attention_scaling, rel=1e-12)
        assert cfg.sm_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)


def test_moe_config_is_rejected():
    hf_cfg = transformers.DeepseekV3Config(**dict(D.CONFIGS["q_lora"], first_k_dense_replace=1,
                                                  n_routed_experts=8))
    with pytest.raises(ValueError, match="MoE layers are not supported"):
        DeepseekV3Config.from_hf(hf_cfg)
