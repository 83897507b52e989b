"""The CUDA-graph replay case: a small random Llama, run through ``pagedkv.engine.Engine`` over a scenario that
changes the page tables between decode steps, checked against HF transformers in float32 at every step.

``pagedkv.apps.gpu_bundle`` builds the model libraries (with and without CUDA graphs, per backend) and writes
the weights (``write_weights``); ``tests/gpu/test_cuda_graph_gpu.py`` runs ``run_scenario`` on the GPU host.
A library compiled with ``cuda_graph_batch`` captures its decode step once per batch size and then replays
it: the cache's attention entry points (``pagedkv.debug_attention_calls``) are not called again for that
batch size, while the page tables, positions and lengths the replay reads change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..models.llama_params import LlamaConfig

#: GQA group 3 and head dim 64, as SmolLM2 (FlashInfer's CUDA-core decode module for it is in the bundle).
CONFIG = LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                     rope_theta=10000.0, tie_word_embeddings=False)
#: Largest batch of the case's graph libraries (the engine's max_batch_size).
GRAPH_BATCH = 8

#: (op, args): add a sequence with a prompt of n tokens; decode the listed sequences (several steps);
#: fork; remove; popn. Decode batches of 4, then 5 (a new graph), then 5 again over other sequences and
#: page tables (a replay of the batch-5 graph), with prompts and steps crossing 16-token pages.
STEPS = [
    ("add", 0, 5), ("add", 1, 17), ("add", 2, 33), ("add", 3, 9),
    ("decode", [0, 1, 2, 3], 4),
    ("fork", 1, 4), ("decode", [0, 1, 2, 3, 4], 3),
    ("remove", 0), ("add", 5, 20), ("decode", [1, 2, 3, 4, 5], 3),
    ("popn", 2, 3), ("fork", 3, 6), ("remove", 4), ("decode", [1, 2, 3, 5, 6], 14),
    ("decode", [6], 3),
]


def hf_config():
    import transformers

    c = CONFIG
    return transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                                     num_attention_heads=c.num_attention_heads,
                                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                     rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                                     tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=4096)


def write_weights(path: Path) -> None:
    """Fresh random HF weights, rounded to float16, as an ``.npz`` of the state dict."""
    import torch
    import transformers

    torch.manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    hf = transformers.LlamaForCausalLM(hf_config())
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{k: v.detach().to(torch.float16).numpy() for k, v in hf.state_dict().items()})


def load_hf(path: Path, device: str):
    """The HF model of ``write_weights``' file, in float32 on ``device``."""
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM(hf_config())
    with np.load(path) as z:
        hf.load_state_dict({k: torch.from_numpy(z[k].astype(np.float32)) for k in z.files})
    return hf.to(device).eval()


@dataclass
class StepResult:
    what: str           # e.g. "decode [1, 2, 3] step 2"
    batch: int
    rel_err: float      # worst over the step's sequences, ||ours - hf|| / ||hf|| of the last-token logits
    attention_calls: int  # the cache's attention entry-point calls during the step


def _hf_last_logits(hf, tokens: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        ids = torch.tensor([tokens], device=hf.device)
        return hf(input_ids=ids).logits[0, -1].float().cpu().numpy()


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours.astype(np.float64) - ref) / np.linalg.norm(ref))


def run_scenario(engine, hf, seed: int) -> list[StepResult]:
    """Runs ``STEPS`` on ``engine`` (its library's parameters from ``hf``), feeding both the same tokens (HF's
    greedy choice); returns one result per prefill and decode step."""
    from .._lib import get_global

    calls = get_global("pagedkv.debug_attention_calls")
    rng = np.random.default_rng(seed)
    # a sequence's tokens: the cache holds all but the last, which is the next input
    tokens: dict[int, list[int]] = {}
    out: list[StepResult] = []

    def check(what, seqs, logits):
        errs = []
        for i, s in enumerate(seqs):
            ref = _hf_last_logits(hf, tokens[s])
            errs.append(_rel(logits[i], ref))
            tokens[s].append(int(np.argmax(ref)))
        return max(errs)

    for op, *args in STEPS:
        before = calls(engine.cache)
        if op == "add":
            seq, n = args
            engine.add(seq)
            tokens[seq] = [int(t) for t in rng.integers(0, CONFIG.vocab_size, n)]
            err = check(f"prefill {seq}", [seq], engine.prefill({seq: tokens[seq]}))
            out.append(StepResult(f"prefill {seq} ({n} tokens)", 1, err, calls(engine.cache) - before))
        elif op == "decode":
            seqs, times = args
            for t in range(times):
                before = calls(engine.cache)
                logits = engine.decode({s: tokens[s][-1] for s in seqs})
                err = check(f"decode {seqs}", seqs, logits)
                out.append(StepResult(f"decode {seqs} step {t}", len(seqs), err, calls(engine.cache) - before))
        elif op == "fork":
            parent, child = args
            engine.fork(parent, child)  # the child shares the parent's cached tokens and its pending one
            tokens[child] = list(tokens[parent])
        elif op == "remove":
            engine.remove(args[0])
            del tokens[args[0]]
        elif op == "popn":
            seq, n = args
            engine.popn(seq, n)  # the first token popped is the next input
            tokens[seq] = tokens[seq][:-n]
    return out


__all__ = ["CONFIG", "GRAPH_BATCH", "STEPS", "StepResult", "load_hf", "run_scenario", "write_weights"]
