"""CPU (``llvm``) attention kernels: paged decode, paged prefill and ragged prefill.

Parallelism: ``T.parallel`` over work items (entry x query tile x kv head), grouped in chunks that
share one scratch allocation; the ``G`` query heads of a kv head stay in one item so each K/V row is
read and converted once per group. Inside an item the kernel walks the entry's keys ``TK`` at a time
(see ``_common``, ``_attn_cpu_macros`` and ``_attn_cpu_gemm``). Prefill items are numbered through a
per-entry tile prefix sum and visited in zig-zag order (first, last, second, second-to-last...) so
that the static split of ``T.parallel`` gives every thread a similar share of a causal workload.
Calls too small to pay for waking the thread pool run on the calling thread (a run-time work estimate;
the ``cpu_threads`` path of ``KernelConfig.paths`` forces either path at compile time, for tests).

Masking options (compile-time, ``KernelConfig.sliding_window`` / ``logits_soft_cap``; 0 leaves their
code out): a sliding window adds a per-row lower key bound to the causal / length limit and skips the
key tiles below the item's smallest bound, so a windowed decode reads about W keys; a soft-cap passes
each score through ``c * tanh(s / c)`` before masking (see ``_attn_cpu_gemm``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._attn_cpu_gemm import lim_size, make_gemm_macros, scratch_shapes
from ._attn_cpu_macros import make_attn_macros
from ._common import LOG2E, TilePlan, make_tile_plan
from ..kernel_spec import forced, normalize_paths


def _make_attend(plan: TilePlan, mac, load_tile):
    """The body of one work item, given the shared macros ``mac`` and the kernel's tile loader.

    ``load_tile(Kf, Vf, cur, kv, base, kpos0, h, j0, nk, rope)`` stages keys ``j0 .. j0 + nk`` of the
    entry (and zero K rows up to the next score block); ``kv`` is a kernel-specific tuple of buffers and
    parameters, ``base`` locates the entry in it, ``kpos0`` is the RoPE position of its key 0 and
    ``cur`` is a small int scratch. Tuples passed to macros hold only buffers and parameters: an
    expression unpacked from a tuple would become a mutable scalar allocation.
    """
    G, TK, W = plan.group, plan.tk, plan.window
    prepare, score, softmax, pv = make_gemm_macros(plan)

    def first_tile(kvlen, qlen, qt0):
        # Sliding window: the item's first row has the smallest lower bound, kvlen - qlen + qt0 + 1 - W;
        # tiles wholly below it are skipped (the per-key mask handles the first visited tile). The
        # loaders locate keys from j0, so starting late needs nothing else.
        if not W:
            return 0
        return T.max(kvlen - qlen + qt0 + 1 - W, 0) // TK

    @T.macro
    def attend(scr, q, q_pos, o, lse, tok0, ntok, qt0, qlen, kvlen, h, causal, rope, sm_scale, kv, base,
               kpos0):
        """Attention of tokens ``tok0 .. tok0 + ntok`` (token ``qt0`` of the entry onward), kv head h."""
        Qf, Qt, Kf, Vf, S, O, m, l, alpha, lim, invf, acc, red, acc_o0, acc_o1, mx, cur = scr
        apply_rope, rope_scale, rope_theta = rope
        if plan.rope:
            if apply_rope == 1:
                mac.init_inv_freq(invf, rope_theta)
        mac.load_q(Qf, q, q_pos, tok0, ntok, h, (apply_rope, rope_scale, invf),
                   sm_scale * T.float32(LOG2E))
        mac.init_state(m, l, O, ntok * G)
        prepare(Qf, Qt, lim, ntok * G, kvlen, causal, qlen, qt0)
        # Causal: the tile's last token sees keys < kvlen - qlen + qt0 + ntok; later tiles are skipped.
        kv_end: T.let[T.int32] = T.if_then_else(
            causal > 0, T.min(kvlen, kvlen - qlen + qt0 + ntok), kvlen)
        for kt in T.serial(first_tile(kvlen, qlen, qt0), T.max(kv_end + TK - 1, 0) // TK):
            # Keys of this tile that some row may see (the causal limit of the last token caps it).
            nk: T.let[T.int32] = T.min(TK, kv_end - kt * TK)
            load_tile(Kf, Vf, cur, kv, base, kpos0, h, kt * TK, nk, (apply_rope, rope_scale, invf))
            score(S, Qf, Qt, Kf, acc, red, nk)
            softmax(S, m, l, alpha, mx, lim, kt * TK, nk)
            pv(O, S, Vf, alpha, acc_o0, acc_o1, nk, ntok * G)
        mac.store(o, lse, O, m, l, tok0, ntok, h)

    return attend


#: Parallel chunks per call. Each chunk allocates the work-item scratch once and runs a contiguous
#: range of items, so scratch allocation is paid per chunk, not per item; 64 chunks still balance
#: any thread count up to tens of cores (TVM splits a parallel loop statically).
_MAX_CHUNKS = 64


def _make_runner(plan: TilePlan, item):
    """``run(n, serial, args)``: call ``item(it, scr, args)`` for items ``0 .. n``.

    The items run in up to ``_MAX_CHUNKS`` parallel chunks, or on the calling thread when ``serial``
    (a call too small to pay for waking the thread pool). ``serial`` is a PrimExpr (chosen at run time)
    or a Python bool (a forced path: only that branch is built).
    """
    D, DV, R, TK, RB, DC = plan.d, plan.dv, plan.rows, plan.tk, plan.rb, plan.dc
    LIM = lim_size(plan)
    shp = scratch_shapes(plan)

    @T.macro
    def chunk(c, nch, n, args):
        # Buffers under 1 KiB (acc*, red, mx, cur, m, l...) TVM places on the stack, where LLVM keeps
        # the register blocks in registers; the larger ones come from the thread's workspace pool.
        scr = (T.alloc_buffer((R, D), "float32"), T.alloc_buffer(shp["Qt"], "float32"),
               T.alloc_buffer((TK, D), "float32"), T.alloc_buffer((TK, DV), "float32"),
               T.alloc_buffer(shp["S"], "float32"), T.alloc_buffer((R, DV), "float32"),
               T.alloc_buffer((R,), "float32"), T.alloc_buffer((R,), "float32"),
               T.alloc_buffer((R,), "float32"), T.alloc_buffer((LIM,), "int32"),
               T.alloc_buffer((D // 2,), "float32"), T.alloc_buffer(shp["acc"], "float32"),
               T.alloc_buffer(shp["red"], "float32"), T.alloc_buffer((RB, DC), "float32"),
               T.alloc_buffer((RB, DC), "float32"), T.alloc_buffer(shp["mx"], "float32"),
               T.alloc_buffer((2,), "int32"))
        # The item loop starts at 0 and the item index is a let binding: TVM's CanonicalizeLoop (0.27)
        # rewrites a loop with a non-zero start to start at 0 but substitutes the shifted variable only in
        # the loop body, not in the bounds of the loops nested in it, which keep the unshifted (chunk-local)
        # variable. A windowed decode's key-tile loop starts at a tile computed from the entry (it // HKV),
        # so every chunk but the first read the wrong entry's start tile, often past its last key.
        for i in T.serial((c + 1) * n // nch - c * n // nch):
            it: T.let[T.int32] = c * n // nch + i
            item(it, scr, args)

    @T.macro
    def run(n, serial, args):
        if serial:
            chunk(0, 1, n, args)
        else:
            for c in T.parallel(T.min(n, _MAX_CHUNKS)):
                chunk(c, T.min(n, _MAX_CHUNKS), n, args)

    return run


def _make_paged_loader(plan: TilePlan, mac):
    """Tile loader over pages; ``kv = (pages, page_values, page_size)``, ``base`` = the entry's first
    ``page_values`` index. The (page, offset) cursor advances incrementally: one division per tile
    instead of one per key (the page size is a runtime value)."""
    D, DV, JB = plan.d, plan.dv, plan.jb

    @T.macro
    def load_tile(Kf, Vf, cur, kv, base, kpos0, h, j0, nk, rope):
        pages, page_values, ps = kv
        cur[0] = j0 // ps
        cur[1] = j0 % ps
        for j in T.serial(nk):
            for dd in T.vectorized(D):
                Kf[j, dd] = T.Cast("float32", pages[page_values[base + cur[0]], 0, h, cur[1], dd])
            for dd in T.vectorized(DV):
                Vf[j, dd] = T.Cast("float32", pages[page_values[base + cur[0]], 1, h, cur[1], dd])
            mac.rope_key(Kf, j, kpos0 + j0 + j, rope)
            cur[1] = cur[1] + 1
            if cur[1] == ps:
                cur[0] = cur[0] + 1
                cur[1] = 0
        for j in T.serial(nk, (nk + JB - 1) // JB * JB):
            mac.clear_key(Kf, j)

    return load_tile


def _make_ragged_loader(plan: TilePlan, mac):
    """Tile loader over contiguous rows; ``kv = (k, v)``, ``base`` = the entry's first row."""
    D, DV, JB = plan.d, plan.dv, plan.jb

    @T.macro
    def load_tile(Kf, Vf, cur, kv, base, kpos0, h, j0, nk, rope):
        k, v = kv
        for j in T.serial(nk):
            for dd in T.vectorized(D):
                Kf[j, dd] = T.Cast("float32", k[base + j0 + j, h, dd])
            for dd in T.vectorized(DV):
                Vf[j, dd] = T.Cast("float32", v[base + j0 + j, h, dd])
            mac.rope_key(Kf, j, kpos0 + j0 + j, rope)
        for j in T.serial(nk, (nk + JB - 1) // JB * JB):
            mac.clear_key(Kf, j)

    return load_tile


@T.macro
def _find_entry(ent, tile_ptr, t, batch):
    """Binary search: ``ent[0]`` = the entry b with ``tile_ptr[b] <= t < tile_ptr[b + 1]``."""
    ent[0] = 0
    ent[1] = batch
    while ent[1] - ent[0] > 1:
        if tile_ptr[(ent[0] + ent[1]) // 2] <= t:
            ent[0] = (ent[0] + ent[1]) // 2
        else:
            ent[1] = (ent[0] + ent[1]) // 2


def _zigzag(k, total):
    """Item order 0, total-1, 1, total-2, ...: pairs a cheap causal tile with an expensive one."""
    return T.if_then_else(k % 2 == 0, k // 2, total - 1 - k // 2)


def _kv_len(page_indptr, last_page_len, b, ps):
    """Keys of entry ``b`` in a paged layout (0 when it has no pages)."""
    npg = page_indptr[b + 1] - page_indptr[b]
    return T.if_then_else(npg > 0, (npg - 1) * ps + last_page_len[b], 0)


def _window_keys(kvlen, window):
    """Keys a decode row reads: all of them, or (sliding window) about the last ``window``."""
    return T.min(kvlen, window) if window else kvlen


#: Below these work estimates ((kv keys + 16) x kv heads, summed over work items) a kernel runs its
#: items on the calling thread: waking the thread pool (several microseconds, more on a loaded
#: machine) would cost more than the work.
_SERIAL_DECODE_WORK = 512
_SERIAL_PREFILL_WORK = 512


def cpu_threads(paths) -> str:
    """The ``cpu_threads`` path forced in ``paths`` (``KernelConfig.paths``, or any form
    ``normalize_paths`` takes): "auto", "serial" or "parallel"."""
    return forced(normalize_paths(paths), "cpu_threads")


def serial_arg(threads: str, work, threshold: int):
    """``run``'s ``serial`` argument: the run-time work-estimate test (auto), else the forced path as a
    Python bool, which ``run`` resolves at parse time (the other path is left out of the kernel)."""
    return work[0] < threshold if threads == "auto" else threads == "serial"


def attn_decode_paged_cpu(num_qo_heads, num_kv_heads, head_dim, dtype, *, sliding_window: int = 0,
                          logits_soft_cap: float = 0.0, paths=()):
    """``pagedkv_attn_decode_paged`` for the CPU.

    Signature (``docs/ARCHITECTURE.md``)::

        (q[B,Hq,D], pages[P,2,Hkv,ps,D], page_indptr[B+1], page_values[nnz], last_page_len[B],
         k_pos_offset[B], q_pos[B], o[B,Hq,D], lse[B,Hq],
         apply_rope:i32, rope_scale:f32, rope_theta:f32, sm_scale:f32)

    One work item per (sequence, kv head). ``sliding_window`` / ``logits_soft_cap``: the masking
    options (module docstring; 0: off). ``paths``: forced paths (``KernelConfig.paths``).
    """
    HQ, HKV, D, W = num_qo_heads, num_kv_heads, head_dim, sliding_window
    THREADS = cpu_threads(paths)
    plan = make_tile_plan(D, D, HQ // HKV, dtype, tokens_per_item=1, window=sliding_window,
                          soft_cap=logits_soft_cap)
    mac = make_attn_macros(plan)
    attend = _make_attend(plan, mac, _make_paged_loader(plan, mac))

    @T.macro
    def item(it, scr, args):
        q, q_pos, o, lse, pages, page_values, ps, page_indptr, last_page_len, k_pos_offset, rope, sm_scale = args
        attend(scr, q, q_pos, o, lse, it // HKV, 1, 0, 1,
               _kv_len(page_indptr, last_page_len, it // HKV, ps), it % HKV, 0, rope, sm_scale,
               (pages, page_values, ps), page_indptr[it // HKV], k_pos_offset[it // HKV])

    run = _make_runner(plan, item)

    @T.prim_func
    def attn_decode_paged(q_h: T.handle, pages_h: T.handle, page_indptr_h: T.handle, page_values_h: T.handle,
                          last_page_len_h: T.handle, k_pos_offset_h: T.handle, q_pos_h: T.handle,
                          o_h: T.handle, lse_h: T.handle, apply_rope: T.int32, rope_scale: T.float32,
                          rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"global_symbol": "pagedkv_attn_decode_paged", "tirx.noalias": True})
        B, P, ps, nnz = T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (B, HQ, D), dtype, elem_offset=T.int32())
        pages = T.match_buffer(pages_h, (P, 2, HKV, ps, D), dtype)
        page_indptr = T.match_buffer(page_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        page_values = T.match_buffer(page_values_h, (nnz,), "int32", elem_offset=T.int32())
        last_page_len = T.match_buffer(last_page_len_h, (B,), "int32", elem_offset=T.int32())
        k_pos_offset = T.match_buffer(k_pos_offset_h, (B,), "int32", elem_offset=T.int32())
        q_pos = T.match_buffer(q_pos_h, (B,), "int32", elem_offset=T.int32())
        o = T.match_buffer(o_h, (B, HQ, D), dtype, elem_offset=T.int32())
        lse = T.match_buffer(lse_h, (B, HQ), "float32", elem_offset=T.int32())
        work = T.alloc_buffer((1,), "int32")
        if THREADS == "auto":  # static: a forced path needs no estimate
            work[0] = 0
            for b in T.serial(B):
                work[0] = work[0] + (_window_keys(_kv_len(page_indptr, last_page_len, b, ps), W) + 16) * HKV
        run(B * HKV, serial_arg(THREADS, work, _SERIAL_DECODE_WORK),
            (q, q_pos, o, lse, pages, page_values, ps, page_indptr, last_page_len, k_pos_offset,
             (apply_rope, rope_scale, rope_theta), sm_scale))

    return attn_decode_paged


@T.macro
def _count_tiles(tile_ptr, work, q_indptr, batch, tq, hkv, kv_indptr, kv_scale, estimate):
    """``tile_ptr[b]`` = query tiles of entries before ``b`` (a serial prefix sum, B steps) and the work
    estimate ``work[0]`` = sum over tiles of (keys + 16) x kv heads; an entry's keys are estimated as
    ``(kv_indptr[b + 1] - kv_indptr[b]) * kv_scale`` (rows, or pages times the page size).
    ``estimate`` (static) is False when the thread path is forced: then no estimate is computed."""
    tile_ptr[0] = 0
    if estimate:
        work[0] = 0
    for b in T.serial(batch):
        tile_ptr[b + 1] = tile_ptr[b] + (q_indptr[b + 1] - q_indptr[b] + tq - 1) // tq
        if estimate:
            work[0] = work[0] + (tile_ptr[b + 1] - tile_ptr[b]) * hkv * (
                (kv_indptr[b + 1] - kv_indptr[b]) * kv_scale + 16)


@T.macro
def _locate(ent, tile_ptr, it, hkv, batch, tq):
    """Work item ``it`` -> ``ent[0]`` = entry, ``ent[1]`` = first token of its query tile in the entry."""
    _find_entry(ent, tile_ptr, _zigzag(it // hkv, tile_ptr[batch]), batch)
    ent[1] = (_zigzag(it // hkv, tile_ptr[batch]) - tile_ptr[ent[0]]) * tq


def attn_prefill_paged_cpu(num_qo_heads, num_kv_heads, head_dim, dtype, *, sliding_window: int = 0,
                           logits_soft_cap: float = 0.0, paths=()):
    """``pagedkv_attn_prefill_paged`` for the CPU.

    Signature::

        (q[n,Hq,D], q_indptr[B+1], pages[P,2,Hkv,ps,D], page_indptr[B+1], page_values[nnz],
         last_page_len[B], k_pos_offset[B], q_pos[n], o[n,Hq,D], lse[n,Hq],
         causal:i32, apply_rope:i32, rope_scale:f32, rope_theta:f32, sm_scale:f32)

    One work item per (entry, query tile, kv head). ``sliding_window`` / ``logits_soft_cap``: the
    masking options (module docstring; 0: off). ``paths``: forced paths (``KernelConfig.paths``).
    """
    HQ, HKV, D = num_qo_heads, num_kv_heads, head_dim
    plan = make_tile_plan(D, D, HQ // HKV, dtype, tokens_per_item=None, window=sliding_window,
                          soft_cap=logits_soft_cap)
    TQ, THREADS = plan.tq, cpu_threads(paths)
    mac = make_attn_macros(plan)
    attend = _make_attend(plan, mac, _make_paged_loader(plan, mac))

    @T.macro
    def item(it, scr, args):
        tile_ptr, batch, q, q_indptr, q_pos, o, lse, kvb, causal, rope, sm_scale = args
        pages, page_values, ps, page_indptr, last_page_len, k_pos_offset = kvb
        ent = T.alloc_buffer((2,), "int32")
        _locate(ent, tile_ptr, it, HKV, batch, TQ)
        b: T.let[T.int32] = ent[0]
        qt0: T.let[T.int32] = ent[1]
        qlen: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
        attend(scr, q, q_pos, o, lse, q_indptr[b] + qt0, T.min(TQ, qlen - qt0), qt0, qlen,
               _kv_len(page_indptr, last_page_len, b, ps), it % HKV, causal, rope, sm_scale,
               (pages, page_values, ps), page_indptr[b], k_pos_offset[b])

    run = _make_runner(plan, item)

    @T.prim_func
    def attn_prefill_paged(q_h: T.handle, q_indptr_h: T.handle, pages_h: T.handle, page_indptr_h: T.handle,
                           page_values_h: T.handle, last_page_len_h: T.handle, k_pos_offset_h: T.handle,
                           q_pos_h: T.handle, o_h: T.handle, lse_h: T.handle, causal: T.int32,
                           apply_rope: T.int32, rope_scale: T.float32, rope_theta: T.float32,
                           sm_scale: T.float32):
        T.func_attr({"global_symbol": "pagedkv_attn_prefill_paged", "tirx.noalias": True})
        n, B, P, ps, nnz = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (n, HQ, D), dtype, elem_offset=T.int32())
        q_indptr = T.match_buffer(q_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        pages = T.match_buffer(pages_h, (P, 2, HKV, ps, D), dtype)
        page_indptr = T.match_buffer(page_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        page_values = T.match_buffer(page_values_h, (nnz,), "int32", elem_offset=T.int32())
        last_page_len = T.match_buffer(last_page_len_h, (B,), "int32", elem_offset=T.int32())
        k_pos_offset = T.match_buffer(k_pos_offset_h, (B,), "int32", elem_offset=T.int32())
        q_pos = T.match_buffer(q_pos_h, (n,), "int32", elem_offset=T.int32())
        o = T.match_buffer(o_h, (n, HQ, D), dtype, elem_offset=T.int32())
        lse = T.match_buffer(lse_h, (n, HQ), "float32", elem_offset=T.int32())
        tile_ptr = T.alloc_buffer((B + 1,), "int32")
        work = T.alloc_buffer((1,), "int32")
        _count_tiles(tile_ptr, work, q_indptr, B, TQ, HKV, page_indptr, ps, THREADS == "auto")
        run(tile_ptr[B] * HKV, serial_arg(THREADS, work, _SERIAL_PREFILL_WORK),
            (tile_ptr, B, q, q_indptr, q_pos, o, lse,
             (pages, page_values, ps, page_indptr, last_page_len, k_pos_offset), causal,
             (apply_rope, rope_scale, rope_theta), sm_scale))

    return attn_prefill_paged


def attn_prefill_ragged_cpu(num_qo_heads, num_kv_heads, head_dim, v_head_dim, dtype, *, sliding_window: int = 0,
                            logits_soft_cap: float = 0.0, paths=()):
    """``pagedkv_attn_prefill_ragged`` for the CPU.

    Signature::

        (q[n,Hq,D], k[m,Hkv,D], v[m,Hkv,Dv], q_indptr[B+1], kv_indptr[B+1], q_pos[n],
         k_pos_offset[B], o[n,Hq,Dv], lse[n,Hq],
         causal:i32, apply_rope:i32, rope_scale:f32, rope_theta:f32, sm_scale:f32)

    One work item per (entry, query tile, kv head). ``sliding_window`` / ``logits_soft_cap``: the
    masking options (module docstring; 0: off). ``paths``: forced paths (``KernelConfig.paths``).
    """
    HQ, HKV, D, DV = num_qo_heads, num_kv_heads, head_dim, v_head_dim
    plan = make_tile_plan(D, DV, HQ // HKV, dtype, tokens_per_item=None, window=sliding_window,
                          soft_cap=logits_soft_cap)
    TQ, THREADS = plan.tq, cpu_threads(paths)
    mac = make_attn_macros(plan)
    attend = _make_attend(plan, mac, _make_ragged_loader(plan, mac))

    @T.macro
    def item(it, scr, args):
        tile_ptr, batch, q, q_indptr, q_pos, o, lse, kvb, causal, rope, sm_scale = args
        k, v, kv_indptr, k_pos_offset = kvb
        ent = T.alloc_buffer((2,), "int32")
        _locate(ent, tile_ptr, it, HKV, batch, TQ)
        b: T.let[T.int32] = ent[0]
        qt0: T.let[T.int32] = ent[1]
        qlen: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
        attend(scr, q, q_pos, o, lse, q_indptr[b] + qt0, T.min(TQ, qlen - qt0), qt0, qlen,
               kv_indptr[b + 1] - kv_indptr[b], it % HKV, causal, rope, sm_scale,
               (k, v), kv_indptr[b], k_pos_offset[b])

    run = _make_runner(plan, item)

    @T.prim_func
    def attn_prefill_ragged(q_h: T.handle, k_h: T.handle, v_h: T.handle, q_indptr_h: T.handle,
                            kv_indptr_h: T.handle, q_pos_h: T.handle, k_pos_offset_h: T.handle,
                            o_h: T.handle, lse_h: T.handle, causal: T.int32, apply_rope: T.int32,
                            rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"global_symbol": "pagedkv_attn_prefill_ragged", "tirx.noalias": True})
        n, m, B = T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (n, HQ, D), dtype, elem_offset=T.int32())
        k = T.match_buffer(k_h, (m, HKV, D), dtype, elem_offset=T.int32())
        v = T.match_buffer(v_h, (m, HKV, DV), dtype, elem_offset=T.int32())
        q_indptr = T.match_buffer(q_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        kv_indptr = T.match_buffer(kv_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        q_pos = T.match_buffer(q_pos_h, (n,), "int32", elem_offset=T.int32())
        k_pos_offset = T.match_buffer(k_pos_offset_h, (B,), "int32", elem_offset=T.int32())
        o = T.match_buffer(o_h, (n, HQ, DV), dtype, elem_offset=T.int32())
        lse = T.match_buffer(lse_h, (n, HQ), "float32", elem_offset=T.int32())
        tile_ptr = T.alloc_buffer((B + 1,), "int32")
        work = T.alloc_buffer((1,), "int32")
        _count_tiles(tile_ptr, work, q_indptr, B, TQ, HKV, kv_indptr, 1, THREADS == "auto")
        run(tile_ptr[B] * HKV, serial_arg(THREADS, work, _SERIAL_PREFILL_WORK),
            (tile_ptr, B, q, q_indptr, q_pos, o, lse, (k, v, kv_indptr, k_pos_offset), causal,
             (apply_rope, rope_scale, rope_theta), sm_scale))

    return attn_prefill_ragged
