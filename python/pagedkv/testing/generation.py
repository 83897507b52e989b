"""Greedy generation helpers shared by the CPU and GPU SmolLM2 tests: ours through ``pagedkv.engine`` and
transformers' as the reference, both argmax without stopping at EOS."""

from __future__ import annotations

import numpy as np
import torch

from ..apps.chat import SYSTEM

PROMPTS = ["What is the capital of France?", "Name three colors of the rainbow.",
           "Write one sentence about the sea."]


def chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                                  add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' argmax tokens, and the top-1/top-2 logit margin at each step."""
    device = next(model.parameters()).device
    out, margins = [], []
    with torch.no_grad():
        res = model(torch.tensor([ids], device=device), use_cache=True)
        for _ in range(n):
            top = torch.topk(res.logits[0, -1].float(), 2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            res = model(torch.tensor([[out[-1]]], device=device), past_key_values=res.past_key_values,
                        use_cache=True)
    return out, margins


def ours_greedy(engine, convs: list[list[int]], shared: int, n: int) -> list[list[int]]:
    """Prompts 0 and 1 prefilled in one batch; prompt 2 forked from 0 at ``shared``; batched decode."""
    engine.add(0)
    engine.add(1)
    logits = engine.prefill({0: convs[0], 1: convs[1]})
    engine.fork(0, 2, shared)
    logits = np.concatenate([logits, engine.prefill({2: convs[2][shared:]})])
    toks = [[int(np.argmax(row))] for row in logits]
    for _ in range(n - 1):
        step = engine.decode({i: toks[i][-1] for i in range(3)})
        for i in range(3):
            toks[i].append(int(np.argmax(step[i])))
    return toks


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    return next((k for k in range(min(len(ours), len(ref))) if ours[k] != ref[k]), None)
