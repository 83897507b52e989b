"""K / V tiles by TMA for the tensor-core CUDA prefill (``attention_cuda_prefill_tc``'s ``TcTile.tma`` tiles,
"wg2t", "wg1t"): the tensor maps, the boxes of a key tile, the wait for one and the V rows zeroed after it.

A stage's K / V tiles land 128-byte swizzled (``_wgmma_cuda.Sw128Layout``) at the stage's bases of a view of the
kernel's buffer that starts at its first 1024-byte boundary; stage ``s``'s mbarrier sits at ``cfg.bar_base(s)``.

* Ragged: one tensor map of k and one of v (``TensorMap3``); thread 0 arms the stage's mbarrier with the tile's
  bytes and issues one box (64 keys x 64 dims of one head) per column block of K and of V.
* Paged: one tensor map of the page pool (``PagedTensorMap``); a box = 8 keys of one page x 64 dims of K or V
  (pages of a multiple of 8 keys, which the PrimFunc's host code tests); the 32 boxes of a 64-key tile (8 key
  groups x K / V x 2 column blocks) are issued by lane 0 of every warp, ``8 / warps`` groups each, with their
  pages looked up when the previous tile was issued (``TI_NEXT_PAGE ..``), none for groups at or past the
  entry's keys (their page slots may lie past the entry's); thread 0 arms the mbarrier with all the bytes. Why
  spread: a TMA load takes warp-uniform operands, so 32 lanes of one warp with 32 boxes ran as a 32-trip
  ``ELECT`` / ``R2UR`` loop in SASS, every tile, on warp 0's path to its own GEMMs (wg2t paged ran a key tile
  2.4x slower than ragged, run 21).
* No box past the last tile; every thread waits on the stage's mbarrier for its fill number ``(kt - first tile)
  // stages`` (parity). A box reads past its entry (the next entry's keys, the rest of a page, or a buffer's
  unused rows, which may hold NaN): V rows past the keys any row sees are zeroed after the wait (K ones are
  masked by the variant's select).
"""

from __future__ import annotations

from typing import NamedTuple

from tvm.script import tirx as T

from ..ops import shape_values
from ._prefill_tc_copy import TI_KV0
from ._prefill_tc_params import TcParams
from ._prefill_tc_tiles import TC_TILES
from ._tma_cuda import (PagedTensorMap, TensorMap3, mbar_expect_tx, mbar_init, mbar_wait, sw128_pad, tma_load3,
                        tma_load5)
from ._wgmma_cuda import proxy_fence


#: Paged: the first tile-info slot holding the pages of an issuing thread's key groups of the next tile (the
#: cp.async copies' cursor slots: a TMA tile has no cursor); ``MAX_GROUPS_A_WARP`` slots.
TI_NEXT_PAGE = TI_KV0 + 3
MAX_GROUPS_A_WARP = 2


def _maps(hkv: int, d: int, dv: int, tk: int, paged: bool) -> dict:
    if paged:
        return {"pmap": ("pages", PagedTensorMap(hkv, d))}
    return {"kmap": ("k", TensorMap3(hkv, d, tk)), "vmap": ("v", TensorMap3(hkv, dv, tk))}


def tma_maps(spec, tile: str, paged: bool = False) -> dict:
    """A ``tma`` tile's tensor-map kernel parameters: name -> (the tensor it maps, its map: ``encode_args(shape)``
    gives the encoding of that tensor's map). Ragged: one map of k and one of v (a box = a column block of a
    tile); paged: one of the page pool (a box = 8 keys of a page, K or V)."""
    return _maps(spec.num_kv_heads, spec.head_dim, shape_values(spec)["Dv"], TC_TILES[tile].tk, paged)


class TmaMacros(NamedTuple):
    """``issue(smem, stage, kvb, ti, kt, h, tid)``: tile kt's boxes into a stage (``kvb`` ends with the tensor
    maps); ``wait(smem, ti, kt, tid)``: tile kt landed, its V rows past the keys any row sees zeroed (the caller's
    barrier publishes them); ``maps``: ``tma_maps`` of the tile and op (the host code encodes them);
    ``tiles(loop)``: the macro running ``loop(smem, *args)`` (the key-tile loop) on the stage view (``smem``,
    from the kernel's buffer's first 1024-byte boundary) once thread 0 armed one mbarrier a stage."""

    issue: object
    wait: object
    maps: dict
    tiles: object


def _bar(p: TcParams, smem, stage):
    """The address of stage ``stage``'s mbarrier."""
    return T.address_of(smem[p.tile.bar_base(p.d, p.dv, stage)])


def _paged_boxes(p: TcParams):
    """Paged: ``look_up(ti, kvb, kt, tid)`` (the pages of the issuing thread's key groups of tile ``kt``) and
    ``issue_paged(smem, stage, kvb, ti, kt, h, tid)`` (lane 0 of each warp: the boxes of its groups)."""
    cfg, d, dv, tk, threads = p.tile, p.d, p.dv, p.tk, p.nt
    if d != 128 or tk != 64:
        raise NotImplementedError(f"pagedkv.tir_kernels: tile {cfg.name!r} pages K / V with 32 boxes a tile: head "
                                  f"dim 128 and 64-key tiles, not {d} / {tk}")
    pg = tk // 8  # 8-key groups a tile (one box each per column block, of K and of V)
    gpw = pg // (threads // 32)  # groups a warp issues
    if gpw * (threads // 32) != pg or gpw > MAX_GROUPS_A_WARP:
        raise NotImplementedError(f"pagedkv.tir_kernels: tile {cfg.name!r}: {threads // 32} warps cannot share the "
                                  f"{pg} key groups of a tile, at most {MAX_GROUPS_A_WARP} a warp")

    def group_key(kt, tid, i):
        """The first key (in the entry) of the ``i``-th 8-key group of tile ``kt`` that thread ``tid``'s warp
        issues."""
        return kt * tk + (T.truncdiv(tid, 32) * gpw + i) * 8

    @T.macro
    def look_up(ti, kvb, kt, tid):
        """Into ``ti[TI_NEXT_PAGE + i]`` (none past the entry's keys: its page slots end there). Loaded a tile
        before their boxes are issued: the loads' latency is not on the warp's path to its GEMMs."""
        for i in T.unroll(gpw):
            if group_key(kt, tid, i) < ti[5]:
                ti[TI_NEXT_PAGE + i] = kvb[1][ti[TI_KV0] + T.truncdiv(group_key(kt, tid, i), kvb[3])]

    @T.macro
    def issue_paged(smem, stage, kvb, ti, kt, h, tid):
        """The 4 boxes (K / V x column block) of each of the warp's groups (``kvb`` = (pages, page_values,
        page_indptr, ps, last_page_len, pool map)), then its pages of the next tile."""
        for i in T.unroll(gpw):
            if group_key(kt, tid, i) < ti[5]:
                for b in T.unroll(4):  # b // 2: K (0) or V (1); b % 2: column block
                    T.evaluate(tma_load5(
                        T.address_of(smem[(cfg.k_base(stage, d, dv) if b // 2 == 0 else cfg.v_base(stage, d, dv))
                                          + ((b % 2) * tk + (T.truncdiv(tid, 32) * gpw + i) * 8) * 64]),
                        _bar(p, smem, stage), kvb[5], (b % 2) * 64, T.truncmod(group_key(kt, tid, i), kvb[3]), h,
                        b // 2, ti[TI_NEXT_PAGE + i]))
        look_up(ti, kvb, kt + 1, tid)

    return look_up, issue_paged


def _make_issue(p: TcParams, issue_paged):
    """``issue(smem, stage, kvb, ti, kt, h, tid)``: thread 0 arms the stage's mbarrier with the tile's bytes; the
    boxes: paged, ``issue_paged`` by lane 0 of each warp; ragged (``kvb`` = (k, v, kv_indptr, k map, v map)), one
    box a column block of K and of V by thread 0."""
    cfg, d, dv, tk, paged = p.tile, p.d, p.dv, p.tk, p.paged
    pg = tk // 8

    @T.macro
    def column_boxes(smem, stage, base, tmap, blocks, row0, h):
        """``blocks`` boxes of map ``tmap`` (a tile's keys from ``row0``, 64 dims each) to ``base``."""
        for c in T.unroll(blocks):
            T.evaluate(tma_load3(T.address_of(smem[base + c * tk * 64]), _bar(p, smem, stage), tmap, c * 64, h, row0))

    @T.macro
    def issue(smem, stage, kvb, ti, kt, h, tid):
        if paged:
            if T.And(tid == 0, kt < T.truncdiv(ti[6] + tk - 1, tk)):
                T.evaluate(mbar_expect_tx(_bar(p, smem, stage),
                                          T.min(T.truncdiv(ti[5] - kt * tk + 7, 8), pg) * 8 * (d + dv) * 2))
            if T.And(T.truncmod(tid, 32) == 0, kt < T.truncdiv(ti[6] + tk - 1, tk)):
                issue_paged(smem, stage, kvb, ti, kt, h, tid)
        else:
            if T.And(tid == 0, kt < T.truncdiv(ti[6] + tk - 1, tk)):
                T.evaluate(mbar_expect_tx(_bar(p, smem, stage), tk * (d + dv) * 2))
                column_boxes(smem, stage, cfg.k_base(stage, d, dv), kvb[3], d // 64, ti[TI_KV0] + kt * tk, h)
                column_boxes(smem, stage, cfg.v_base(stage, d, dv), kvb[4], dv // 64, ti[TI_KV0] + kt * tk, h)

    return issue


def _make_wait(p: TcParams):
    """``wait(smem, ti, kt, tid)``: every thread waits on the stage's mbarrier for its fill number ``(kt - first
    tile) // stages`` (parity); then, in the tile that reaches the keys any row sees, the V rows past them are
    zeroed (a box reads past its entry: K's are masked by the variant's select)."""
    cfg, d, dv, tk, threads, dtype = p.tile, p.d, p.dv, p.tk, p.nt, p.dtype
    ns, vl = cfg.stages, cfg.kv_layout(dv)

    @T.macro
    def zero_v_tail(smem, ti, kt, tid):
        for it in T.unroll(tk * dv // 8 // threads):
            if kt * tk + T.truncdiv(it * threads + tid, dv // 8) >= ti[6]:
                for e in T.vectorized(8):
                    smem[cfg.v_base(T.truncmod(kt, ns), d, dv)
                         + vl.index(T.truncdiv(it * threads + tid, dv // 8), T.truncmod(it * threads + tid, dv // 8) * 8 + e)] = \
                        T.Cast(dtype, T.float32(0))
        T.evaluate(proxy_fence())

    @T.macro
    def wait(smem, ti, kt, tid):
        T.evaluate(mbar_wait(_bar(p, smem, T.truncmod(kt, ns)), T.truncmod(T.truncdiv(kt - ti[7], ns), 2)))
        if (kt + 1) * tk > ti[6]:
            zero_v_tail(smem, ti, kt, tid)

    return wait


def _make_tiles(p: TcParams, look_up):
    """``tiles(loop)``: ``TmaMacros.tiles``; ``look_up``: paged, the first tile's pages (None ragged)."""
    cfg, d, dv, dtype, paged = p.tile, p.d, p.dv, p.dtype, p.paged
    ns = cfg.stages

    def tiles(loop):
        @T.macro
        def run(smem_all, scratch, fr, acc, rows, ti, kvb, h, tid, causal, sm_scale):
            """The swizzle repeats every 1024 bytes (``cfg.smem_bytes`` has the slack); the barrier: every
            mbarrier armed before any thread waits on one."""
            smem = T.decl_buffer((cfg.smem_bytes(d, dv) // 2,), dtype, data=smem_all.data,
                                 elem_offset=sw128_pad(T.address_of(smem_all[0]), 2), scope="shared.dyn")
            if paged:
                if T.truncmod(tid, 32) == 0:
                    look_up(ti, kvb, ti[7], tid)  # the first tile's pages (issue_paged looks up the next ones)
            if tid == 0:
                for st_ in T.unroll(ns):
                    T.evaluate(mbar_init(T.address_of(smem[cfg.bar_base(d, dv, st_)]), 1))
            T.tvm_storage_sync("shared")
            loop(smem, scratch, fr, acc, rows, ti, kvb, h, tid, causal, sm_scale)

        return run

    return tiles


def make_tma(p: TcParams) -> TmaMacros:
    """The TMA macros of kernel ``p`` (``TcTile.tma``; V tiles stored as ``kv_layout``)."""
    look_up, issue_paged = _paged_boxes(p) if p.paged else (None, None)
    return TmaMacros(_make_issue(p, issue_paged), _make_wait(p), _maps(p.hkv, p.d, p.dv, p.tk, p.paged),
                     _make_tiles(p, look_up))


__all__ = ["TmaMacros", "make_tma", "tma_maps"]
