"""The key-tile loop of the wgmma prefill tiles (``attention_cuda_prefill_tc``; ``TcTile.wgmma``: "wg2t",
"wg1t"), which keeps two wgmma groups in flight per warpgroup, one block barrier a key tile.

At key tile kt it issues S of kt and P V of kt - 1 (P of kt - 1 kept in ``pfo``) as two groups, waits for S alone
(``wait_group 1``), runs the softmax of kt (O's factor deferred) while P V runs, then waits for P V and rescales
O. The first tile has no P V before it and the last one's runs after the loop (each of those loops runs 0 or 1
times).
"""

from __future__ import annotations

from typing import NamedTuple

from tvm.script import tirx as T

from ._wgmma_cuda import store_before_wait, wg_wait0, wg_wait1


class TileMacros(NamedTuple):
    """What the loop takes from the kernel: ``issue_kv(smem, stage, kvb, ti, kt, h, tid)`` (start the copies of
    K / V tile kt into a stage), ``next_tile(smem, ti, kvb, h, tid, kt)``
    (block-barrier top of tile kt: wait, publish, load kt + 1), ``softmax`` (the online softmax with the O
    factor deferred), ``rescale_o(oacc, fac)`` and ``wgg`` (``_wgmma_cuda.WgGemms``)."""

    issue_kv: object
    next_tile: object
    softmax: object
    rescale_o: object
    wgg: object


def steady_step(cfg, d: int, dv: int, sn: int, m: TileMacros):
    """The two halves of a steady-state key tile kt: ``issue(smem, fr, acc, kt)`` starts S of kt and P V of kt - 1
    (two wgmma groups); ``finish(scratch, fr, acc, rows, ti, tid, kt, causal, sm_scale)`` waits for S, runs the
    softmax while P V runs, waits for P V, rescales O and keeps P for the next tile."""
    ns = cfg.stages

    @T.macro
    def issue(smem, fr, acc, kt):
        m.wgg.score_issue(acc[0], fr[0], smem, cfg.k_base(T.truncmod(kt, ns), d, dv))
        m.wgg.pv_issue(acc[2], acc[3], smem, cfg.v_base(T.truncmod(kt - 1, ns), d, dv))

    @T.macro
    def finish(scratch, fr, acc, rows, ti, tid, kt, causal, sm_scale):
        T.evaluate(wg_wait1())
        m.wgg.score_done(acc[0], fr[0])
        m.softmax(acc[0], acc[1], rows[0], rows[1], acc[2], rows[5], rows[2], rows[3], rows[4], ti, kt,
                  T.truncmod(tid, 32), causal, sm_scale)
        # The row sums depend on every exp of the softmax: ptxas keeps them before the wait (else the exps sink
        # below it and P V runs alone).
        T.evaluate(store_before_wait(T.address_of(scratch[0]), rows[1][0] + rows[1][1]))
        T.evaluate(wg_wait0())
        m.wgg.pv_done(acc[2], acc[3])
        m.rescale_o(acc[2], rows[5])
        for e in T.unroll(sn):
            acc[3][e] = acc[1][e]

    return issue, finish


def make_overlap(cfg, d: int, dv: int, sn: int, m: TileMacros):
    """The loop (``cfg.ahead`` tiles loading ahead, which ``m.next_tile`` keeps): ``overlap(smem, scratch, fr, acc,
    rows, ti, kvb, h, tid, causal, sm_scale)``, ``fr`` = (qf, afr, bfr), ``acc`` = (sacc, pf, oacc, pfo),
    ``rows`` = (m, lsum, lim, mx, st, fac); ``scratch`` a shared word (``store_before_wait``)."""
    tk, ns = cfg.tk, cfg.stages
    issue, finish = steady_step(cfg, d, dv, sn, m)

    @T.macro
    def overlap(smem, scratch, fr, acc, rows, ti, kvb, h, tid, causal, sm_scale):
        for j in T.unroll(cfg.ahead):  # the first tiles (next_tile loads cfg.ahead tiles ahead)
            m.issue_kv(smem, T.truncmod(ti[7] + j, ns), kvb, ti, ti[7] + j, h, tid)
        for kt in T.serial(ti[7], T.min(ti[7] + 1, T.truncdiv(ti[6] + tk - 1, tk))):
            m.next_tile(smem, ti, kvb, h, tid, kt)
            m.wgg.score(acc[0], fr[0], smem, cfg.k_base(T.truncmod(kt, ns), d, dv))
            m.softmax(acc[0], acc[1], rows[0], rows[1], acc[2], rows[5], rows[2], rows[3], rows[4], ti, kt,
                      T.truncmod(tid, 32), causal, sm_scale)  # O is 0: its factor is not applied
            for e in T.unroll(sn):
                acc[3][e] = acc[1][e]
        for kt in T.serial(ti[7] + 1, T.truncdiv(ti[6] + tk - 1, tk)):
            m.next_tile(smem, ti, kvb, h, tid, kt)
            issue(smem, fr, acc, kt)
            finish(scratch, fr, acc, rows, ti, tid, kt, causal, sm_scale)
        for kt in T.serial(T.max(ti[7], T.truncdiv(ti[6] + tk - 1, tk) - 1), T.truncdiv(ti[6] + tk - 1, tk)):
            m.wgg.accumulate(acc[2], acc[3], smem, cfg.v_base(T.truncmod(kt, ns), d, dv))

    return overlap


__all__ = ["TileMacros", "make_overlap"]
