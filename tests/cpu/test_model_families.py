"""Model families end to end on the CPU (issue 45 item 6): a tiny random-initialized model of each family, built from
transformers' own config class (no download), compiled once with pagedkv's shared decoder
(``pagedkv.models.decoder``, options from ``hf_families.from_hf``) and compared with HF eager in float64.

One library per family runs the whole scenario: two sequences prefilled in two chunks each (one batched forward
per chunk, logits of every row, chunks crossing 8-token pages and the 12-token windows), then 32 batched greedy
decode steps. The reference is HF's own incremental generation (its KV cache, the same chunks per sequence), so
LongRoPE's per-call switch between the short and long factors matches the cache's per-forward one: the keys of a
chunk keep the rotation they were stored with in both. Every logit row must match within 1e-5 (relative, per
forward) and every greedy token must be HF's argmax (or a near-tie of it within that tolerance, printed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv.compile import build_library  # noqa: E402
from pagedkv.models.decoder import DecoderForCausalLM  # noqa: E402
from pagedkv.models.hf_families import from_hf, params_from_hf  # noqa: E402

#: Capacity of every library's cache: (max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, -).
CAPACITY = (2, 256, 64, 8, 0)
#: Prompt lengths and the first chunk of each (the second chunk is the rest): chunks cross pages and windows.
PROMPTS, FIRST_CHUNK = (41, 26), (17, 9)
STEPS, WINDOW, TOL = 32, 12, 1e-5
SMALL = dict(vocab_size=160, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def _llama3():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    return transformers.LlamaConfig(**SMALL, hidden_size=96, intermediate_size=128, num_attention_heads=6,
                                    num_key_value_heads=2, head_dim=128, rope_parameters=rope)


def _mistral():
    return transformers.MistralConfig(**SMALL, hidden_size=112, intermediate_size=128, num_attention_heads=7,
                                      num_key_value_heads=1, head_dim=64, sliding_window=WINDOW)


def _qwen3():
    return transformers.Qwen3Config(**SMALL, hidden_size=128, intermediate_size=160, num_attention_heads=8,
                                    num_key_value_heads=2, head_dim=128)


def _phi3():
    # original_max 20: the first chunks (17, 9 tokens) run the short factors, everything after the long ones
    half = 96 // 4  # partial_rotary_factor 0.5 of head dim 96: 48 rotated dims, 24 pairs
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.05 * i for i in range(half)], "long_factor": [1.5 + 0.3 * i for i in range(half)]}
    return transformers.Phi3Config(**SMALL, hidden_size=192, intermediate_size=128, num_attention_heads=2,
                                   num_key_value_heads=2, original_max_position_embeddings=20, rope_parameters=rope,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gemma2():
    return transformers.Gemma2Config(**SMALL, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=192,
                                     sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                                     attn_logit_softcapping=5.0, final_logit_softcapping=3.0)


def _gemma3():
    return transformers.Gemma3TextConfig(**SMALL, hidden_size=96, intermediate_size=128, num_attention_heads=3,
                                         num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                                         sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])


def _gpt_oss():
    return transformers.GptOssConfig(**SMALL, hidden_size=64, intermediate_size=48, num_attention_heads=4,
                                     num_key_value_heads=1, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 64})


def _granite_swa():
    return transformers.GraniteSWAConfig(**SMALL, hidden_size=96, intermediate_size=128, num_attention_heads=6,
                                         num_key_value_heads=2, sliding_window=WINDOW,
                                         layer_types=["full_attention", "sliding_attention"], embedding_multiplier=4.0,
                                         residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)


FAMILIES = {"llama3": _llama3, "mistral": _mistral, "qwen3": _qwen3, "phi3-longrope": _phi3, "gemma2": _gemma2,
            "gemma3": _gemma3, "gpt-oss": _gpt_oss, "granite-swa": _granite_swa}


@dataclass(frozen=True)
class Run:
    """pagedkv's output of the scenario: per sequence, the logits of every forward (``[tokens, vocab]``) and its
    whole token list (prompt then greedy tokens)."""

    logits: tuple
    tokens: tuple


def _compiled(name: str, hf_cfg, out_dir) -> tuple:
    """``(path, named_params)`` of the family's float32 CPU library. With the kernel cache on (``make test``
    sets it) the library is an entry there keyed by the decoder config and the package's sources (as
    ``pagedkv.apps.chat`` keeps its models): an unchanged tree compiles each family once, not once per run."""
    import hashlib

    import tvm

    from pagedkv import kernel_cache
    from pagedkv.apps.chat import _source_digest
    from pagedkv.cpu_pipeline import SCHEDULE_VERSION
    from pagedkv.engine import param_names

    cfg = from_hf(hf_cfg)

    def build(path, progress=None):
        model = DecoderForCausalLM(cfg, dtype="float32", target="llvm", backend="tir")
        return build_library(model, "llvm", path, progress=progress)

    directory = kernel_cache.cache_dir()
    if directory is None:
        return build(out_dir / "model.so")
    key = hashlib.sha256(repr((cfg, SCHEDULE_VERSION, _source_digest(), tvm.__version__)).encode()).hexdigest()
    path = kernel_cache.load_or_build(directory, key[:20], build, what=f"the {name} test model for llvm",
                                      prefix="decoder-test")
    return path, param_names(path)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """``library(name)``: ``(path, named_params, hf_config)`` of the family's library, built once."""
    built = {}

    def get(name: str):
        if name not in built:
            hf_cfg = FAMILIES[name]()
            built[name] = (*_compiled(name, hf_cfg, tmp_path_factory.mktemp(name)), hf_cfg)
        return built[name]

    return get


def _hf_model(hf_cfg, seed: int):
    torch.manual_seed(seed)
    # eager experts too: HF's grouped-mm MoE kernel takes no float64
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager",
                                                          experts_implementation="eager")
    model = model.to(torch.float64).eval()
    with torch.no_grad():  # HF initializes norms to ones (Gemma's to zeros) and biases / sinks to zeros
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if "gemma" in hf_cfg.model_type else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
            elif "experts" in name or "router" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _run_pagedkv(lib, params, prompts) -> Run:
    import tvm
    import tvm_ffi
    from tvm import relax

    vm = relax.VirtualMachine(tvm.runtime.load_module(str(lib)), tvm.cpu())
    params = tvm_ffi.convert([tvm.runtime.tensor(p) for p in params])
    g = lambda n: tvm_ffi.get_global_func("pagedkv." + n)  # noqa: E731
    cache = vm["create_paged_kv_cache"](*[tvm_ffi.Shape((v,)) for v in CAPACITY])
    logits, tokens = ([], []), (list(prompts[0]), list(prompts[1]))
    for s in (0, 1):
        g("add_sequence")(cache, s)
    for chunk in [[(0, FIRST_CHUNK[s]) for s in (0, 1)], [(FIRST_CHUNK[s], PROMPTS[s]) for s in (0, 1)]]:
        ids = [t for s, (a, b) in enumerate(chunk) for t in prompts[s][a:b]]
        g("begin_forward")(cache, (0, 1), tuple(b - a for a, b in chunk))
        rows = np.arange(len(ids), dtype="int32")
        out = vm["prefill"](tvm.runtime.tensor(np.array([ids], "int32")), tvm.runtime.tensor(rows), cache,
                            params)[0].numpy()[0]
        g("end_forward")(cache)
        n0 = chunk[0][1] - chunk[0][0]
        logits[0].append(out[:n0]), logits[1].append(out[n0:])
    for _ in range(STEPS):
        for s in (0, 1):
            tokens[s].append(int(np.argmax(logits[s][-1][-1])))
        g("begin_forward")(cache, (0, 1), (1, 1))
        step = np.array([[tokens[0][-1]], [tokens[1][-1]]], "int32")
        out = vm["decode"](tvm.runtime.tensor(step), cache, params)[0].numpy()
        g("end_forward")(cache)
        for s in (0, 1):
            logits[s].append(out[s])
    return Run(logits=logits, tokens=tokens)


def _run_hf(model, tokens: list[int], first_chunk: int, prompt: int) -> list[np.ndarray]:
    """HF's logits of the same forwards of one sequence (its own incremental cache)."""
    sizes = [first_chunk, prompt - first_chunk] + [1] * STEPS
    past, pos, out = None, 0, []
    with torch.no_grad():
        for n in sizes:
            res = model(torch.tensor([tokens[pos:pos + n]]), cache=past, use_cache=True)  # transformers 5.25's name
            past, pos = res.cache, pos + n
            out.append(res.logits[0].numpy())
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_hf_eager(name, library, seed):
    lib, named, hf_cfg = library(name)
    hf = _hf_model(hf_cfg, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, hf_cfg.vocab_size, n).tolist() for n in PROMPTS]
    run = _run_pagedkv(lib, params_from_hf(hf, named, "float32"), prompts)
    for s in (0, 1):
        ref = _run_hf(hf, run.tokens[s], FIRST_CHUNK[s], PROMPTS[s])
        for i, (got, want) in enumerate(zip(run.logits[s], ref)):
            got = got.reshape(want.shape)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            assert err <= TOL, f"{name} sequence {s} forward {i}: logits relative error {err:.2e}"
        for step in range(STEPS):  # the token pagedkv chose after forward 1 + step is HF's argmax there
            want, token = ref[1 + step][-1], run.tokens[s][PROMPTS[s] + step]
            gap = float(want.max() - want[token])
            if gap:
                assert gap <= TOL * float(np.abs(want).max()), (
                    f"{name} sequence {s} step {step}: greedy token {token}, HF's {int(want.argmax())} "
                    f"(logit gap {gap:.3e})")
                print(f"{name} sequence {s} step {step}: near-tie, gap {gap:.3e}")


@pytest.mark.parametrize("name, field, change", [
    ("gpt-oss", "layer_types", {"layer_types": ["chunked_attention", "full_attention"]}),
    ("llama3", "mlp_bias", {"mlp_bias": True}),
    ("qwen3", "hidden_act", {"hidden_act": "relu"}),
    ("gemma3", "use_bidirectional_attention", {"use_bidirectional_attention": True}),
])
def test_unrepresentable_config_is_refused_naming_the_field(name, field, change):
    """What the shared decoder cannot represent is refused before anything is built, the message naming the HF
    field (no silent fallback)."""
    from pagedkv.models.hf_families import UnsupportedConfigError

    cfg = FAMILIES[name]()
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(UnsupportedConfigError, match=f"{field}="):
        from_hf(cfg)


def test_other_model_types_are_refused():
    from pagedkv.models.hf_families import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match="model_type 'gpt2'"):
        from_hf(transformers.GPT2Config())
