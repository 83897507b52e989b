"""K / V tile copies of the tensor-core CUDA prefill (``attention_cuda_prefill_tc``): global memory -> a stage
of shared memory, one ``cp.async`` group per call.

Each thread copies ``NIT`` 16-byte chunks of a K (or V) tile; chunk ``it`` of thread ``tid`` is key
``key0(tid) + KSTEP it`` of the tile, dims ``dim0(tid) ..`` (``_Chunks``: consecutive threads on consecutive
chunks of a row). What varies from tile
to tile is then one term, so the copies of a tile cost a handful of integer instructions a chunk:

* the entry's first K / V row (ragged: ``kv_indptr[b]``; paged: ``page_indptr[b]``) is read once a block into
  the tile info ``ti[TI_KV0]``, not once a chunk (every barrier's memory clobber made nvcc reload it);
* paged: a cursor (page slot, offset in the page) of the thread's first chunk of the tile takes one division
  by ``ps`` (a run-time value) a tile; each next chunk, ``KSTEP`` keys on, adds ``KSTEP``'s quotient and
  remainder (read once a block) and carries one page when the offset reaches ``ps``: no division, two loop
  invariants in registers (a quotient and remainder per chunk, kept instead, spilled the 128-key tile); the
  pages of a tile's chunks are looked up when the tile before is issued (``look_ahead``, where a thread copies
  at most ``PAGE_LOOKAHEAD_MAX`` chunks a tile at head dim 128), so that no warp waits for them between the
  block barrier and its GEMMs (the copies of a tile would: ptxas issues a tile's lookups together, then its
  copies);
* K and V chunks at the same keys (same head dims) are copied by one loop: one page lookup serves both;
* a tile whose keys are all below the block's bound (every tile but the last) copies without a per-chunk test;
  the last one tests each chunk and writes zeros past the keys any row sees (a masked P = 0 must never meet
  stale data, and a tile past the last one is all zeros, never read).

Ragged k / v views that do not start at a 16-byte aligned address (a block-uniform run-time test) take element
loads through registers instead, 8 in flight a thread (slower, same results); pages always take the 16-byte path.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from tvm.script import tirx as T

from ._common_cuda import paged_kv_len
from ._mma_cuda import aligned16, cp_async16, cp_async_commit
from ._prefill_tc_params import TcParams

#: Slot of the tile info ``ti`` (``attention_cuda_prefill_tc``'s ``locate``) holding the entry's first K / V row
#: (ragged) or first page slot (paged); paged, the next ones hold ``KSTEP // ps``, ``KSTEP % ps`` and the
#: cursor (``KvCopies.ti_slots`` in all).
TI_KV0 = 8
#: Paged: the pages of a thread's chunks of the next tile, looked up when a tile is issued (``look_ahead``), sit
#: in the tile info from ``TI_PAGE0`` where a thread copies at most ``PAGE_LOOKAHEAD_MAX`` chunks a tile (one
#: register each for the block's life) and the head dim is at least ``PAGE_LOOKAHEAD_MIN_DIM``; elsewhere each
#: tile looks its pages up as it copies. At head dim 64 the registers tipped ptxas (TVM's register-usage level
#: 10) into capping tc2's paged kernel (12 q / 4 kv heads, bf16, windowed + capped) at 128 registers (two blocks
#: an SM) with 20 bytes of spills.
TI_PAGE0 = TI_KV0 + 5
PAGE_LOOKAHEAD_MAX, PAGE_LOOKAHEAD_MIN_DIM = 4, 128


class _Chunks:
    """Which 16-byte (``width`` 8) or 2-byte (``width`` 1) chunk of a ``tk`` x ``dim`` tile a thread copies:
    ``at(idx)`` = (key, first dim) of chunk ``idx`` (``idx = it * active + tid``), row-major (consecutive threads
    on consecutive chunks of a key). A pass of the first ``active`` threads copies ``kstep`` whole keys, the most
    that fit the threads and divide the tile, so chunk it of a thread is its chunk 0, ``it * kstep`` keys on, same
    dims; where a key's chunks do not divide the threads (head dim 96: 12 a key, 256 threads copy 16 keys a pass
    with 192 of them) the others idle in the copies (``idle``)."""

    def __init__(self, tk: int, dim: int, threads: int, width: int):
        self.per_row, self.width = dim // width, width
        self.kstep = max(k for k in range(1, max(threads // self.per_row, 1) + 1) if tk % k == 0)
        self.active = self.kstep * self.per_row
        if self.active > threads or tk * self.per_row % self.active:
            raise NotImplementedError(f"pagedkv.tir_kernels: {threads} threads cannot copy {tk} keys of {dim} "
                                      f"elements in whole keys a pass")
        self.idle = self.active < threads
        self.count = tk * self.per_row // self.active  # chunks a thread

    def at(self, idx, div=T.truncdiv, mod=T.truncmod):
        return div(idx, self.per_row), mod(idx, self.per_row) * self.width


class KvCopies(NamedTuple):
    """The copies of a kernel: ``ti_slots`` (the tile info's size), ``kv_len(kvb, b)`` (keys of entry b),
    ``prepare(ti, kvb, tid, cursor)`` (once a block, entry ``ti[0]`` located: the slots from ``TI_KV0`` on;
    ``cursor`` False: a kernel that does not issue these copies, none of the paged cursor's) and
    ``issue_kv(smem, base_k, base_v, kvb, ti, kt, h, tid)`` (K and V of tile kt into one stage, one cp.async group:
    one ``wait_group 0`` covers both)."""

    ti_slots: int
    kv_len: object
    prepare: object
    issue_kv: object


class _Source(NamedTuple):
    """Where the K / V rows of an entry are (``_paged_source``, ``_ragged_source``): ``ti_slots``, ``kv_len``
    (as ``KvCopies``), ``elem(kvb, c01, ti, key, h, d)`` (the element of key ``key`` of the entry),
    ``tile_elem(kvb, c01, ti, kt, it, tid, h)`` (the first element of the thread's chunk ``it`` of tile kt) and,
    paged, the cursor's macros ``cursor(ti, kvb, kt, tid)``, ``advance(ti, kvb)`` and ``look_ahead(ti, kvb, kt,
    tid)`` with ``ahead`` (pages looked up a tile ahead); None / False ragged."""

    ti_slots: int
    kv_len: object
    elem: object
    tile_elem: object
    cursor: object = None
    advance: object = None
    look_ahead: object = None
    ahead: bool = False


def _paged_cursor(p: TcParams, ch: _Chunks):
    """The paged cursor of the thread's chunks: ``cursor(ti, kvb, kt, tid)`` (page slot past the entry's first
    and offset of its chunk 0 of tile ``kt``: one division by ``ps``) and ``advance(ti, kvb)`` (``kstep`` keys on,
    to its next chunk: no division)."""
    tk = p.tk

    @T.macro
    def cursor(ti, kvb, kt, tid):
        ti[TI_KV0 + 3] = T.truncdiv(kt * tk + ch.at(tid)[0], kvb[3])
        ti[TI_KV0 + 4] = T.truncmod(kt * tk + ch.at(tid)[0], kvb[3])

    @T.macro
    def advance(ti, kvb):
        ti[TI_KV0 + 4] = ti[TI_KV0 + 4] + ti[TI_KV0 + 2]
        ti[TI_KV0 + 3] = ti[TI_KV0 + 3] + ti[TI_KV0 + 1]
        if ti[TI_KV0 + 4] >= kvb[3]:
            ti[TI_KV0 + 4] = ti[TI_KV0 + 4] - kvb[3]
            ti[TI_KV0 + 3] = ti[TI_KV0 + 3] + 1

    return cursor, advance


def _paged_source(p: TcParams, chunks) -> _Source:
    """K / V through the page table (``kvb`` = (pages, page_values, page_indptr, ps, last_page_len, ...))."""
    if p.d != p.dv:
        raise NotImplementedError("pagedkv.tir_kernels: paged K and V tiles have the same head dim")
    tk, ch = p.tk, chunks[0]
    ahead = ch.count <= PAGE_LOOKAHEAD_MAX and p.d >= PAGE_LOOKAHEAD_MIN_DIM
    cursor, advance = _paged_cursor(p, ch)

    def kv_len(kvb, b):
        return paged_kv_len(kvb[2], kvb[4], b, kvb[3])

    def elem(kvb, c01, ti, key, h, d):
        return kvb[0][kvb[1][ti[TI_KV0] + T.truncdiv(key, kvb[3])], c01, h, T.truncmod(key, kvb[3]), d]

    @T.macro
    def look_ahead(ti, kvb, kt, tid):
        """The pages of the thread's chunks of tile ``kt`` into ``ti[TI_PAGE0 + it]`` (none for keys at or past
        the entry's: its page slots end there). Run when the tile before is issued (and by ``prepare`` for the
        first): the loads' latency passes during a tile, not between the block barrier and the warp's GEMMs,
        where the copies of a tile would otherwise wait for them."""
        cursor(ti, kvb, kt, tid)
        for it in T.unroll(ch.count):
            if kt * tk + ch.at(tid)[0] + it * ch.kstep < ti[5]:
                ti[TI_PAGE0 + it] = kvb[1][ti[TI_KV0] + ti[TI_KV0 + 3]]
            advance(ti, kvb)

    def tile_elem(kvb, c01, ti, kt, it, tid, h):
        """At the cursor (``cursor`` / ``advance``), its page looked up ahead (``look_ahead``) or now."""
        page = ti[TI_PAGE0 + it] if ahead else kvb[1][ti[TI_KV0] + ti[TI_KV0 + 3]]
        return kvb[0][page, c01, h, ti[TI_KV0 + 4], chunks[c01].at(tid)[1]]

    return _Source(TI_PAGE0 + (ch.count if ahead else 0), kv_len, elem, tile_elem, cursor, advance, look_ahead,
                   ahead)


def _ragged_source(p: TcParams, chunks) -> _Source:
    """K / V as ragged views (``kvb`` = (k, v, kv_indptr, ...)): an entry's rows from ``kv_indptr[b]`` on."""
    tk = p.tk

    def kv_len(kvb, b):
        return kvb[2][b + 1] - kvb[2][b]

    def elem(kvb, c01, ti, key, h, d):
        return (kvb[0] if c01 == 0 else kvb[1])[ti[TI_KV0] + key, h, d]

    def tile_elem(kvb, c01, ti, kt, it, tid, h):
        ch = chunks[c01]
        return elem(kvb, c01, ti, kt * tk + ch.at(tid)[0] + it * ch.kstep, h, ch.at(tid)[1])

    return _Source(TI_KV0 + 1, kv_len, elem, tile_elem)


def _prepare(p: TcParams, chunks, src: _Source):
    """``prepare(ti, kvb, tid, cursor)`` (``KvCopies``)."""
    paged, ahead, look_ahead = p.paged, src.ahead, src.look_ahead

    @T.macro
    def prepare(ti, kvb, tid, cursor):
        ti[TI_KV0] = kvb[2][ti[0]]  # ragged: kv_indptr[b]; paged: page_indptr[b]
        if paged and cursor:  # the cursor's step: KSTEP keys as (page slots, offset)
            ti[TI_KV0 + 1] = T.truncdiv(chunks[0].kstep, kvb[3])
            ti[TI_KV0 + 2] = T.truncmod(chunks[0].kstep, kvb[3])
            if ahead:
                look_ahead(ti, kvb, ti[7], tid)  # the first tile's pages

    return prepare


def _vec_loader(p: TcParams, chunks, src: _Source, ops: tuple[int, ...]):
    """16-byte ``cp.async`` copies of tile ``kt`` of K (``ops`` (0,)), V ((1,)) or both ((0, 1): chunks at the
    same keys), ``bases`` = their first elements in ``dst``; completed by the caller's wait (+ barrier). Every
    chunk of a thread unrolled: all in flight at once. A tile whose keys are all below the block's bound copies
    without a per-chunk test; the last one writes zeros past the keys any row sees."""
    tk, paged, dtype, store_index, ch = p.tk, p.paged, p.dtype, p.store_index, chunks[ops[0]]
    tile_elem, cursor, advance, look_ahead = src.tile_elem, src.cursor, src.advance, src.look_ahead
    last_copies = src.ahead and ops[-1] == 1  # the tile's last copies (V, or K and V): the next tile's pages

    @T.macro
    def copy(dst, bases, kvb, ti, kt, h, tid, it):
        T.evaluate(cp_async16(
            T.address_of(dst[bases[0] + store_index(ch.at(tid)[0] + it * ch.kstep, ch.at(tid)[1], ops[0])]),
            T.address_of(tile_elem(kvb, ops[0], ti, kt, it, tid, h))))
        if len(ops) == 2:
            T.evaluate(cp_async16(
                T.address_of(dst[bases[1] + store_index(ch.at(tid)[0] + it * ch.kstep, chunks[1].at(tid)[1], 1)]),
                T.address_of(tile_elem(kvb, 1, ti, kt, it, tid, h))))

    @T.macro
    def zero(dst, bases, tid, it):
        for e in T.vectorized(8):
            dst[bases[0] + store_index(ch.at(tid)[0] + it * ch.kstep, ch.at(tid)[1] + e, ops[0])] = \
                T.Cast(dtype, T.float32(0))
        if len(ops) == 2:
            for e in T.vectorized(8):
                dst[bases[1] + store_index(ch.at(tid)[0] + it * ch.kstep, chunks[1].at(tid)[1] + e, 1)] = \
                    T.Cast(dtype, T.float32(0))

    @T.macro
    def copies(dst, bases, kvb, ti, kt, h, tid):
        if paged:
            cursor(ti, kvb, kt, tid)
        if (kt + 1) * tk <= ti[6]:
            for it in T.unroll(ch.count):
                copy(dst, bases, kvb, ti, kt, h, tid, it)
                if paged:
                    advance(ti, kvb)
        else:
            for it in T.unroll(ch.count):
                if kt * tk + ch.at(tid)[0] + it * ch.kstep < ti[6]:
                    copy(dst, bases, kvb, ti, kt, h, tid, it)
                else:
                    zero(dst, bases, tid, it)
                if paged:
                    advance(ti, kvb)

    @T.macro
    def load(dst, bases, kvb, ti, kt, h, tid):
        if ch.idle:  # threads past ``active`` have no chunk: their cursor's rows lie past the tile
            if tid < ch.active:
                copies(dst, bases, kvb, ti, kt, h, tid)
        else:
            copies(dst, bases, kvb, ti, kt, h, tid)
        if last_copies:
            look_ahead(ti, kvb, kt + 1, tid)

    return load


def _elem_loader(p: TcParams, src: _Source, c01: int, dim: int):
    """Element loads through registers (ragged views not 16-byte aligned), 8 in flight a thread (all of them
    unrolled would hold 64 registers), zeros past the keys any row sees."""
    tk, dtype, store_index, elem = p.tk, p.dtype, p.store_index, src.elem
    ch = _Chunks(tk, dim, p.nt, 1)
    threads = ch.active
    if ch.count % 8:
        raise NotImplementedError(f"pagedkv.tir_kernels: {ch.count} element loads a thread (8 in flight)")

    @T.macro
    def rows(dst, base, kvb, ti, kt, h, tid):
        for it0 in T.serial(ch.count // 8):
            for it1 in T.unroll(8):
                if kt * tk + ch.at((it0 * 8 + it1) * threads + tid)[0] < ti[6]:
                    dst[base + store_index(ch.at((it0 * 8 + it1) * threads + tid)[0],
                                           ch.at((it0 * 8 + it1) * threads + tid)[1], c01)] = \
                        elem(kvb, c01, ti, kt * tk + ch.at((it0 * 8 + it1) * threads + tid)[0], h,
                             ch.at((it0 * 8 + it1) * threads + tid)[1])
                else:
                    dst[base + store_index(ch.at((it0 * 8 + it1) * threads + tid)[0],
                                           ch.at((it0 * 8 + it1) * threads + tid)[1], c01)] = \
                        T.Cast(dtype, T.float32(0))

    @T.macro
    def load(dst, base, kvb, ti, kt, h, tid):
        if ch.idle:  # threads past ``active`` have no element
            if tid < threads:
                rows(dst, base, kvb, ti, kt, h, tid)
        else:
            rows(dst, base, kvb, ti, kt, h, tid)

    return load


def _aligned(p: TcParams, kvb):
    """16-byte global loads are safe: pages always (no element offset, rows of D elements, an allocation's
    base), ragged k / v when their first elements' addresses are (rows of ``Hkv * D`` elements keep it; the
    test is on the address, as a view may put its offset in the pointer or in ``elem_offset``)."""
    if p.paged:
        return True
    return T.And(aligned16(T.address_of(kvb[0][0, 0, 0])) == 1, aligned16(T.address_of(kvb[1][0, 0, 0])) == 1)


def make_kv_copies(p: TcParams) -> KvCopies:
    """The copies of the K / V tiles of kernel ``p`` (``tk`` keys by its threads, row-major:
    ``TcParams.store_index``)."""
    threads, dims = p.nt, (p.d, p.dv)
    chunks = (_Chunks(p.tk, dims[0], threads, 8), _Chunks(p.tk, dims[1], threads, 8))
    src = (_paged_source if p.paged else _ragged_source)(p, chunks)
    # K and V chunks of a thread at the same keys (same head dims): one loop copies both.
    same_keys = all(chunks[0].at(t, operator.floordiv, operator.mod)[0]
                    == chunks[1].at(t, operator.floordiv, operator.mod)[0] for t in range(threads)) and \
        chunks[0].kstep == chunks[1].kstep and chunks[0].count == chunks[1].count and chunks[0].active == chunks[1].active
    load_vec = (_vec_loader(p, chunks, src, (0,)), _vec_loader(p, chunks, src, (1,)))
    load_pair = _vec_loader(p, chunks, src, (0, 1)) if same_keys else None
    load_elem = (_elem_loader(p, src, 0, dims[0]), _elem_loader(p, src, 1, dims[1]))

    @T.macro
    def issue_kv(smem, base_k, base_v, kvb, ti, kt, h, tid):
        if _aligned(p, kvb):
            if same_keys:
                load_pair(smem, (base_k, base_v), kvb, ti, kt, h, tid)
            else:
                load_vec[0](smem, (base_k,), kvb, ti, kt, h, tid)
                load_vec[1](smem, (base_v,), kvb, ti, kt, h, tid)
        else:
            load_elem[0](smem, base_k, kvb, ti, kt, h, tid)
            load_elem[1](smem, base_v, kvb, ti, kt, h, tid)
        T.evaluate(cp_async_commit())

    return KvCopies(src.ti_slots, src.kv_len, _prepare(p, chunks, src), issue_kv)


__all__ = ["PAGE_LOOKAHEAD_MAX", "PAGE_LOOKAHEAD_MIN_DIM", "TI_KV0", "TI_PAGE0", "KvCopies", "make_kv_copies"]
