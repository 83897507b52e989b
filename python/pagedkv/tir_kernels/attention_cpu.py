"""CPU (``llvm``) attention kernels: paged decode, paged prefill and ragged prefill.

Parallelism: ``T.parallel`` over work items (entry x query tile x kv head), grouped in chunks that
share one scratch allocation; the ``G`` query heads of a kv head stay in one item so each K/V row is
read and converted once per group. Inside an item the kernel walks the entry's keys ``TK`` at a time
(see ``_common``, ``_attn_cpu_macros`` and ``_attn_cpu_gemm``). Prefill items are numbered through a
per-entry tile prefix sum; prefill items run kv head by kv head, each entry's query tiles in zig-zag order
(first, last, second, second-to-last...), so that the static split of ``T.parallel`` gives every thread a
similar share of a causal workload and consecutive items reuse one head's keys (``_locate_by_head``).
The paged prefill takes 64-row items (``_PAGED_PREFILL_ROWS``), the ragged one 32.
Calls too small to pay for waking the thread pool run on the calling thread (a run-time work estimate;
the ``cpu_threads`` path of ``KernelSpec.paths`` forces either path at compile time, for tests).

The attention variant (causal, sliding window, logits soft-cap of the ``KernelSpec``) is defined once,
in ``_variant_cpu.CpuVariant``: the work-item body takes its key range from it and the score steps
(``_attn_cpu_gemm``) its mask and logits transform; a windowed decode reads about W keys. Factories take
the spec; PrimFunc headers come from the op table (``_abi.abi_prim_func``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._abi import abi_prim_func, spec_op
from ._attn_cpu_gemm import make_gemm_macros, scratch_shapes
from ._attn_cpu_macros import make_attn_macros
from ._common import LOG2E, TilePlan, make_tile_plan
from ._fp8 import decode_e4m3, encode_e4m3, fp8_scales
from ._variant_cpu import CpuVariant
from ..kernel_spec import forced, normalize_paths
from ..ops import shape_values


def _make_attend(plan: TilePlan, mac, load_tile):
    """The body of one work item, given the shared macros ``mac`` and the kernel's tile loader.

    ``load_tile(Kf, Vf, cur, kv, base, kpos0, h, j0, nk, rope)`` stages keys ``j0 .. j0 + nk`` of the
    entry (and zero K rows up to the next score block); ``kv`` is a kernel-specific tuple of buffers and
    parameters, ``base`` locates the entry in it, ``kpos0`` is the RoPE position of its key 0 and
    ``cur`` is a small int scratch. Tuples passed to macros hold only buffers and parameters: an
    expression unpacked from a tuple would become a mutable scalar allocation.
    """
    G, TK, var = plan.group, plan.tk, plan.variant
    prepare, score, softmax, pv = make_gemm_macros(plan)

    @T.macro
    def attend(scr, q, q_pos, o, lse, tok0, ntok, qt0, qlen, kvlen, h, causal, rope, sm_scale, kv, base,
               kpos0):
        """Attention of tokens ``tok0 .. tok0 + ntok`` (token ``qt0`` of the entry onward), kv head h."""
        Qf, Qt, Kf, Vf, S, O, m, l, alpha, lim, invf, acc, red, acc_o0, acc_o1, mx, cur = scr
        apply_rope, rope_scale, rope_theta = rope
        if plan.rope:
            if mac.rope_on(apply_rope):
                mac.init_inv_freq(invf, apply_rope, rope_theta)
        mac.load_q(Qf, q, q_pos, tok0, ntok, h, (apply_rope, rope_scale, invf),
                   sm_scale * T.float32(LOG2E))
        mac.init_state(m, l, O, ntok * G)
        prepare(Qf, Qt, lim, ntok * G, kvlen, causal, qlen, qt0)
        # The variant's key range of the tile: key tiles outside it are skipped.
        kv_end: T.let[T.int32] = var.kv_end(causal, kvlen, qlen, qt0, ntok)
        for kt in T.serial(var.first_tile(kvlen, qlen, qt0, TK), T.max(kv_end + TK - 1, 0) // TK):
            # Keys of this tile that some row may see (the causal limit of the last token caps it).
            nk: T.let[T.int32] = T.min(TK, kv_end - kt * TK)
            load_tile(Kf, Vf, cur, kv, base, kpos0, h, kt * TK, nk, (apply_rope, rope_scale, invf))
            if var.hides_keys(lim, plan.rows, ntok * G, kt * TK, nk):
                mac.isolate_values(Kf, Vf, nk)
            score(S, Qf, Qt, Kf, acc, red, nk, ntok * G)
            softmax(S, m, l, alpha, mx, lim, kt * TK, nk, ntok * G)
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
    LIM = plan.variant.lim_size(R)
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


def _make_paged_loader(plan: TilePlan, mac, fp8=None):
    """Tile loader over pages; ``kv = (pages, page_values, page_size)``, ``base`` = the entry's first
    ``page_values`` index. The (page, offset) cursor advances incrementally: one division per tile
    instead of one per key (the page size is a runtime value). ``fp8``: the pages hold e4m3 codes, staged as
    their values (the scales are folded into q and o by the macros)."""
    D, DV, JB = plan.d, plan.dv, plan.jb
    # the staged value of a page element: its code decoded, or the storage dtype cast (one loader for both)
    read = decode_e4m3 if fp8 is not None else (lambda x: T.Cast("float32", x))

    @T.macro
    def load_tile(Kf, Vf, cur, kv, base, kpos0, h, j0, nk, rope):
        pages, page_values, ps = kv
        cur[0] = j0 // ps
        cur[1] = j0 % ps
        for j in T.serial(nk):
            for dd in T.vectorized(D):
                Kf[j, dd] = read(pages[page_values[base + cur[0]], 0, h, cur[1], dd])
            for dd in T.vectorized(DV):
                Vf[j, dd] = read(pages[page_values[base + cur[0]], 1, h, cur[1], dd])
            mac.rope_key(Kf, j, kpos0 + j0 + j, rope)
            cur[1] = cur[1] + 1
            if cur[1] == ps:
                cur[0] = cur[0] + 1
                cur[1] = 0
        for j in T.serial(nk, (nk + JB - 1) // JB * JB):
            mac.clear_key(Kf, j)

    return load_tile


def _make_ragged_loader(plan: TilePlan, mac, fp8=None):
    """Tile loader over contiguous rows; ``kv = (k, v)``, ``base`` = the entry's first row. ``fp8`` (an MHA cache
    with FP8 pages): k and v are staged as the values their pages hold, ``e4m3(k / k_scale)`` (the scales folded
    into q and o as for the pages), so every pass reads a key as the same number, whether it comes from the
    pages or from this forward's new tokens: the attention is the same however a forward is split."""
    if fp8 is not None:
        return _make_ragged_loader_fp8(plan, mac, fp8)
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


def _make_ragged_loader_fp8(plan: TilePlan, mac, fp8):
    # The round trip runs in three loops through buffers (x / scale, its code, the code's value) rather than as
    # one expression: encode and decode reuse their operands many times, and TIR expressions are trees, so
    # ``decode_e4m3(quantize(x))`` is a few hundred copies of ``x`` per element; the simplifier and lowering passes
    # took a minute over each kernel with it. Storing x / scale as float32 is the division ``quantize`` does, so
    # the codes are the same.
    D, DV, JB, F = plan.d, plan.dv, plan.jb, fp8

    @T.macro
    def load_tile(Kf, Vf, cur, kv, base, kpos0, h, j0, nk, rope):
        k, v = kv
        code = T.alloc_buffer((max(D, DV),), "uint8")
        for j in T.serial(nk):
            for dd in T.vectorized(D):
                Kf[j, dd] = T.Cast("float32", k[base + j0 + j, h, dd]) / F.k_of(h)
            for dd in T.vectorized(D):
                code[dd] = encode_e4m3(Kf[j, dd])
            for dd in T.vectorized(D):
                Kf[j, dd] = decode_e4m3(code[dd])
            for dd in T.vectorized(DV):
                Vf[j, dd] = T.Cast("float32", v[base + j0 + j, h, dd]) / F.v_of(h)
            for dd in T.vectorized(DV):
                code[dd] = encode_e4m3(Vf[j, dd])
            for dd in T.vectorized(DV):
                Vf[j, dd] = decode_e4m3(code[dd])
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


#: Below these work estimates ((kv keys + 16) x kv heads, summed over work items) a kernel runs its
#: items on the calling thread: waking the thread pool (several microseconds, more on a loaded
#: machine) would cost more than the work.
_SERIAL_DECODE_WORK = 512
_SERIAL_PREFILL_WORK = 512


def cpu_threads(paths) -> str:
    """The ``cpu_threads`` path forced in ``paths`` (``KernelSpec.paths``, or any form
    ``normalize_paths`` takes): "auto", "serial" or "parallel"."""
    return forced(normalize_paths(paths), "cpu_threads")


def serial_arg(threads: str, work, threshold: int):
    """``run``'s ``serial`` argument: the run-time work-estimate test (auto), else the forced path as a
    Python bool, which ``run`` resolves at parse time (the other path is left out of the kernel)."""
    return work[0] < threshold if threads == "auto" else threads == "serial"


def attn_decode_paged_cpu(spec):
    """``pagedkv_attn_decode_paged`` of ``spec`` (a ``KernelSpec``) for the CPU; arguments from the op table.

    One work item per (sequence, kv head). The spec's variant (window, soft-cap) is ``CpuVariant``;
    ``spec.paths`` forces a thread path.
    """
    HKV, THREADS = spec.num_kv_heads, cpu_threads(spec.paths)
    plan = make_tile_plan(spec.head_dim, spec.head_dim, spec.num_qo_heads // HKV, spec.dtype, 1,
                          CpuVariant.from_spec(spec), rope_table=spec.rope)
    fp8 = fp8_scales(spec)
    var, mac = plan.variant, make_attn_macros(plan, fp8)
    attend = _make_attend(plan, mac, _make_paged_loader(plan, mac, fp8))

    @T.macro
    def item(it, scr, args):
        q, q_pos, o, lse, pages, page_values, ps, page_indptr, last_page_len, k_pos_offset, rope, sm_scale = args
        attend(scr, q, q_pos, o, lse, it // HKV, 1, 0, 1,
               _kv_len(page_indptr, last_page_len, it // HKV, ps), it % HKV, 0, rope, sm_scale,
               (pages, page_values, ps), page_indptr[it // HKV], k_pos_offset[it // HKV])

    run = _make_runner(plan, item)

    @T.macro
    def body(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, apply_rope,
             rope_scale, rope_theta, sm_scale, dims):
        b, _p, ps, _nnz = dims
        work = T.alloc_buffer((1,), "int32")
        if THREADS == "auto":  # static: a forced path needs no estimate
            work[0] = 0
            for e in T.serial(b):
                work[0] = work[0] + (var.decode_keys(_kv_len(page_indptr, last_page_len, e, ps)) + 16) * HKV
        run(b * HKV, serial_arg(THREADS, work, _SERIAL_DECODE_WORK),
            (q, q_pos, o, lse, pages, page_values, ps, page_indptr, last_page_len, k_pos_offset,
             (apply_rope, rope_scale, rope_theta), sm_scale))

    return abi_prim_func(spec_op("attn_decode_paged", spec), shape_values(spec), spec.dtype, body,
                         page_dtype=spec.page_dtype)


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


@T.macro
def _locate_by_head(ent, tile_ptr, it, batch, tq):
    """Work item ``it`` of a GQA prefill -> ``ent[0]`` = entry, ``ent[1]`` = first token of its query tile;
    its kv head is ``it // tile_ptr[batch]``.

    Items run head-major (all query tiles of kv head 0, then head 1...), each entry's tiles together and in
    zig-zag order within the entry, so a thread's consecutive items read the same entry x kv head keys while
    they are still in its caches; the zig-zag keeps a causal entry's cheap and expensive tiles paired in every
    contiguous range of items (the static split of ``T.parallel``). Measured (single thread, CPU time, the
    benchmark's shapes): the causal ragged prefill L=512 took 15% less time than in tile-major order (the
    next item read another head's keys); the paged prefill, whose page rows are copied into the K/V tile
    anyway, was unchanged.
    """
    _find_entry(ent, tile_ptr, it % tile_ptr[batch], batch)
    ent[1] = _zigzag(it % tile_ptr[batch] - tile_ptr[ent[0]], tile_ptr[ent[0] + 1] - tile_ptr[ent[0]]) * tq


#: Query rows (tokens x the GQA group) per paged prefill item. Staging a key tile (the page rows gathered and
#: converted to float32) cost about a quarter of the kernel's time with 32-row items (perf, and a variant that
#: skipped it); 64 rows halve that share per FLOP (single thread, B=2 Lq=128 L=512 fp32: 0.97x -> 1.15x torch
#: SDPA in CPU time). 128 rows were no faster (the 128 x D query tile no longer fits the L1 cache).
_PAGED_PREFILL_ROWS = 64


def attn_prefill_paged_cpu(spec):
    """``pagedkv_attn_prefill_paged`` of ``spec`` for the CPU; arguments from the op table.

    One work item per (entry, query tile, kv head); variant and paths as in ``attn_decode_paged_cpu``.
    """
    HKV, THREADS = spec.num_kv_heads, cpu_threads(spec.paths)
    plan = make_tile_plan(spec.head_dim, spec.head_dim, spec.num_qo_heads // HKV, spec.dtype, None,
                          CpuVariant.from_spec(spec), prefill_rows=_PAGED_PREFILL_ROWS,
                          rope_table=spec.rope)
    fp8 = fp8_scales(spec)
    TQ, mac = plan.tq, make_attn_macros(plan, fp8)
    attend = _make_attend(plan, mac, _make_paged_loader(plan, mac, fp8))

    @T.macro
    def item(it, scr, args):
        tile_ptr, batch, q, q_indptr, q_pos, o, lse, kvb, causal, rope, sm_scale = args
        pages, page_values, ps, page_indptr, last_page_len, k_pos_offset = kvb
        ent = T.alloc_buffer((2,), "int32")
        _locate_by_head(ent, tile_ptr, it, batch, TQ)
        b: T.let[T.int32] = ent[0]
        qt0: T.let[T.int32] = ent[1]
        qlen: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
        attend(scr, q, q_pos, o, lse, q_indptr[b] + qt0, T.min(TQ, qlen - qt0), qt0, qlen,
               _kv_len(page_indptr, last_page_len, b, ps), it // tile_ptr[batch], causal, rope, sm_scale,
               (pages, page_values, ps), page_indptr[b], k_pos_offset[b])

    run = _make_runner(plan, item)

    @T.macro
    def body(q, q_indptr, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, causal,
             apply_rope, rope_scale, rope_theta, sm_scale, dims):
        _n, b, _p, ps, _nnz = dims
        tile_ptr = T.alloc_buffer((b + 1,), "int32")
        work = T.alloc_buffer((1,), "int32")
        _count_tiles(tile_ptr, work, q_indptr, b, TQ, HKV, page_indptr, ps, THREADS == "auto")
        run(tile_ptr[b] * HKV, serial_arg(THREADS, work, _SERIAL_PREFILL_WORK),
            (tile_ptr, b, q, q_indptr, q_pos, o, lse,
             (pages, page_values, ps, page_indptr, last_page_len, k_pos_offset), causal,
             (apply_rope, rope_scale, rope_theta), sm_scale))

    return abi_prim_func(spec_op("attn_prefill_paged", spec), shape_values(spec), spec.dtype, body,
                         page_dtype=spec.page_dtype)


def attn_prefill_ragged_cpu(spec):
    """``pagedkv_attn_prefill_ragged`` of ``spec`` for the CPU (value head dim ``spec.v_head_dim``);
    arguments from the op table.

    One work item per (entry, query tile, kv head); variant and paths as in ``attn_decode_paged_cpu``.
    """
    HKV, THREADS = spec.num_kv_heads, cpu_threads(spec.paths)
    plan = make_tile_plan(spec.head_dim, spec.v_head_dim, spec.num_qo_heads // HKV, spec.dtype, None,
                          CpuVariant.from_spec(spec), rope_table=spec.rope)
    # An MLA cache's ragged attention (self_attention) reads the model's up-projected k / v, not cached values.
    fp8 = None if spec.is_mla else fp8_scales(spec)
    TQ, mac = plan.tq, make_attn_macros(plan, fp8)
    attend = _make_attend(plan, mac, _make_ragged_loader(plan, mac, fp8))

    @T.macro
    def item(it, scr, args):
        tile_ptr, batch, q, q_indptr, q_pos, o, lse, kvb, causal, rope, sm_scale = args
        k, v, kv_indptr, k_pos_offset = kvb
        ent = T.alloc_buffer((2,), "int32")
        _locate_by_head(ent, tile_ptr, it, batch, TQ)
        b: T.let[T.int32] = ent[0]
        qt0: T.let[T.int32] = ent[1]
        qlen: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
        attend(scr, q, q_pos, o, lse, q_indptr[b] + qt0, T.min(TQ, qlen - qt0), qt0, qlen,
               kv_indptr[b + 1] - kv_indptr[b], it // tile_ptr[batch], causal, rope, sm_scale,
               (k, v), kv_indptr[b], k_pos_offset[b])

    run = _make_runner(plan, item)

    @T.macro
    def body(q, k, v, q_indptr, kv_indptr, q_pos, k_pos_offset, o, lse, causal, apply_rope, rope_scale,
             rope_theta, sm_scale, dims):
        _n, _m, b = dims
        tile_ptr = T.alloc_buffer((b + 1,), "int32")
        work = T.alloc_buffer((1,), "int32")
        _count_tiles(tile_ptr, work, q_indptr, b, TQ, HKV, kv_indptr, 1, THREADS == "auto")
        run(tile_ptr[b] * HKV, serial_arg(THREADS, work, _SERIAL_PREFILL_WORK),
            (tile_ptr, b, q, q_indptr, q_pos, o, lse, (k, v, kv_indptr, k_pos_offset), causal,
             (apply_rope, rope_scale, rope_theta), sm_scale))

    return abi_prim_func(spec_op("attn_prefill_ragged", spec), shape_values(spec), spec.dtype, body)
