"""The epilogue of the tensor-core CUDA prefill (``attention_cuda_prefill_tc``): o = O / sum and lse = m +
log2(sum) (base 2) of the lane's rows, and for a row that saw no key (sum 0) the empty state, o = 0 and lse =
``EMPTY_LSE``, each written once here (``_o_value``, ``_store_lse``) for both ways o leaves:

* ``make_store``: from each lane's fragments straight to o (a partial-state kernel's float32 o: the stage buffer
  holds the storage dtype);
* ``make_store_staged``: through the stage buffer (every tile's storage-dtype o): each lane's O / sum into
  row-major staged rows, then consecutive threads copy consecutive 16 bytes (or, o not 16-byte aligned, elements)
  of a token's G rows, which lie together in o. From the fragments, a warp's store touched 8 rows x 8 bytes: 8 sectors for 64
  bytes, and 64 two-byte stores a thread (wg1t's SASS, 2026-12-06).

Each factory takes the kernel's ``TcParams`` and returns its ``@T.macro``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._common import no_keys
from ._common_cuda import shfl_xor
from ._epilogue_cuda import row_lse
from ._mma_cuda import aligned16, c_frag, cp_async_wait
from ._prefill_tc_params import TcParams


def _o_value(p: TcParams):
    """``value(oacc, lsum, mt, rr, dn, c, dtype)``: o's element (in ``dtype``: the storage dtype, or float32 for a
    partial-state kernel) of accumulator ``dn * 4 + rr * 2 + c`` of m16 tile ``mt``: O / sum, 0 for a row that
    saw no key."""
    ON = p.on

    def value(oacc, lsum, mt, rr, dn, c, dtype):
        return T.Cast(dtype, T.if_then_else(no_keys(lsum[mt * 2 + rr]), T.float32(0),
                                            oacc[mt * ON + dn * 4 + rr * 2 + c] / lsum[mt * 2 + rr]))

    return value


def _store_lse(p: TcParams):
    G, MT, row_ok, wrow, o_row = p.g, p.mt, p.row_ok, p.wrow, p.o_row

    @T.macro
    def store_lse(lse, m, lsum, ti, h, w, lane):
        """Row sums over the quad, then lse = m + log2(sum) (base 2) from the quad's first lane; a row that saw
        no key (sum 0) writes the empty state."""
        for j in T.unroll(MT * 2):
            lsum[j] = lsum[j] + shfl_xor(lsum[j], 1)
            lsum[j] = lsum[j] + shfl_xor(lsum[j], 2)
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                if T.And(row_ok(wrow(w, mt) + c_frag(lane, 2 * rr)[0], ti), lane % 4 == 0):
                    lse[ti[4] + o_row(wrow(w, mt) + c_frag(lane, 2 * rr)[0])[0],
                        h * G + o_row(wrow(w, mt) + c_frag(lane, 2 * rr)[0])[1]] = row_lse(m[mt * 2 + rr],
                                                                                           lsum[mt * 2 + rr])

    return store_lse


def make_store(p: TcParams):
    """``store(o, lse, oacc, m, lsum, ti, h, w, lane)``: o from each lane's fragments, and the lse."""
    G, MT, NDN, row_ok, wrow, o_row = p.g, p.mt, p.ndn, p.row_ok, p.wrow, p.o_row
    store_lse, o_value = _store_lse(p), _o_value(p)

    @T.macro
    def store(o, lse, oacc, m, lsum, ti, h, w, lane):
        store_lse(lse, m, lsum, ti, h, w, lane)
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                if row_ok(wrow(w, mt) + c_frag(lane, 2 * rr)[0], ti):
                    for dn in T.unroll(NDN):
                        for c in T.unroll(2):
                            o[ti[4] + o_row(wrow(w, mt) + c_frag(lane, 2 * rr)[0])[0],
                              h * G + o_row(wrow(w, mt) + c_frag(lane, 2 * rr)[0])[1],
                              dn * 8 + c_frag(lane, c)[1]] = o_value(oacc, lsum, mt, rr, dn, c, o.dtype)

    return store


def _o_copier(p: TcParams, width: int):
    """The macro copying the staged O rows out, ``width`` elements a copy (8: 16 bytes)."""
    G, NT, VS, cfg, row_ok, o_row = p.g, p.nt, p.vs, p.tile, p.row_ok, p.o_row
    per_row = p.dv // width

    @T.macro
    def copy_out(smem, o, ti, h, tid):
        for it in T.unroll(cfg.rows * per_row // NT):
            if row_ok(T.truncdiv(it * NT + tid, per_row), ti):
                for e in T.vectorized(width):
                    o[ti[4] + o_row(T.truncdiv(it * NT + tid, per_row))[0],
                      h * G + o_row(T.truncdiv(it * NT + tid, per_row))[1],
                      T.truncmod(it * NT + tid, per_row) * width + e] = \
                        smem[T.truncdiv(it * NT + tid, per_row) * VS + T.truncmod(it * NT + tid, per_row) * width + e]

    return copy_out


def make_store_staged(p: TcParams):
    """``store_staged(smem, o, lse, oacc, m, lsum, ti, h, tid, w, lane)``: o through the stage buffer ``smem``
    (its first ``rows`` x ``vs`` elements), and the lse."""
    D, DV, MT, NDN, VS, cfg, wrow, dtype = p.d, p.dv, p.mt, p.ndn, p.vs, p.tile, p.wrow, p.dtype
    if cfg.rows * VS > (cfg.bar_base(D, DV) if p.wg else cfg.smem_bytes(D, DV) // 2):
        raise ValueError(f"pagedkv.tir_kernels: tile {cfg.name!r}: O's {cfg.rows} x {VS} staging elements do not "
                         f"fit its stages")
    store_lse, o_value = _store_lse(p), _o_value(p)
    o_out_vec, o_out_elem = _o_copier(p, 8), _o_copier(p, 1)

    @T.macro
    def store_staged(smem, o, lse, oacc, m, lsum, ti, h, tid, w, lane):
        """After a barrier (every warp done with the stages), each lane's O / sum into the staged rows, a
        barrier, then the rows out (``_o_copier``). The staged rows reach past the stages into Q's rows: this
        thread's copies are drained first, since a block without key tiles never waited for its Q copies (they
        join the first tile's group), which could land on the staged O (wrong o rows of an entry with no keys,
        GPU suite on the H100; the emulated entry (120, 0))."""
        store_lse(lse, m, lsum, ti, h, w, lane)
        T.evaluate(cp_async_wait(0))
        T.tvm_storage_sync("shared")
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                for dn in T.unroll(NDN):
                    for c in T.unroll(2):
                        smem[(wrow(w, mt) + c_frag(lane, 2 * rr)[0]) * VS + dn * 8 + c_frag(lane, c)[1]] = \
                            o_value(oacc, lsum, mt, rr, dn, c, dtype)
        T.tvm_storage_sync("shared")
        if aligned16(T.address_of(o[0, 0, 0])) == 1:
            o_out_vec(smem, o, ti, h, tid)
        else:
            o_out_elem(smem, o, ti, h, tid)

    return store_staged


__all__ = ["make_store", "make_store_staged"]
