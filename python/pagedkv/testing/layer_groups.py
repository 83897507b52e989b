"""A layer-groups run shared by the CPU and GPU tests (``tests/cpu/test_layer_groups.py``,
``tests/gpu/test_layer_groups_gpu.py``): a cache whose layers alternate sliding and full attention, driven call for
call beside ``pagedkv.testing.reference.ReferenceCache`` (prefills crossing the window, a fork at a parent's end,
prefix-shared decodes, a popn, mixed prefill / decode batches), every output compared, and each sliding layer's
output also compared with the reference without the window (a kernel ignoring its group's window must fail)."""

from __future__ import annotations

import torch

from ..config import KVCacheConfig
from ..layer_groups import layer_groups_from_windows
from .reference import ReferenceCache

#: The GPU config (``pagedkv.apps.gpu_bundle`` prebuilds its libraries): Llama-3's 32 / 8 heads x 128 in fp16 with
#: gpt-oss's pattern (window 40 here, so that the run crosses it; its base kernels are the GPU suite's plain shape).
GPU_GROUPS = KVCacheConfig(num_layers=4, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype="float16",
                           page_size=16, max_batch_size=8, max_total_seq_len=256, prefill_chunk_size=128,
                           layer_groups=layer_groups_from_windows([40, 0, 40, 0]))

#: (seq ids, append lengths) per forward; "fork": seq 2 forks from seq 0 at its end; "popn": seq 2 pops 2 tokens.
PLAN = [([0, 1], [20, 9]), ([0, 1], [1, 1]), "fork", ([2, 0, 1], [5, 1, 17]), ([0, 1, 2], [1, 1, 1]), "popn",
        ([2, 1], [3, 1]), ([0, 1, 2], [1, 1, 1])]
#: ``PLAN`` with prefills longer than ``GPU_GROUPS``' window.
GPU_PLAN = [([0, 1], [60, 45]), ([0, 1], [1, 1]), "fork", ([2, 0, 1], [5, 1, 30]), ([0, 1, 2], [1, 1, 1]), "popn",
            ([2, 1], [3, 1]), ([0, 1, 2], [1, 1, 1])]


def run_alternating(cache, gen: torch.Generator, *, tol: float, plan=PLAN, scale: float = 1.0) -> float:
    """Runs ``plan`` on ``cache`` (a ``KVCache`` of a config with layer groups) and the reference; returns the largest
    difference of a sliding layer's output from attention without its window (the caller asserts it is large).
    ``scale`` multiplies the inputs (long prefills: to make the window visible in the outputs)."""
    cfg = cache.config
    ref, full = ReferenceCache(cfg), ReferenceCache(cfg.replace(layer_groups=None))
    caches = (cache, ref, full)
    width = cfg.num_qo_heads + 2 * cfg.num_kv_heads
    sm_scale = cfg.head_dim ** -0.5
    for c in caches:
        c.add_sequence(0)
        c.add_sequence(1)
    dropped = 0.0
    for step in plan:
        if step in ("fork", "popn"):
            for c in caches:
                c.fork_sequence(0, 2, -1) if step == "fork" else c.popn(2, 2)
            continue
        ids, lens = step
        for c in caches:
            c.begin_forward(ids, lens)
        for layer in range(cfg.num_layers):
            qkv = torch.randn(sum(lens), width, cfg.head_dim, generator=gen) * scale
            o = cache.attention_with_fused_qkv(layer, qkv.to(cache.device, getattr(torch, cfg.dtype)), sm_scale)
            expect = ref.attention_with_fused_qkv(layer, qkv, sm_scale)
            torch.testing.assert_close(o.double().cpu(), expect, rtol=tol, atol=tol, msg=lambda m: f"layer {layer}: {m}")
            unwindowed = full.attention_with_fused_qkv(layer, qkv, sm_scale)
            if cfg.layer_window(layer):
                dropped = max(dropped, (o.double().cpu() - unwindowed).abs().max().item())
        for c in caches:
            c.end_forward()
    return dropped
