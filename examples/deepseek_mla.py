"""A DeepSeek-V3-shaped MLA model (multi-head latent attention with weight absorption) on pagedkv's MLA
cache: random weights in a small HF config, compiled for the CPU, then greedy generation for two prompts
in one batch, compared token for token with HF transformers' ``DeepseekV3ForCausalLM``.

    python examples/deepseek_mla.py [--new-tokens 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from pagedkv.compile import build_library
from pagedkv.engine import Engine
from pagedkv.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, params_from_hf

# DeepSeek-V3's layout at a small size: q LoRA, a 64 + 32 latent per token, interleaved RoPE, dense MLPs.
HF_CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
                 qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=2,
                 rope_interleave=True, max_position_embeddings=256, initializer_range=0.2, attention_bias=False)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_CONFIG)).eval()
    hf.generation_config.pad_token_id = 0
    cfg = DeepseekV3Config.from_hf(hf.config)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model = DeepseekV3ForCausalLM(cfg, dtype="float32", target="llvm", backend="tir")
        lib, named = build_library(model, "llvm", Path(tmp) / "deepseek.so")
        print(f"compiled {lib.name} in {time.perf_counter() - t0:.1f} s (MLA cache: one "
              f"{cfg.kv_lora_rank}+{cfg.qk_rope_head_dim} latent per token and layer)")
        engine = Engine(str(lib), params_from_hf(hf, named, "float32"), max_batch_size=2, max_total_seq_len=256,
                        prefill_chunk_size=64, page_size=8)
        rng = np.random.default_rng(0)
        prompts = {0: rng.integers(1, cfg.vocab_size, 11).tolist(), 1: rng.integers(1, cfg.vocab_size, 5).tolist()}
        for s in prompts:
            engine.add(s)
        logits = engine.prefill(prompts)
        ours = {s: [int(logits[i].argmax())] for i, s in enumerate(prompts)}
        for _ in range(args.new_tokens - 1):
            logits = engine.decode({s: t[-1] for s, t in ours.items()})
            for i, s in enumerate(ours):
                ours[s].append(int(logits[i].argmax()))
    ok = True
    for s, prompt in prompts.items():
        ref = hf_greedy(hf, prompt, args.new_tokens)
        print(f"sequence {s}: pagedkv {ours[s]}\n            HF      {ref}")
        ok &= ours[s] == ref
    print("OK: the same greedy tokens" if ok else "WRONG: tokens differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
