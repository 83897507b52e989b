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
    # nn.spec int arguments arrive as one-element shapes (the last: support_sliding_window, as MLC's engine)
    cache = vm["create_paged_kv_cache"](*[tvm_ffi.Shape((v,)) for v in (4, 256, 64, 16, 0)])
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


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """``library(cfg)``: ``(path, named_params)`` of ``cfg``'s float32 CPU library, built once for the module
    (the build is most of each test's time; the weights are the caller's)."""
    built = {}

    def get(cfg: LlamaConfig):
        if cfg not in built:
            model = LlamaForCausalLM(cfg, dtype="float32", target="llvm", backend="tir")
            built[cfg] = build_library(model, "llvm", tmp_path_factory.mktemp("lib") / "model.so")
        return built[cfg]

    return get


@pytest.mark.parametrize("cfg", [CFG, MISTRAL], ids=["llama", "mistral-window8"])
def test_relax_model_library_in_fresh_process(tmp_path, cfg, library):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    hf = _hf_model(cfg, seed)
    lib, named_params = library(cfg)
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


#: The child of ``test_bad_input_is_rejected_in_fresh_process``: ``say`` announces each case before it runs, so
#: a crash (TVM's unchecked gather: exit 139) names the case that caused it.
BAD_INPUT_RUNNER = textwrap.dedent("""
    import sys
    import numpy as np
    import pagedkv  # registers the pagedkv.* globals the library calls
    import tvm
    import tvm_ffi
    from tvm import relax
    from pagedkv.engine import Engine
    lib_path, params_path, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3])
    params = list(np.load(params_path).values())
    g = lambda n: tvm_ffi.get_global_func("pagedkv." + n)
    t = lambda a: tvm.runtime.tensor(np.asarray(a, dtype="int32"))

    def say(case):
        print("case:", case, flush=True)

    def rejects(case, call, error, *parts):
        say(case)
        try:
            call()
        except error as err:
            missing = [p for p in parts if p not in str(err)]
            assert not missing, f"{case}: {missing} not in the message {err}"
        else:
            raise AssertionError(f"{case}: no {error.__name__}")

    # -- the library called directly, as a server without pagedkv's engine would ----------------------
    vm = relax.VirtualMachine(tvm.runtime.load_module(lib_path), tvm.cpu())
    ffi_params = tvm_ffi.convert([tvm.runtime.tensor(p) for p in params])
    caches = [vm["create_paged_kv_cache"](*[tvm_ffi.Shape((v,)) for v in (4, 256, 64, 16, 0)]) for _ in range(2)]
    for c in caches:
        g("add_sequence")(c, 0); g("add_sequence")(c, 1)
    bad_cache = caches[0]
    lengths = lambda c: [g("get_sequence_length")(c, s) for s in (0, 1)]

    def prefill(cache, ids, rows):
        g("begin_forward")(cache, (0, 1), (3, 2))
        return vm["prefill"](t([ids]), t(rows), cache, ffi_params)[0].numpy()

    good = [5, 6, 7, 8, 9]
    for case, ids, rows, parts in [
            ("prefill: an id past the vocabulary", [5, vocab + 10**6, 7, 8, 9], [2, 4],
             [f"input_ids[0, 1] = {vocab + 10**6} is outside [0, vocab_size={vocab})", "abort_forward"]),
            ("prefill: a negative id", [5, 6, -1, -2, 9], [2, 4], ["input_ids[0, 2] = -1 is outside", "2 of its 5"]),
            ("prefill: a logit row past the input", good, [2, 5],
             ["logit_positions[1] = 5 is outside [0, n (the number of input tokens)=5)"])]:
        rejects(case, lambda: prefill(bad_cache, ids, rows), ValueError, *parts)
        g("abort_forward")(bad_cache)
        assert lengths(bad_cache) == [0, 0], (case, lengths(bad_cache))
    # without abort_forward: end_forward rejects the forward no layer ran, and takes it back too
    rejects("prefill: an id past the vocabulary", lambda: prefill(bad_cache, [vocab] * 5, [2, 4]), ValueError,
            "is outside")
    rejects("end_forward after it", lambda: g("end_forward")(bad_cache), RuntimeError, "wrote no k/v")
    assert lengths(bad_cache) == [0, 0]
    say("the same forwards on both caches")
    out = [prefill(c, good, [2, 4]) for c in caches]
    for c in caches:
        g("end_forward")(c)
    g("begin_forward")(bad_cache, (0, 1), (1, 1))
    rejects("decode: an id past the vocabulary", lambda: vm["decode"](t([[3], [vocab]]), bad_cache, ffi_params),
            ValueError, f"input_ids[1, 0] = {vocab} is outside")
    g("abort_forward")(bad_cache)
    for c in caches:
        g("begin_forward")(c, (0, 1), (1, 1))
        out.append(vm["decode"](t([[3], [4]]), c, ffi_params)[0].numpy())
        g("end_forward")(c)
    np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[2], out[3], rtol=1e-5, atol=1e-5)

    # -- pagedkv's engine: checked before a forward begins; a failed call is taken back --------------------
    def engine():
        e = Engine(lib_path, params, max_batch_size=2, max_total_seq_len=64, prefill_chunk_size=16)
        for s in (0, 1, 2):
            e.add(s)
        return e

    e, fresh = engine(), engine()
    assert e.vocab_size == vocab  # written beside the library by build_library
    elengths = lambda: [g("get_sequence_length")(e.cache, s) for s in (0, 1, 2)]
    rejects("engine prefill: an id past the vocabulary", lambda: e.prefill({0: [1, 2], 1: [3, vocab + 5]}),
            ValueError, f"token id {vocab + 5} at position 1 of sequence 1 is outside the vocabulary [0, "
            f"vocab_size={vocab})")
    rejects("engine prefill: a negative id", lambda: e.prefill({0: [-3]}), ValueError, "token id -3")
    rejects("engine prefill: a float id", lambda: e.prefill({0: [1.5]}), TypeError, "int token ids")
    rejects("engine prefill: an empty prompt", lambda: e.prefill({0: []}), ValueError, "non-empty")
    # 6 pages of 16 tokens (64 / 16 + max_batch_size): 97 tokens do not fit; before, 96 were prefilled
    rejects("engine prefill: a prompt longer than the cache", lambda: e.prefill({0: [1] * 97}), ValueError,
            "rejected, nothing changed", "out of pages")
    assert elengths() == [0, 0, 0]
    say("engine: a bad id found by the library in a later chunk (the engine's own check off)")
    e.vocab_size = None
    rejects("engine prefill, the library's check", lambda: e.prefill({0: [1] * 20 + [vocab]}), ValueError,
            "is outside [0, vocab_size")
    assert elengths() == [0, 0, 0]  # the first chunk's 16 tokens were taken back too
    e.vocab_size = vocab
    say("engine: three prompts over chunks of 16 tokens and 2 sequences")
    prompts = {0: list(range(1, 21)), 1: list(range(30, 40)), 2: [7, 8, 9, 10, 11]}
    out = [x.prefill(prompts) for x in (e, fresh)]
    assert elengths() == [20, 10, 5]
    rejects("engine decode: an id past the vocabulary", lambda: e.decode({2: 1, 1: vocab}), ValueError,
            f"token id {vocab} at the decode step of sequence 1")
    assert elengths() == [20, 10, 5]
    out += [x.decode({2: 1, 1: 2}) for x in (e, fresh)]
    np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[2], out[3], rtol=1e-5, atol=1e-5)
    print("done", flush=True)
""")


def test_bad_input_is_rejected_in_fresh_process(tmp_path, library):
    """Token ids outside the vocabulary (past it, negative) and logit rows outside the input raise ValueError
    naming the value in the compiled library's own functions, called directly (before TVM's unchecked gather
    would crash the process or read another row) and through the engine (before a forward begins); a prompt
    longer than the free pages is rejected whole. Afterwards the cache gives the logits of a cache that never
    saw the bad calls."""
    lib, named_params = library(CFG)
    rng = np.random.default_rng(0)
    params = [(1 + 0.1 * rng.standard_normal(p.shape) if "norm" in name else 0.05 * rng.standard_normal(p.shape))
              .astype("float32") for name, p in named_params]
    np.savez(tmp_path / "params.npz", *params)
    (tmp_path / "runner.py").write_text(BAD_INPUT_RUNNER)
    proc = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(lib), str(tmp_path / "params.npz"),
                           str(CFG.vocab_size)], capture_output=True, text=True, timeout=600)
    cases = [line for line in proc.stdout.splitlines() if line.startswith("case:")]
    assert proc.returncode == 0, (f"exit {proc.returncode} at {cases[-1:] or 'start'}:\n{proc.stderr[-4000:]}")
    assert proc.stdout.rstrip().endswith("done")
