"""Cache-level checks of the CPU kernels' run-time code paths (``pagedkv.backends.tir.forced_paths``).

The regression of the windowed decode that returned the empty state for every entry after the first one
when it ran on the thread pool and the first entry's window started past its first key tile. Outputs are
compared per sequence with the float64 reference (``pagedkv.testing.reference``), so a wrong short
sequence cannot hide behind a long one.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import KVCacheConfig
from pagedkv.testing.reference import ReferenceCache
from pagedkv.testing.scenarios import TOLERANCE, assert_close, random_sm_scale


def run_forward_per_sequence(cache, ref, batch: dict[int, int], gen: torch.Generator, sm_scale: float,
                             where: str) -> None:
    """One forward of ``batch`` (seq -> new tokens, in order) on both caches; every layer's output rows of
    every sequence must match the reference on their own (relative error under the dtype's bound)."""
    cfg = cache.config
    dtype = getattr(torch, cfg.dtype)
    seqs, lens = list(batch), list(batch.values())
    ref.begin_forward(seqs, lens)
    cache.begin_forward(seqs, lens)
    width = cfg.num_qo_heads + 2 * cfg.num_kv_heads
    for layer in range(cfg.num_layers):
        qkv = torch.randn(sum(lens), width, cfg.head_dim, generator=gen).to(dtype)
        o = cache.attention_with_fused_qkv(layer, qkv, sm_scale)
        ref_o = ref.attention_with_fused_qkv(layer, qkv, sm_scale)
        start = 0
        for seq, n in batch.items():
            assert_close(o[start:start + n], ref_o[start:start + n], cfg.dtype,
                         f"{where} layer {layer} sequence {seq} ({n} new tokens)")
            start += n
    cache.end_forward()
    ref.end_forward()


#: The reported shape: 16 q / 16 kv heads (enough work for the thread pool), head dim 64, window 13.
WINDOW_REPRO = KVCacheConfig(num_layers=1, num_qo_heads=16, num_kv_heads=16, head_dim=64, dtype="float32",
                             rope_mode="none", page_size=16, max_batch_size=2, max_total_seq_len=128,
                             prefill_chunk_size=96, sliding_window=13)


@pytest.mark.parametrize("together", [False, True], ids=["prefill-apart", "prefill-together"])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["long-first", "short-first"])
def test_window_decode_first_window_past_first_tile(order, together, make_cache, gen):
    """Sequence 0 (66 + 1 keys: its window starts in key tile 1) and sequence 1 (27 + 1 keys), decoded in
    both orders; the old kernel returned o = 0 for the second entry when the first was the long one."""
    assert TOLERANCE[WINDOW_REPRO.dtype] == 1e-5
    cache, ref = make_cache(WINDOW_REPRO), ReferenceCache(WINDOW_REPRO)
    sm_scale = random_sm_scale(gen, WINDOW_REPRO.head_dim)
    for seq in (0, 1):
        cache.add_sequence(seq)
        ref.add_sequence(seq)
    prefills = [{0: 66, 1: 27}] if together else [{0: 66}, {1: 27}]
    for i, batch in enumerate(prefills):
        run_forward_per_sequence(cache, ref, batch, gen, sm_scale, f"prefill {i}")
    for step in range(3):
        run_forward_per_sequence(cache, ref, {s: 1 for s in order}, gen, sm_scale, f"decode {step} {order}")
