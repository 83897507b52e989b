"""Host cost of a decode step of a 32-layer 32/8/128 fp16 cache with the FlashInfer backend (``bench_gpu.py
--host-cost``), at B = 1, 64 and 256: ``begin_forward`` (pagedkv's forward plan and index upload, FlashInfer's
plans) and the 32 layers' attention calls, as a share of the step's GPU attention time.

``host_cost``: the layers dispatched one call at a time (as the Relax VM of a library without graphs does).
``graph_host_cost``: a cache with ``cuda_graph_batch`` whose 32 layer calls are captured once in a CUDA graph
(as a library compiled with ``cuda_graph_batch`` captures its decode step) and replayed each step after
``begin_forward``; the host cost is ``begin_forward`` plus the replay's launch.
"""

from __future__ import annotations

import statistics
import time

import torch

import _bench_impls as impls

SHAPES = ((1, 4096), (64, 4096), (256, 2048))


def _config(batch: int, length: int, *, layers: int = 32, graph: bool = False):
    import pagedkv

    return pagedkv.KVCacheConfig(num_layers=layers, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                                 dtype="float16", rope_mode="none", page_size=16, max_batch_size=batch,
                                 max_total_seq_len=batch * (length + 64), prefill_chunk_size=16384,
                                 cuda_graph_batch=batch if graph else 0)


def begin_forward_split(batch: int, length: int, steps: int) -> dict:
    """Median ``begin_forward`` of a 1-layer cache of the same shape with the TIR backend (pagedkv's own
    plan and index upload) and with the FlashInfer backend (plus FlashInfer's plans), in microseconds."""
    import pagedkv

    out = {}
    for label in ("pagedkv-tir", "pagedkv-fi"):
        cache = pagedkv.create(_config(batch, length, layers=1), backend=impls.PAGEDKV_BACKENDS[label],
                               target=impls.cache_target(label), device=impls.DEVICE)
        for b in range(batch):
            cache.add_sequence(b)
        impls.reserve(cache, {b: length for b in range(batch)})
        ids, ones, times = list(range(batch)), [1] * batch, []
        for _ in range(steps):
            if impls.DEVICE == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            cache.begin_forward(ids, ones)
            times.append(time.perf_counter() - t0)
            cache.end_forward(debug_unwritten=True)  # no layer ran (end_forward would reject the forward)
        out[label] = statistics.median(times[2:]) * 1e6
        del cache
    return out


def _decode_step(batch: int, length: int, *, graph: bool):
    """A cache of ``batch`` sequences of ``length`` tokens (``graph``: with ``cuda_graph_batch``), and
    ``layers()``, the 32 layers' ``attention_with_fused_qkv`` calls of one decode step; returns
    ``(cache, layers, o)`` with ``o`` the layers' output tensor (tvm-ffi)."""
    import pagedkv
    from pagedkv._lib import get_global
    from pagedkv.cache import _to_ffi

    cache = pagedkv.create(_config(batch, length, graph=graph), backend=impls.PAGEDKV_BACKENDS["pagedkv-fi"], target=impls.TARGET, device="cuda")
    for b in range(batch):
        cache.add_sequence(b)
    impls.reserve(cache, {b: length for b in range(batch)})
    kv = torch.randn(32, length, 8, 128, dtype=torch.float16, device="cuda")
    for b in range(batch):
        cache.debug_set_kv(b, 0, kv, kv)
    qkv = _to_ffi(torch.randn(batch, 48, 128, dtype=torch.float16, device="cuda"))
    o = _to_ffi(torch.empty(batch, 32, 128, dtype=torch.float16, device="cuda"))
    fused, handle = get_global("pagedkv.attention_with_fused_qkv"), cache.handle

    def layers():
        for layer in range(32):
            fused(handle, layer, 0.088, qkv, o)

    return cache, layers, o


def _timed_steps(cache, ids, launch, steps: int) -> tuple[float, float, float, float]:
    """Median seconds of ``begin_forward``, of ``launch()`` (the 32 layers' host time), of the layers' GPU time
    (CUDA events) and of the whole step, over ``steps`` decode steps of ``ids`` (the first two untimed)."""
    ones, times = [1] * len(ids), []
    for step in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.begin_forward(ids, ones)
        t1 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        cache.end_forward()
        if step >= 2:
            times.append((t1 - t0, t2 - t1, start.elapsed_time(end) / 1e3, t3 - t0))
    return tuple(statistics.median(t[i] for t in times) for i in range(4))


def _check_indices_us(cache, batch: int) -> float:
    """Median microseconds of ``pagedkv.check_indices`` on a ``[1, batch]`` int32 id tensor on the GPU (what a
    compiled model runs before its embedding: a copy to the host and a wait), with the GPU idle, as at the start
    of an engine's step (it has just read the last step's logits); less the Python call of a no-op global."""
    from pagedkv._lib import get_global
    from pagedkv.cache import _to_ffi

    ids = _to_ffi(torch.randint(0, 49152, (1, batch), dtype=torch.int32, device="cuda"))
    check, length_of = get_global("pagedkv.check_indices"), get_global("pagedkv.get_sequence_length")
    torch.cuda.synchronize()
    times, calls = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        check(cache.handle, ids, "input_ids", 49152, "vocab_size")
        t1 = time.perf_counter()
        length_of(cache.handle, 0)
        times.append(t1 - t0)
        calls.append(time.perf_counter() - t1)
    return (statistics.median(times) - statistics.median(calls)) * 1e6


def host_cost(args) -> list[dict]:
    """Host time of a decode step, the layers dispatched one call at a time."""
    from pagedkv._lib import get_global
    from pagedkv.cache import _to_ffi

    out = []
    for batch, length in SHAPES:
        cache, layers, fo = _decode_step(batch, length, graph=False)
        ids, ones = list(range(batch)), [1] * batch
        bf, disp, gpu, wall = _timed_steps(cache, ids, layers, args.host_steps)
        # where the dispatch goes: cross_attention alone (the FlashInfer run) per layer, in a decode forward
        cross = get_global("pagedkv.cross_attention")
        q = torch.randn(batch, 32, 128, dtype=torch.float16, device="cuda")
        lse = torch.empty(batch, 32, dtype=torch.float32, device="cuda")
        fqq, fl = _to_ffi(q), _to_ffi(lse)
        cache.begin_forward(ids, ones)
        layers()  # the new tokens' k/v, which a decode forward's cross_attention reads (it rejects them unwritten)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(32):
            cross(cache.handle, layer, 0.088, fqq, fo, fl)
        cross_us = (time.perf_counter() - t0) / 32 * 1e6
        torch.cuda.synchronize()
        cache.end_forward()
        # the Python -> tvm-ffi call itself, on a global that does no work (subtracted from the dispatch:
        # a compiled model calls the runtime from the Relax VM in C++)
        length_of = get_global("pagedkv.get_sequence_length")
        t0 = time.perf_counter()
        for _ in range(3200):
            length_of(cache.handle, 0)
        call_us = (time.perf_counter() - t0) / 3200 * 1e6
        check_us = _check_indices_us(cache, batch)
        split = begin_forward_split(batch, length, args.host_steps)
        out.append({"batch": batch, "length": length, "begin_forward_us": bf * 1e6, "dispatch_us": disp * 1e6,
                    "begin_forward_1layer_us": split,
                    "python_call_us": call_us, "cross_attention_call_us": cross_us, "check_indices_us": check_us, "gpu_attention_us": gpu * 1e6, "step_wall_us": wall * 1e6,
                    "host_share": (bf + disp) / gpu,
                    "host_share_runtime": (bf + disp - 32 * call_us / 1e6) / gpu,
                    "served_by": dict(cache.op_backends)})
        r = out[-1]
        print(f"[host] B={batch}: begin_forward {bf * 1e6:.0f} us, 32-layer dispatch {disp * 1e6:.0f} us "
              f"(python call {call_us:.1f} us, cross_attention alone {cross_us:.1f} us per layer), GPU {gpu * 1e6:.0f} us, step {wall * 1e6:.0f} us wall; "
              f"host share {r['host_share']:.1%} ({r['host_share_runtime']:.1%} without the Python calls); "
              f"1-layer begin_forward: TIR {split['pagedkv-tir']:.0f} us, FlashInfer {split['pagedkv-fi']:.0f} us; "
              f"token-id check {check_us:.1f} us ({check_us / (wall * 1e6):.2%} of the step)",
              flush=True)
        del cache, layers, fo  # layers holds the cache's handle
        torch.cuda.empty_cache()
    return out


def graph_host_cost(args) -> list[dict]:
    """Host time of a decode step whose 32 layer calls replay a CUDA graph captured once."""
    import tvm_ffi

    out = []
    for batch, length in SHAPES:
        cache, layers, _ = _decode_step(batch, length, graph=True)
        ids, ones = list(range(batch)), [1] * batch
        cache.begin_forward(ids, ones)  # warm (modules loaded, workspaces allocated), then capture
        layers()
        cache.end_forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        cache.begin_forward(ids, ones)
        with torch.cuda.graph(graph), tvm_ffi.use_torch_stream():
            layers()
        cache.end_forward()
        bf, replay, gpu, _ = _timed_steps(cache, ids, graph.replay, args.host_steps)
        out.append({"batch": batch, "length": length, "cuda_graph": True, "begin_forward_us": bf * 1e6,
                    "dispatch_us": replay * 1e6, "gpu_attention_us": gpu * 1e6, "host_share": (bf + replay) / gpu,
                    "served_by": dict(cache.op_backends)})
        print(f"[host] B={batch} CUDA graph: begin_forward {bf * 1e6:.0f} us, replay launch {replay * 1e6:.0f} us, "
              f"GPU {gpu * 1e6:.0f} us; host share {out[-1]['host_share']:.1%}", flush=True)
        del graph, cache, layers
        torch.cuda.empty_cache()
    return out
