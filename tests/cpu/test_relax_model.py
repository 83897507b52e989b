"""A Relax model compiled with ``pagedkv.relax.PagedKVCache`` for ``llvm``, exported as a library, loaded in a
fresh process (TVM runtime + pagedkv) and run for a batched prefill and a decode step; its logits must match
HF transformers' ``LlamaForCausalLM`` with the same random weights, and ``MistralForCausalLM`` with a sliding
window shorter than the prompts (the cache's ``sliding_window``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv.compile import build_library  # noqa: E402
from pagedkv.models.llama import LlamaConfig, LlamaForCausalLM, params_from_hf  # noqa: E402

CFG = LlamaConfig(vocab_size=384, hidden_size=384, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=64, rope_theta=10000.0)
#: Mistral: the Llama layout with a sliding window (8 < the prompts' 21 and 9 tokens, so it bites).
MISTRAL = dataclasses.replace(CFG, sliding_window=8)


def _hf_model(cfg: LlamaConfig, seed: int):
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if cfg.sliding_window:
        hf_cfg = transformers.MistralConfig(**common, sliding_window=cfg.sliding_window)
        hf_cfg._attn_implementation = "eager"  # applies the window mask on every path
        model = transformers.MistralForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
        model = transformers.LlamaForCausalLM(hf_cfg)
    model = model.to(torch.float64).eval()
    with torch.no_grad():  # HF initializes norms to ones; randomize them too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


RUNNER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import pagedkv  # registers the pagedkv.* globals the library calls
    import tvm
    from tvm import relax
    import tvm_ffi
    lib_path, params_path, ids_path, out_path = sys.argv[1:5]
    vm = relax.VirtualMachine(tvm.runtime.load_module(lib_path), tvm.cpu())
    params = [tvm.runtime.tensor(a) for a in np.load(params_path).values()]
    ids = json.load(open(ids_path))
    g = lambda n: tvm_ffi.get_global_func("pagedkv." + n)
    # nn.spec int arguments arrive as one-element shapes
    cache = vm["create_paged_kv_cache"](*[tvm_ffi.Shape((v,)) for v in (4, 256, 64, 16)])
    g("add_sequence")(cache, 0); g("add_sequence")(cache, 1)
    # batched prefill of two prompts
    lens = [len(ids["p0"]), len(ids["p1"])]
    g("begin_forward")(cache, (0, 1), tuple(lens))
    flat = np.array([ids["p0"] + ids["p1"]], dtype="int32")
    pos = np.array([lens[0] - 1, lens[0] + lens[1] - 1], dtype="int32")
    logits_p, cache = vm["prefill"](tvm.runtime.tensor(flat), tvm.runtime.tensor(pos), cache, params)
    g("end_forward")(cache)
    # fork sequence 0 and decode all three in one batch
    g("fork_sequence")(cache, 0, 2, -1)
    g("begin_forward")(cache, (0, 1, 2), (1, 1, 1))
    step = np.array([[ids["d"][0]], [ids["d"][1]], [ids["d"][2]]], dtype="int32")
    logits_d, cache = vm["decode"](tvm.runtime.tensor(step), cache, params)
    g("end_forward")(cache)
    np.savez(out_path, prefill=logits_p.numpy(), decode=logits_d.numpy())
""")


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("cfg", [CFG, MISTRAL], ids=["llama", "mistral-window8"])
def test_relax_model_library_in_fresh_process(tmp_path, cfg):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    hf = _hf_model(cfg, seed)
    model = LlamaForCausalLM(cfg, dtype="float32", target="llvm", backend="tir")
    lib, named_params = build_library(model, "llvm", tmp_path / "model.so")
    params = params_from_hf(hf, named_params, "float32")
    np.savez(tmp_path / "params.npz", *params)
    rng = np.random.default_rng(seed)
    ids = {"p0": rng.integers(0, CFG.vocab_size, 21).tolist(), "p1": rng.integers(0, CFG.vocab_size, 9).tolist(),
           "d": rng.integers(0, CFG.vocab_size, 3).tolist()}
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    (tmp_path / "runner.py").write_text(RUNNER)
    proc = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(lib), str(tmp_path / "params.npz"),
                           str(tmp_path / "ids.json"), str(tmp_path / "out.npz")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.load(tmp_path / "out.npz")

    def hf_logits(tokens):
        with torch.no_grad():
            return hf(torch.tensor([tokens])).logits[0, -1].numpy()

    ref_p = np.stack([hf_logits(ids["p0"]), hf_logits(ids["p1"])])
    ref_d = np.stack([hf_logits(ids["p0"] + [ids["d"][0]]), hf_logits(ids["p1"] + [ids["d"][1]]),
                      hf_logits(ids["p0"] + [ids["d"][2]])])
    assert _rel(got["prefill"][0], ref_p) < 1e-5
    assert _rel(got["decode"][:, 0], ref_d) < 1e-5
