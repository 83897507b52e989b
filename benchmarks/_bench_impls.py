"""Implementations ``bench_gpu.py`` times on each workload, all on the same inputs (``_bench_workloads``).

Each builder returns ``run() -> out`` (out: ``[n, Hq, D|R]``, preallocated: nothing is allocated inside a
timed call), or raises ``Unavailable`` saying why the implementation does not apply to the workload.

- ``fi:*``: FlashInfer 0.7.4 through its own Python wrappers (plan once, run timed), every variant:
  decode on CUDA cores and on tensor cores (fa2, fa3), ragged and paged prefill (fa2, fa3), MLA (fa2, fa3);
- ``pagedkv-tir-tc2`` / ``-tc3`` / ``-wg2t`` / ``-wg1t``: ``pagedkv-tir`` with the tensor-core prefill kernel
  forced (path switch ``cuda_prefill_kernel=tc2`` / ``tc3``: its 128-row two-stage mma.sync tiles, or ``wg2t`` /
  ``wg1t``: the wgmma warpgroup tiles with TMA copies), on the prefill workloads;
- ``pagedkv-tir-tcd``: ``pagedkv-tir`` with the tensor-core decode kernel forced (``cuda_decode_kernel=tc``,
  ``tir_kernels/_decode_tc_cuda.py``), on the plain MHA decode workloads;
- ``pagedkv-tir-entry``: ``pagedkv-tir`` with the decode's split ranges forced equal per entry
  (``cuda_decode_split_ranges=entry``: auto's chunked ranges of skewed batches off), on the same workloads;
- ``pagedkv-fi`` / ``pagedkv-tir``: a pagedkv cache (``pagedkv.create``) with the FlashInfer backend (TIR
  for what it does not serve) or TIR only; the runtime call a model makes per layer is timed (decode:
  ``cross_attention`` in a decode forward; prefill: ``self_attention`` of fresh tokens, or for a chunk over
  a cache ``cross_attention`` alone, which in that (through) forward is the layer's whole attention),
  with ``begin_forward`` (where FlashInfer plans) done once outside the timing, as in a model;
- ``upstream``: apache-tvm 0.27's own CUDA TIR kernels (fp16, 32/8/128 only: the bundle builds that shape);
- ``torch-sdpa``: ``scaled_dot_product_attention`` on dense tensors (equal lengths only).

Inline-RoPE decode workloads (``Workload.rope``) run on ``pagedkv-tir`` only: the others are n/a (FlashInfer's
backend serves no inline RoPE, so ``pagedkv-fi`` would time the same TIR kernel; no peer column rotates
stored keys here).
"""

from __future__ import annotations

import torch

from pagedkv.kernel_spec import SWITCHES

from _bench_workloads import (D, HKV, MLA_PS, MLA_R, MLA_ROPE, PS, ROPE_SCALE, ROPE_THETA, TORCH_DTYPES, Inputs,
                              Workload, sm_scale)

#: One target for every column: Hopper (pagedkv.target: sm_90 and sm_90a are one machine), so that the TIR columns
#: take the wgmma kernels where auto does and the FlashInfer columns fa3, as a user building for Hopper gets them.
TARGET = {"kind": "cuda", "arch": "sm_90a"}
#: where the benchmark runs (a CPU test of the benchmark's plumbing sets "cpu" and TARGET "llvm")
DEVICE = "cuda"
#: The tensor-core prefill tiles: every value of the path switch but auto and simt (``TC_TILES``' names; the
#: switch lives in ``pagedkv.kernel_spec``, which imports no TVM: the GPU host has the runtime only).
PREFILL_TILES = tuple(v for v in SWITCHES["cuda_prefill_kernel"][1] if v not in ("auto", "simt"))
#: label -> TIR code paths its cache is created under (``pagedkv.backends.tir.forced_paths``): the tensor-core
#: prefill tiles (``pagedkv.kernel_table``: auto is wg1t / wg2t on Hopper, tc3 for whole prompts and tc2 for
#: the paged op before it), each forced on its own so that the tiles are compared in every run; the tensor-core decode;
#: the tensor-core MLA decodes (mma.sync, wgmma with Q in shared memory).
PAGEDKV_PATHS = {**{f"pagedkv-tir-{t}": {"cuda_prefill_kernel": t} for t in PREFILL_TILES},
                 "pagedkv-tir-tcd": {"cuda_decode_kernel": "tc"},
                 "pagedkv-tir-entry": {"cuda_decode_split_ranges": "entry"},
                 "pagedkv-tir-mlatc": {"cuda_mla_decode_kernel": "tc"},
                 "pagedkv-tir-mlawgq": {"cuda_mla_decode_kernel": "wgq"},
                 "pagedkv-tir-mlapsimt": {"cuda_mla_prefill_kernel": "simt"},
                 "pagedkv-tir-mlaptc": {"cuda_mla_prefill_kernel": "tc"},
                 "pagedkv-tir-mlapwgq": {"cuda_mla_prefill_kernel": "wgq"}}
PAGEDKV_BACKENDS = {"pagedkv-fi": ["flashinfer", "tir"], "pagedkv-tir": "tir", **dict.fromkeys(PAGEDKV_PATHS, "tir")}
#: The labels of ``PAGEDKV_PATHS`` that time the decode (the others time prefill only).
DECODE_PATH_LABELS = ("pagedkv-tir-tcd", "pagedkv-tir-entry")
#: The labels of ``PAGEDKV_PATHS`` that time the MLA decode only.
MLA_PATH_LABELS = ("pagedkv-tir-mlatc", "pagedkv-tir-mlawgq")
#: ... the MLA prefill's paged pass only: the SIMT kernel and the tensor-core ones (mma.sync, wgmma with Q in shared
#: memory) forced (auto: ``tir_kernels.mla_cuda.prefill_kernel``).
MLA_PREFILL_PATH_LABELS = ("pagedkv-tir-mlapsimt", "pagedkv-tir-mlaptc", "pagedkv-tir-mlapwgq")
_WS_BYTES = 512 << 20  # FlashInfer's own wrappers get a generous float workspace


class Unavailable(Exception):
    """This implementation does not apply to the workload (the message says why)."""


def _out(w: Workload, x: Inputs) -> torch.Tensor:
    return torch.empty(x.q.shape[0], w.hq, MLA_R if w.mla else D, dtype=x.q.dtype, device=x.q.device)


# --------------------------------------------------------------------------------------------------
# FlashInfer's own API
# --------------------------------------------------------------------------------------------------
def fi_variants(w: Workload) -> list[str]:
    if w.kind == "decode":
        return ["fi:decode", "fi:tc-fa2", "fi:tc-fa3"]
    if w.kind == "prefill":
        return ["fi:ragged-fa2", "fi:ragged-fa3", "fi:paged-fa2", "fi:paged-fa3"]
    return ["fi:mla-fa2", "fi:mla-fa3"]


def fi_in_best(variant: str, w: Workload) -> bool:
    """Whether a FlashInfer variant counts toward "FI best" on ``w``: those that read the keys where the
    workload holds them. A chunk over cached tokens holds them in pages (the issue's "paged prefill 512 over
    4096"); the ragged wrappers read a contiguous copy of every key, which no paged cache has, so their
    rows are timed and printed but are not the yardstick there."""
    return not (w.kind == "prefill" and any(w.lens) and variant.startswith("fi:ragged"))


def _no_rope(w: Workload, what: str) -> None:
    if w.rope:
        raise Unavailable(f"{what}: no inline RoPE column (pagedkv-tir only)")


def cache_target(label: str):
    """The target of ``label``'s cache: ``TARGET``, with the arch its forced paths need
    (``pagedkv.kernel_spec.target_for_paths``)."""
    from pagedkv.kernel_spec import target_for_paths

    return target_for_paths(PAGEDKV_PATHS.get(label, {}), TARGET)


def pagedkv_unavailable(label: str, w: Workload) -> str | None:
    """Why ``label`` has no column on ``w`` (None: it has one). The tensor-core prefill labels time MHA
    prefill only (their decode would time the plain TIR decode again); the tensor-core decode label times the
    plain MHA decode only, on the shapes its kernel serves (``tc_decode_limits``); the tensor-core MLA decode
    label times the MLA decode only, the MLA prefill labels the MLA prefill only."""
    if label in MLA_PATH_LABELS:
        return None if w.kind == "mla_decode" else f"{label}: MLA decode workloads only"
    if label in MLA_PREFILL_PATH_LABELS:
        return None if w.kind == "mla_prefill" else f"{label}: MLA prefill workloads only"
    if label in DECODE_PATH_LABELS:
        if w.kind != "decode" or w.rope:
            return f"{label}: plain MHA decode workloads only (its prefill and inline RoPE are pagedkv-tir's)"
        from pagedkv.kernel_spec import tc_decode_limits  # TVM-free: this runs on a runtime-only host

        if label == "pagedkv-tir-tcd" and (why := tc_decode_limits(w.hq // HKV, D, w.dtype)):
            return f"{label}: " + "; ".join(why)
        return None
    if label in PAGEDKV_PATHS and w.kind != "prefill":
        return f"{label}: prefill workloads only (its decode is pagedkv-tir's)"
    return None


def fi_impl(fi, variant: str, w: Workload, x: Inputs):
    _no_rope(w, "FlashInfer")
    ws = torch.empty(_WS_BYTES, dtype=torch.uint8, device=DEVICE)
    dt, scale, o = TORCH_DTYPES[w.dtype], sm_scale(w), _out(w, x)
    kind, _, backend = variant[3:].partition("-")
    if w.kind == "decode":
        if kind == "decode" and w.hq // HKV not in (1, 2, 3, 4, 6, 8, 16):
            raise Unavailable(f"the CUDA-core decode kernel has no GQA group {w.hq // HKV}")
        tc = kind == "tc"
        wrap = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tc,
                                                     backend=backend if tc else "auto")
        wrap.plan(x.indptr, x.indices, x.last, w.hq, HKV, D, PS, q_data_type=dt, kv_data_type=dt, sm_scale=scale)
        return lambda: wrap.run(x.q, x.pages, out=o)
    if w.kind == "prefill":
        if kind == "ragged":
            k, v = torch.cat(x.k), torch.cat(x.v)
            kv_indptr = torch.tensor([0] + torch.tensor(w.keys).cumsum(0).tolist(), dtype=torch.int32,
                                     device=DEVICE)
            wrap = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
            wrap.plan(x.qo_indptr, kv_indptr, w.hq, HKV, D, causal=True, sm_scale=scale, q_data_type=dt,
                      kv_data_type=dt)
            return lambda: wrap.run(x.q, k, v, out=o)
        wrap = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend=backend)
        wrap.plan(x.qo_indptr, x.indptr, x.indices, x.last, w.hq, HKV, D, PS, causal=True, sm_scale=scale,
                  q_data_type=dt, kv_data_type=dt)
        return lambda: wrap.run(x.q, x.pages, out=o)
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    ckv, kpe = x.pages[..., :MLA_R].contiguous(), x.pages[..., MLA_R:].contiguous()  # FlashInfer's layout
    q_nope, q_pe = x.q[..., :MLA_R].contiguous(), x.q[..., MLA_R:].contiguous()
    wrap = BatchMLAPagedAttentionWrapper(ws, backend=backend)
    wrap.plan(x.qo_indptr, x.indptr, x.indices, x.kv_lens, w.hq, MLA_R, MLA_ROPE, MLA_PS, False, scale, dt, dt)
    return lambda: wrap.run(q_nope, q_pe, ckv, kpe, out=o)


# --------------------------------------------------------------------------------------------------
# pagedkv
# --------------------------------------------------------------------------------------------------
def pagedkv_config(w: Workload):
    import pagedkv

    cap = dict(max_batch_size=w.batch, max_total_seq_len=sum(w.held) + w.batch * MLA_PS,
               prefill_chunk_size=max(w.batch * w.qlen, w.batch, FILL_CHUNK))
    if w.mla:
        return pagedkv.KVCacheConfig.mla(num_layers=1, num_heads=w.hq, kv_lora_rank=MLA_R, qk_nope_head_dim=128,
                                         qk_rope_head_dim=MLA_ROPE, v_head_dim=128, dtype=w.dtype,
                                         page_size=MLA_PS, **cap)
    return pagedkv.KVCacheConfig(num_layers=1, num_qo_heads=w.hq, num_kv_heads=HKV, head_dim=D, dtype=w.dtype,
                                 rope_mode="inline" if w.rope else "none", rope_theta=ROPE_THETA,
                                 rope_scale=ROPE_SCALE, page_size=PS, **cap)


#: tokens per reserving forward of ``_fill`` (and the least prefill_chunk_size of a benchmark cache)
FILL_CHUNK = 16384


def reserve(cache, lengths: dict[int, int]) -> None:
    """Append ``lengths[seq]`` tokens to each (already added) sequence in forwards of at most FILL_CHUNK
    tokens; no attention runs, so the keys are whatever the pages hold until written (``debug_set_kv``; the
    forwards end with ``debug_unwritten``, as ``end_forward`` rejects a forward whose layers wrote no k/v)."""
    todo = [[seq, n] for seq, n in lengths.items() if n > 0]
    while todo:
        ids, lens, room = [], [], FILL_CHUNK
        for item in todo:
            if room == 0:
                break
            take = min(item[1], room)
            ids.append(item[0])
            lens.append(take)
            item[1] -= take
            room -= take
        cache.begin_forward(ids, lens)
        cache.end_forward(debug_unwritten=True)
        todo = [item for item in todo if item[1] > 0]


def _fill(cache, w: Workload, x: Inputs, upto) -> None:
    """Cache the first ``upto[b]`` keys of each sequence: reserve them, then write them."""
    for b in range(w.batch):
        cache.add_sequence(b)
    reserve(cache, dict(enumerate(upto)))
    for b in range(w.batch):
        if upto[b] == 0:
            continue
        if w.mla:
            cache.debug_set_mla_kv(b, 0, x.k[b][None, :upto[b]].contiguous())
        else:
            cache.debug_set_kv(b, 0, x.k[b][None, :upto[b]].contiguous(), x.v[b][None, :upto[b]].contiguous())


def _dps(cache, name: str, inputs: list, o, lse, scale):
    from pagedkv.cache import _to_ffi

    args = [_to_ffi(t) for t in (*inputs, o, lse)]
    return lambda: (cache._call(name, 0, scale, *args), o)[1]  # pylint: disable=protected-access


def pagedkv_impl(label: str, w: Workload, x: Inputs):
    """(run, cache): the cache stays in the forward ``run`` belongs to until the caller ends it."""
    import pagedkv

    from pagedkv.backends.tir import forced_paths

    if label != "pagedkv-tir":
        _no_rope(w, label)
    if why := pagedkv_unavailable(label, w):
        raise Unavailable(why)
    paths = PAGEDKV_PATHS.get(label, {})
    with forced_paths(paths):  # the cache's kernel library is chosen here
        cache = pagedkv.create(pagedkv_config(w), backend=PAGEDKV_BACKENDS[label], target=cache_target(label),
                               device=DEVICE)
    scale, o = sm_scale(w), _out(w, x)
    lse = torch.empty(o.shape[0], w.hq, dtype=torch.float32, device=DEVICE)
    if w.kind == "prefill":
        _fill(cache, w, x, list(w.lens))
        cache.begin_forward(list(range(w.batch)), [w.qlen] * w.batch)
        new = [slice(n, n + w.qlen) for n in w.lens]
        k = torch.cat([x.k[b][new[b]] for b in range(w.batch)])
        v = torch.cat([x.v[b][new[b]] for b in range(w.batch)])
        if not any(w.lens):  # whole prompts: the ragged self_attention over the new tokens is all of it
            return _dps(cache, "self_attention", [x.q, k, v], o, lse, scale), cache
        # A continuation forward (every sequence holds cached tokens) is planned through: the fused call
        # appends the new k/v, then one causal paged pass over cached + new keys is the layer's attention,
        # which cross_attention runs alone (self_attention would write the empty state).
        cache.attention_with_fused_qkv(0, torch.cat([x.q, k, v], dim=1), scale)
    elif w.kind == "mla_prefill":
        # the prefill's paged (absorbed) pass over the cached latents: cross_attention of a forward of qlen new
        # tokens a sequence runs mla_attn_prefill_paged over the tokens cached before it
        _fill(cache, w, x, list(w.lens))
        cache.begin_forward(list(range(w.batch)), [w.qlen] * w.batch)
    else:
        # decode: every key but the last cached; the decode forward appends the last one
        _fill(cache, w, x, [n - 1 for n in w.lens])
        cache.begin_forward(list(range(w.batch)), [1] * w.batch)
        if w.mla:
            cache.append_mla_kv(0, torch.stack([x.k[b][-1] for b in range(w.batch)]))
        else:
            q0 = torch.zeros(w.batch, w.hq, D, dtype=x.q.dtype, device=DEVICE)
            qkv = torch.cat([q0, torch.stack([x.k[b][-1] for b in range(w.batch)]),
                             torch.stack([x.v[b][-1] for b in range(w.batch)])], dim=1)
            cache.attention_with_fused_qkv(0, qkv, scale)
    return _dps(cache, "cross_attention", [x.q], o, lse, scale), cache


# --------------------------------------------------------------------------------------------------
# apache-tvm's own kernels and torch SDPA
# --------------------------------------------------------------------------------------------------
def upstream_impl(funcs: dict, w: Workload, x: Inputs):
    _no_rope(w, "upstream")
    if w.dtype != "float16" or w.hq != 32 or w.mla:
        raise Unavailable("the bundle builds apache-tvm's kernels for fp16 32/8/128 only")
    import tvm_ffi

    o, lse = _out(w, x), torch.empty(x.q.shape[0], w.hq, dtype=torch.float32, device=DEVICE)
    ints = dict(dtype=torch.int32, device=DEVICE)
    if w.kind == "decode":
        zero = torch.zeros(w.batch, **ints)
        args = [x.q, x.pages, x.indptr, x.indices, x.last, zero, zero, o, lse]
        fn, scalars = funcs["attn_decode_paged"], (0, 1.0, 1e4, sm_scale(w))
    elif not any(w.lens):
        k, v = torch.cat(x.k), torch.cat(x.v)
        pos = torch.cat([torch.arange(w.qlen, **ints)] * w.batch)
        zero = torch.zeros(w.batch, **ints)
        args = [x.q, x.qo_indptr, k, v, x.qo_indptr, pos, zero, o, lse]
        fn, scalars = funcs["attn_prefill_ragged"], (1, 0, 1.0, 1e4, sm_scale(w))
    else:
        raise Unavailable("a chunk over a cache is three upstream calls; timed for pagedkv only")
    if isinstance(fn, Exception):
        raise Unavailable(f"upstream kernels not loaded: {fn}")
    ffi_args = [tvm_ffi.from_dlpack(t) for t in args] + list(scalars)
    return lambda: (fn(*ffi_args), o)[1]


def sdpa_impl(w: Workload, x: Inputs):
    _no_rope(w, "torch SDPA")
    if not w.dense_ok():
        raise Unavailable("ragged lengths (SDPA takes a dense batch)" if not w.mla else "no MLA in SDPA")
    b, n, m = w.batch, w.keys[0], w.qlen
    q4 = x.q.view(b, m, w.hq, D).transpose(1, 2)
    k4 = torch.stack(x.k).transpose(1, 2)
    v4 = torch.stack(x.v).transpose(1, 2)
    mask = None
    if w.kind == "prefill" and n != m:  # bottom-right causal: SDPA's is_causal is top-left
        mask = torch.arange(n, device=DEVICE)[None, :] <= (n - m + torch.arange(m, device=DEVICE))[:, None]
    causal = w.kind == "prefill" and n == m

    def run():
        o4 = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=causal,
                                                              scale=sm_scale(w), enable_gqa=True)
        return o4.transpose(1, 2).reshape(-1, w.hq, D)
    return run
