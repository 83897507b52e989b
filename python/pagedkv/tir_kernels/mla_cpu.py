"""CPU (``llvm``) MLA attention: absorbed attention of per-head queries over paged latents.

An MLA page holds one latent vector of ``DL = kv_lora_rank + qk_rope_head_dim`` elements per token
(``pages[P, 1, 1, ps, DL]``). In the weight-absorbed form every query head attends to the same latent
sequence: the key of a token is its whole latent, the value its first ``DV = kv_lora_rank`` elements.
That is grouped attention with one kv head and a group of all ``H`` query heads, so the kernels reuse the
MHA work-item body of ``attention_cpu`` with a loader that reads K and V from the one latent row.

Work items split the ``H`` heads into *head chunks* of ``GC`` heads (the largest divisor of ``H`` up to
``MAX_CHUNK``): chunk ``c`` is a virtual kv head whose query heads are ``c*GC .. (c+1)*GC`` and whose
keys are the shared latents, so even a single decode sequence runs on several threads.
Semantics (base-2 lse, empty rows, bottom-right causal) are those of the MHA kernels.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._abi import abi_prim_func, spec_op
from ._attn_cpu_macros import make_attn_macros
from ._common import TilePlan, make_tile_plan
from ._fp8 import decode_e4m3, fp8_scales
from .attention_cpu import (
    _SERIAL_DECODE_WORK,
    _SERIAL_PREFILL_WORK,
    _count_tiles,
    _kv_len,
    _locate,
    _make_attend,
    _make_runner,
    cpu_threads,
    serial_arg,
)
from ._variant_cpu import CpuVariant
from ..ops import shape_values

#: Query heads per work item at most (rows of the decode row tile).
MAX_CHUNK = 16
#: No inline RoPE in MLA kernels (the model rotates the rope part before append_mla_kv): the tile plans
#: say ``rope=False``, which leaves the RoPE code out; the shared body still takes the RoPE tuple.
_NO_ROPE = (0, 1.0, 10000.0)


def head_chunk(num_heads: int) -> int:
    """Heads per work item: the largest divisor of ``num_heads`` that is at most ``MAX_CHUNK``."""
    return next(c for c in range(min(num_heads, MAX_CHUNK), 0, -1) if num_heads % c == 0)


def _make_latent_loader(plan: TilePlan, mac, fp8=None):
    """Tile loader over latent pages: ``Kf[j] = latent``, ``Vf[j] = latent[:DV]``; ``kv = (pages,
    page_values, page_size)``, ``base`` = the entry's first ``page_values`` index; the head index is
    ignored (every head chunk reads the same latents). ``fp8``: the pages hold e4m3 codes, staged as their
    values (``ckv_scale`` / ``kpe_scale`` are folded into q's two parts and ``ckv_scale`` into o)."""
    D, DV, JB = plan.d, plan.dv, plan.jb
    # the staged value of a latent element: its code decoded, or the storage dtype cast (one loader for both)
    read = decode_e4m3 if fp8 is not None else (lambda x: T.Cast("float32", x))

    @T.macro
    def load_tile(Kf, Vf, cur, kv, base, kpos0, h, j0, nk, rope):
        pages, page_values, ps = kv
        cur[0] = j0 // ps
        cur[1] = j0 % ps
        for j in T.serial(nk):
            for dd in T.vectorized(D):
                Kf[j, dd] = read(pages[page_values[base + cur[0]], 0, 0, cur[1], dd])
            for dd in T.vectorized(DV):
                Vf[j, dd] = read(pages[page_values[base + cur[0]], 0, 0, cur[1], dd])
            cur[1] = cur[1] + 1
            if cur[1] == ps:
                cur[0] = cur[0] + 1
                cur[1] = 0
        for j in T.serial(nk, (nk + JB - 1) // JB * JB):
            mac.clear_key(Kf, j)

    return load_tile


def _mla_plan(spec, tokens_per_item):
    """``(plan, heads per chunk, chunks)``: a head chunk is a virtual kv head over the shared latents.
    MLA has no attention options: the variant is the plain causal one (``CpuVariant()``)."""
    gc = head_chunk(spec.num_qo_heads)
    plan = make_tile_plan(spec.latent_dim, spec.kv_lora_rank, gc, spec.dtype, tokens_per_item, CpuVariant(),
                          rope=False)
    return plan, spec.num_qo_heads // gc


def mla_attn_decode_paged_cpu(spec):
    """``pagedkv_mla_attn_decode_paged`` of ``spec`` (an MLA ``KernelSpec``) for the CPU; arguments from
    the op table (``q[b,Hq,DL]``, latent pages, ``o[b,Hq,R]``).

    One work item per (sequence, head chunk). ``spec.paths`` forces a thread path.
    """
    THREADS = cpu_threads(spec.paths)
    plan, NC = _mla_plan(spec, 1)
    fp8 = fp8_scales(spec)
    mac = make_attn_macros(plan, fp8)
    attend = _make_attend(plan, mac, _make_latent_loader(plan, mac, fp8))

    @T.macro
    def item(it, scr, args):
        q, o, lse, pages, page_values, ps, page_indptr, last_page_len, sm_scale = args
        attend(scr, q, q, o, lse, it // NC, 1, 0, 1, _kv_len(page_indptr, last_page_len, it // NC, ps),
               it % NC, 0, _NO_ROPE, sm_scale, (pages, page_values, ps), page_indptr[it // NC], 0)

    run = _make_runner(plan, item)

    @T.macro
    def body(q, pages, page_indptr, page_values, last_page_len, o, lse, sm_scale, dims):
        b, _p, ps, _nnz = dims
        work = T.alloc_buffer((1,), "int32")
        if THREADS == "auto":  # static: a forced path needs no estimate
            work[0] = 0
            for e in T.serial(b):
                work[0] = work[0] + (_kv_len(page_indptr, last_page_len, e, ps) + 16) * NC
        run(b * NC, serial_arg(THREADS, work, _SERIAL_DECODE_WORK),
            (q, o, lse, pages, page_values, ps, page_indptr, last_page_len, sm_scale))

    return abi_prim_func(spec_op("mla_attn_decode_paged", spec), shape_values(spec), spec.dtype, body,
                         page_dtype=spec.page_dtype)


def mla_attn_prefill_paged_cpu(spec):
    """``pagedkv_mla_attn_prefill_paged`` of ``spec`` (an MLA ``KernelSpec``) for the CPU; arguments from
    the op table.

    One work item per (entry, query tile, head chunk). ``spec.paths`` forces a thread path.
    """
    THREADS = cpu_threads(spec.paths)
    plan, NC = _mla_plan(spec, None)
    fp8 = fp8_scales(spec)
    TQ, mac = plan.tq, make_attn_macros(plan, fp8)
    attend = _make_attend(plan, mac, _make_latent_loader(plan, mac, fp8))

    @T.macro
    def item(it, scr, args):
        tile_ptr, batch, q, q_indptr, o, lse, kvb, causal, sm_scale = args
        pages, page_values, ps, page_indptr, last_page_len = kvb
        ent = T.alloc_buffer((2,), "int32")
        _locate(ent, tile_ptr, it, NC, batch, TQ)
        b: T.let[T.int32] = ent[0]
        qt0: T.let[T.int32] = ent[1]
        qlen: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
        attend(scr, q, q, o, lse, q_indptr[b] + qt0, T.min(TQ, qlen - qt0), qt0, qlen,
               _kv_len(page_indptr, last_page_len, b, ps), it % NC, causal, _NO_ROPE, sm_scale,
               (pages, page_values, ps), page_indptr[b], 0)

    run = _make_runner(plan, item)

    @T.macro
    def body(q, q_indptr, pages, page_indptr, page_values, last_page_len, o, lse, causal, sm_scale, dims):
        _n, b, _p, ps, _nnz = dims
        tile_ptr = T.alloc_buffer((b + 1,), "int32")
        work = T.alloc_buffer((1,), "int32")
        _count_tiles(tile_ptr, work, q_indptr, b, TQ, NC, page_indptr, ps, THREADS == "auto")
        run(tile_ptr[b] * NC, serial_arg(THREADS, work, _SERIAL_PREFILL_WORK),
            (tile_ptr, b, q, q_indptr, o, lse, (pages, page_values, ps, page_indptr, last_page_len),
             causal, sm_scale))

    return abi_prim_func(spec_op("mla_attn_prefill_paged", spec), shape_values(spec), spec.dtype, body,
                         page_dtype=spec.page_dtype)
