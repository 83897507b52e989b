"""The cache without a model: sequences, a fork that shares a prompt's pages, batched prefill and decode,
each attention output checked against plain PyTorch attention over the sequence's whole history.

    python examples/raw_cache_api.py [--target llvm]
"""

from __future__ import annotations

import argparse
import sys

import torch

import pagedkv


def reference(q, k, v, sm_scale):
    """Causal attention of the last ``len(q)`` positions over ``k``/``v`` ([L, Hkv, D]), float64, GQA."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * sm_scale
    n, m = q.shape[0], k.shape[0]
    mask = torch.arange(m)[None, :] > torch.arange(m - n, m)[:, None]
    return torch.einsum("hqk,khd->qhd", s.masked_fill(mask, float("-inf")).softmax(-1), v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="llvm")
    args = ap.parse_args(argv)
    cfg = pagedkv.KVCacheConfig(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype="float32",
                                rope_mode="none", max_batch_size=4, max_total_seq_len=1024, page_size=16,
                                prefill_chunk_size=256)
    cache = pagedkv.create(cfg, backend="tir", target=args.target, poison=True)
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, scale = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5
    history = {}  # seq -> per layer (k, v) of every token, to check against

    def forward(seqs, lengths):
        cache.begin_forward(seqs, lengths)
        worst = 0.0
        for layer in range(cfg.num_layers):
            qkv = torch.randn(sum(lengths), hq + 2 * hkv, d, generator=gen)
            o = cache.attention_with_fused_qkv(layer, qkv, sm_scale=scale)
            row = 0
            for s, n in zip(seqs, lengths):
                q, k, v = qkv[row:row + n].split([hq, hkv, hkv], dim=1)
                ks, vs = history.setdefault((s, layer), (torch.empty(0, hkv, d), torch.empty(0, hkv, d)))
                history[(s, layer)] = (torch.cat([ks, k]), torch.cat([vs, v]))
                ref = reference(q, *history[(s, layer)], scale)
                worst = max(worst, float((o[row:row + n].double() - ref).norm() / ref.norm()))
                row += n
        cache.end_forward()
        return worst

    cache.add_sequence(0)
    errs = [forward([0], [40])]                      # a prompt of 40 tokens (three pages)
    cache.fork_sequence(0, 1, 40)                    # sequence 1 shares its pages
    for layer in range(cfg.num_layers):
        history[(1, layer)] = history[(0, layer)]
    cache.add_sequence(2)
    errs.append(forward([0, 1, 2], [3, 7, 20]))       # prefill continues 0 and 1 past the fork, starts 2
    for _ in range(4):
        errs.append(forward([0, 1, 2], [1, 1, 1]))    # batched decode
    print(f"sequence lengths {[cache.get_sequence_length(s) for s in (0, 1, 2)]}, "
          f"free pages {cache.num_available_pages}")
    print(f"worst relative error against float64 PyTorch per forward: {', '.join(f'{e:.1e}' for e in errs)}")
    ok = max(errs) < 1e-5
    print("OK" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
