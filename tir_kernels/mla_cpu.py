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

from ._attn_cpu_macros import make_attn_macros
from ._common import TilePlan, make_tile_plan
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

#: Query heads per work item at most (rows of the decode row tile).
MAX_CHUNK = 16
#: No inline RoPE in MLA kernels (the model rotates the rope part before append_mla_kv): the tile plans
#: say ``rope=False``, which leaves the RoPE code out; the shared body still takes the RoPE tuple.
_NO_ROPE = (0, 1.0, 10000.0)


def head_chunk(num_heads: int) -> int:
    """Heads per work item: the largest divisor of ``num_heads`` that is at most ``MAX_CHUNK``."""
    return next(c for c in range(min(num_heads, MAX_CHUNK), 0, -1) if num_heads % c == 0)


def _make_latent_loader(plan: TilePlan, mac):
    """Tile loader over latent pages: ``Kf[j] = latent``, ``Vf[j] = latent[:DV]``; ``kv = (pages,
    page_values, page_size)``, ``base`` = the entry's first ``page_values`` index; the head index is
    ignored (every head chunk reads the same latents)."""
    D, DV, JB = plan.d, plan.dv, plan.jb

    @T.macro
    def load_tile(Kf, Vf, cur, kv, base, kpos0, h, j0, nk, rope):
        pages, page_values, ps = kv
        cur[0] = j0 // ps
        cur[1] = j0 % ps
        for j in T.serial(nk):
            for dd in T.vectorized(D):
                Kf[j, dd] = T.Cast("float32", pages[page_values[base + cur[0]], 0, 0, cur[1], dd])
            for dd in T.vectorized(DV):
                Vf[j, dd] = T.Cast("float32", pages[page_values[base + cur[0]], 0, 0, cur[1], dd])
            cur[1] = cur[1] + 1
            if cur[1] == ps:
                cur[0] = cur[0] + 1
                cur[1] = 0
        for j in T.serial(nk, (nk + JB - 1) // JB * JB):
            mac.clear_key(Kf, j)

    return load_tile


def mla_attn_decode_paged_cpu(num_heads, kv_lora_rank, qk_rope_head_dim, dtype, *, paths=()):
    """``pagedkv_mla_attn_decode_paged`` for the CPU.

    Signature (``docs/ARCHITECTURE.md``)::

        (q[B,H,DL], pages[P,1,1,ps,DL], page_indptr[B+1], page_values[nnz], last_page_len[B],
         o[B,H,DV], lse[B,H], sm_scale:f32)

    One work item per (sequence, head chunk). ``paths``: forced paths (``KernelConfig.paths``).
    """
    H, DV = num_heads, kv_lora_rank
    DL = kv_lora_rank + qk_rope_head_dim
    GC = head_chunk(H)
    NC, THREADS = H // GC, cpu_threads(paths)
    plan = make_tile_plan(DL, DV, GC, dtype, tokens_per_item=1, rope=False)
    mac = make_attn_macros(plan)
    attend = _make_attend(plan, mac, _make_latent_loader(plan, mac))

    @T.macro
    def item(it, scr, args):
        q, o, lse, pages, page_values, ps, page_indptr, last_page_len, sm_scale = args
        attend(scr, q, q, o, lse, it // NC, 1, 0, 1, _kv_len(page_indptr, last_page_len, it // NC, ps),
               it % NC, 0, _NO_ROPE, sm_scale, (pages, page_values, ps), page_indptr[it // NC], 0)

    run = _make_runner(plan, item)

    @T.prim_func
    def mla_attn_decode_paged(q_h: T.handle, pages_h: T.handle, page_indptr_h: T.handle,
                              page_values_h: T.handle, last_page_len_h: T.handle, o_h: T.handle,
                              lse_h: T.handle, sm_scale: T.float32):
        T.func_attr({"global_symbol": "pagedkv_mla_attn_decode_paged", "tirx.noalias": True})
        B, P, ps, nnz = T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (B, H, DL), dtype, elem_offset=T.int32())
        pages = T.match_buffer(pages_h, (P, 1, 1, ps, DL), dtype)
        page_indptr = T.match_buffer(page_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        page_values = T.match_buffer(page_values_h, (nnz,), "int32", elem_offset=T.int32())
        last_page_len = T.match_buffer(last_page_len_h, (B,), "int32", elem_offset=T.int32())
        o = T.match_buffer(o_h, (B, H, DV), dtype, elem_offset=T.int32())
        lse = T.match_buffer(lse_h, (B, H), "float32", elem_offset=T.int32())
        work = T.alloc_buffer((1,), "int32")
        if THREADS == "auto":  # static: a forced path needs no estimate
            work[0] = 0
            for b in T.serial(B):
                work[0] = work[0] + (_kv_len(page_indptr, last_page_len, b, ps) + 16) * NC
        run(B * NC, serial_arg(THREADS, work, _SERIAL_DECODE_WORK),
            (q, o, lse, pages, page_values, ps, page_indptr, last_page_len, sm_scale))

    return mla_attn_decode_paged


def mla_attn_prefill_paged_cpu(num_heads, kv_lora_rank, qk_rope_head_dim, dtype, *, paths=()):
    """``pagedkv_mla_attn_prefill_paged`` for the CPU.

    Signature::

        (q[n,H,DL], q_indptr[B+1], pages[P,1,1,ps,DL], page_indptr[B+1], page_values[nnz],
         last_page_len[B], o[n,H,DV], lse[n,H], causal:i32, sm_scale:f32)

    One work item per (entry, query tile, head chunk). ``paths``: forced paths
    (``KernelConfig.paths``).
    """
    H, DV = num_heads, kv_lora_rank
    DL = kv_lora_rank + qk_rope_head_dim
    GC = head_chunk(H)
    NC, THREADS = H // GC, cpu_threads(paths)
    plan = make_tile_plan(DL, DV, GC, dtype, tokens_per_item=None, rope=False)
    TQ = plan.tq
    mac = make_attn_macros(plan)
    attend = _make_attend(plan, mac, _make_latent_loader(plan, mac))

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

    @T.prim_func
    def mla_attn_prefill_paged(q_h: T.handle, q_indptr_h: T.handle, pages_h: T.handle,
                               page_indptr_h: T.handle, page_values_h: T.handle, last_page_len_h: T.handle,
                               o_h: T.handle, lse_h: T.handle, causal: T.int32, sm_scale: T.float32):
        T.func_attr({"global_symbol": "pagedkv_mla_attn_prefill_paged", "tirx.noalias": True})
        n, B, P, ps, nnz = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (n, H, DL), dtype, elem_offset=T.int32())
        q_indptr = T.match_buffer(q_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        pages = T.match_buffer(pages_h, (P, 1, 1, ps, DL), dtype)
        page_indptr = T.match_buffer(page_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        page_values = T.match_buffer(page_values_h, (nnz,), "int32", elem_offset=T.int32())
        last_page_len = T.match_buffer(last_page_len_h, (B,), "int32", elem_offset=T.int32())
        o = T.match_buffer(o_h, (n, H, DV), dtype, elem_offset=T.int32())
        lse = T.match_buffer(lse_h, (n, H), "float32", elem_offset=T.int32())
        tile_ptr = T.alloc_buffer((B + 1,), "int32")
        work = T.alloc_buffer((1,), "int32")
        _count_tiles(tile_ptr, work, q_indptr, B, TQ, NC, page_indptr, ps, THREADS == "auto")
        run(tile_ptr[B] * NC, serial_arg(THREADS, work, _SERIAL_PREFILL_WORK),
            (tile_ptr, B, q, q_indptr, o, lse, (pages, page_values, ps, page_indptr, last_page_len),
             causal, sm_scale))

    return mla_attn_prefill_paged
