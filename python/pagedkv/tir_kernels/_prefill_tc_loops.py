"""The key-tile loops of the tensor-core CUDA prefill (``attention_cuda_prefill_tc``), one per kind of tile, and
the top of a multi-stage tile (``make_issue_kv``, ``make_next_tile``):

* ``make_two_stage_loop`` ("tc2", "tc3"): tile kt + 1 loads into the other stage during all of tile kt;
* ``make_overlap_loop`` (the wgmma tiles "wg2t", "wg1t"): two wgmma groups in flight per warpgroup. At key tile
  kt it issues S of kt and P V of kt - 1 (P of kt - 1 kept in ``pfo``) as two groups, waits for S alone
  (``wait_group 1``), runs the softmax of kt (O's factor deferred) while P V runs, then waits for P V and
  rescales O. The first tile has no P V before it and the last one's runs after the loop (each of those loops
  runs 0 or 1 times).

The loops take the kernel's register arrays as tuples: ``fr`` = (qf, afr, bfr), ``acc`` = (sacc, pf, oacc, pfo),
``rows`` = (m, lsum, lim, mx, st, fac). Each factory takes the kernel's ``TcParams`` and the stage macros it
runs, and returns its ``@T.macro``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._mma_cuda import cp_async_wait
from ._prefill_tc_params import TcParams
from ._wgmma_cuda import store_before_wait, wg_wait0, wg_wait1


def make_issue_kv(p: TcParams, copies, tma):
    """``issue_kv(smem, stage, kvb, ti, kt, h, tid)``: K and V of tile ``kt`` into stage ``stage`` of a
    multi-stage tile, one cp.async group (``copies``: ``_prefill_tc_copy.KvCopies``); wgmma: its TMA boxes
    (``tma``: ``_prefill_tma.TmaMacros``)."""
    D, DV, TMA, cfg = p.d, p.dv, p.wg, p.tile

    @T.macro
    def issue_kv(smem, stage, kvb, ti, kt, h, tid):
        if TMA:
            tma.issue(smem, stage, kvb, ti, kt, h, tid)
        else:
            copies.issue_kv(smem, cfg.k_base(stage, D, DV), cfg.v_base(stage, D, DV), kvb, ti, kt, h, tid)

    return issue_kv


def make_next_tile(p: TcParams, issue_kv, tma):
    """``next_tile(smem, ti, kvb, h, tid, kt)``: the top of key tile ``kt`` of a multi-stage tile."""
    TMA, cfg = p.wg, p.tile

    @T.macro
    def next_tile(smem, ti, kvb, h, tid, kt):
        """Key tile ``kt`` is in stage ``kt % stages``: wait for its copies, one barrier that both publishes it
        (and Q) and tells that every warp is done with the stage of tile ``kt + ahead - stages``, which then
        takes tile kt + ``ahead`` (past the last tile: zeros, never read). ``TMA``: the wait is on the stage's
        mbarrier, for its fill number ``(kt - first tile) // stages`` (parity)."""
        if TMA:
            tma.wait(smem, ti, kt, tid)
        else:
            T.evaluate(cp_async_wait(0))
        T.tvm_storage_sync("shared")
        issue_kv(smem, T.truncmod(kt + cfg.ahead, cfg.stages), kvb, ti, kt + cfg.ahead, h, tid)

    return next_tile


def make_two_stage_loop(p: TcParams, issue_kv, next_tile, score, softmax, accumulate):
    """``loop(smem, fr, acc, rows, ti, kvb, h, tid, w, lane, causal, sm_scale)``."""
    D, DV, TK, cfg = p.d, p.dv, p.tk, p.tile

    @T.macro
    def loop(smem, fr, acc, rows, ti, kvb, h, tid, w, lane, causal, sm_scale):
        """Tile kt in stage kt % 2: after the wait for tile kt, one barrier both publishes it and tells that
        every warp is done with tile kt - 1, whose stage then takes tile kt + 1, loading during the whole of tile
        kt (scores, softmax, P V)."""
        issue_kv(smem, T.truncmod(ti[7], 2), kvb, ti, ti[7], h, tid)
        for kt in T.serial(ti[7], T.truncdiv(ti[6] + TK - 1, TK)):
            next_tile(smem, ti, kvb, h, tid, kt)
            score(acc[0], fr[0], fr[1], smem, cfg.k_base(T.truncmod(kt, 2), D, DV), fr[2], w, lane)
            softmax(acc[0], acc[1], rows[0], rows[1], acc[2], rows[5], rows[2], rows[3], rows[4], ti, kt, lane,
                    causal, sm_scale)
            accumulate(acc[2], acc[1], smem, cfg.v_base(T.truncmod(kt, 2), D, DV), fr[2], lane)

    return loop


def _steady_step(p: TcParams, softmax, rescale_o, wgg):
    """The two halves of a steady-state key tile kt of the overlap loop: ``issue(smem, fr, acc, kt)`` starts S of
    kt and P V of kt - 1 (two wgmma groups); ``finish(scratch, fr, acc, rows, ti, tid, kt, causal, sm_scale)``
    waits for S, runs the softmax while P V runs, waits for P V, rescales O and keeps P for the next tile."""
    d, dv, ns, sn, cfg = p.d, p.dv, p.tile.stages, p.sn, p.tile

    @T.macro
    def issue(smem, fr, acc, kt):
        wgg.score_issue(acc[0], fr[0], smem, cfg.k_base(T.truncmod(kt, ns), d, dv))
        wgg.pv_issue(acc[2], acc[3], smem, cfg.v_base(T.truncmod(kt - 1, ns), d, dv))

    @T.macro
    def finish(scratch, fr, acc, rows, ti, tid, kt, causal, sm_scale):
        T.evaluate(wg_wait1())
        wgg.score_done(acc[0], fr[0])
        softmax(acc[0], acc[1], rows[0], rows[1], acc[2], rows[5], rows[2], rows[3], rows[4], ti, kt,
                T.truncmod(tid, 32), causal, sm_scale)
        # The row sums depend on every exp of the softmax: ptxas keeps them before the wait (else the exps sink
        # below it and P V runs alone).
        T.evaluate(store_before_wait(T.address_of(scratch[0]), rows[1][0] + rows[1][1]))
        T.evaluate(wg_wait0())
        wgg.pv_done(acc[2], acc[3])
        rescale_o(acc[2], rows[5])
        for e in T.unroll(sn):
            acc[3][e] = acc[1][e]

    return issue, finish


def make_overlap_loop(p: TcParams, issue_kv, next_tile, softmax, rescale_o, wgg):
    """``loop(smem, scratch, fr, acc, rows, ti, kvb, h, tid, causal, sm_scale)``: the wgmma tiles' loop
    (``p.tile.ahead`` tiles loading ahead, which ``next_tile`` keeps); ``softmax`` defers O's factor to
    ``rescale_o``; ``wgg`` = ``_wgmma_cuda.WgGemms``; ``scratch`` a shared word (``store_before_wait``)."""
    d, dv, sn, cfg = p.d, p.dv, p.sn, p.tile
    tk, ns = cfg.tk, cfg.stages
    issue, finish = _steady_step(p, softmax, rescale_o, wgg)

    @T.macro
    def loop(smem, scratch, fr, acc, rows, ti, kvb, h, tid, causal, sm_scale):
        for j in T.unroll(cfg.ahead):  # the first tiles (next_tile loads cfg.ahead tiles ahead)
            issue_kv(smem, T.truncmod(ti[7] + j, ns), kvb, ti, ti[7] + j, h, tid)
        for kt in T.serial(ti[7], T.min(ti[7] + 1, T.truncdiv(ti[6] + tk - 1, tk))):
            next_tile(smem, ti, kvb, h, tid, kt)
            wgg.score(acc[0], fr[0], smem, cfg.k_base(T.truncmod(kt, ns), d, dv))
            softmax(acc[0], acc[1], rows[0], rows[1], acc[2], rows[5], rows[2], rows[3], rows[4], ti, kt,
                    T.truncmod(tid, 32), causal, sm_scale)  # O is 0: its factor is not applied
            for e in T.unroll(sn):
                acc[3][e] = acc[1][e]
        for kt in T.serial(ti[7] + 1, T.truncdiv(ti[6] + tk - 1, tk)):
            next_tile(smem, ti, kvb, h, tid, kt)
            issue(smem, fr, acc, kt)
            finish(scratch, fr, acc, rows, ti, tid, kt, causal, sm_scale)
        for kt in T.serial(T.max(ti[7], T.truncdiv(ti[6] + tk - 1, tk) - 1), T.truncdiv(ti[6] + tk - 1, tk)):
            wgg.accumulate(acc[2], acc[3], smem, cfg.v_base(T.truncmod(kt, ns), d, dv))

    return loop


__all__ = ["make_issue_kv", "make_next_tile", "make_overlap_loop", "make_two_stage_loop"]
