"""Key-tile loops of the wgmma prefill tiles that keep two wgmma groups in flight per warpgroup
(``attention_cuda_prefill_tc``; ``TcTile.overlap``): "wg2o" / "wg2k" (``overlap``, one block barrier a key
tile) and "wg2p" (``pingpong``: no block barrier; named barriers between the two warpgroups).

Both issue, at key tile kt, S of kt and P V of kt - 1 (P of kt - 1 kept in ``pfo``) as two groups, wait for S
alone (``wait_group 1``), run the softmax of kt (O's factor deferred) while P V runs, then wait for P V and
rescale O. The first tile has no P V before it and the last one's runs after the loop (each of those loops
runs 0 or 1 times).

"wg2p", the schedule of FlashAttention-3's two consumer warpgroups (without its producer warp: every thread
copies its own chunks of each tile with ``cp.async``, as in the other tiles):

* **Tiles landed** (named barriers ``FULL[w][kt % 2]``): after its own copies of tile kt + 1 have landed
  (``cp.async.wait_group 1``) and are fenced for wgmma, warpgroup w arrives at the other's barrier; each
  waits (``bar.sync``, 256 threads: its own 128 and the other's) before reading tile kt. Two barriers a side,
  by tile parity: the other cannot arrive for tile kt + 2 before this one passed tile kt (it needs this one's
  arrival for kt + 1 first).
* **Turns** (``TURN[w]``): a warpgroup issues its S and P V only in its turn and passes the turn on once
  issued, so the tensor cores run one warpgroup's GEMMs while the other runs its softmax. Warpgroup 1 hands
  the first turn to warpgroup 0 and skips its last hand-over: arrivals and waits balance.
* **Stages** (4; loads 2 tiles ahead): tile kt + 2 is issued at the top of tile kt into the stage of tile
  kt - 2. Both warpgroups are done with it: this one waited for P V of kt - 2 during tile kt - 1, and the
  other arrived for tile kt (which this one waited for) only after that same wait.
"""

from __future__ import annotations

from typing import NamedTuple

from tvm.script import tirx as T

from ._mma_cuda import cp_async_wait
from ._wgmma_cuda import bar_arrive, bar_sync, proxy_fence, store_before_wait, wg_wait0, wg_wait1

#: Named barrier ids of "wg2p" (0 is ``__syncthreads``): the turns of warpgroups 0 / 1, then ``FULL[w][p]``.
TURN_BAR, FULL_BAR = 1, 3
#: Threads meeting at each named barrier: both warpgroups.
PAIR = 256


class TileMacros(NamedTuple):
    """What the pipelines take from the kernel: ``issue_kv(smem, stage, kvb, ti, kt, h, tid)`` (start this
    thread's copies of K / V tile kt into a stage, one cp.async group), ``next_tile(smem, ti, kvb, h, tid, kt)``
    (block-barrier top of tile kt: wait, publish, load kt + 1), ``softmax`` (the online softmax with the O
    factor deferred), ``rescale_o(oacc, fac)`` and ``wgg`` (``_wgmma_cuda.WgGemms``)."""

    issue_kv: object
    next_tile: object
    softmax: object
    rescale_o: object
    wgg: object


def steady_step(cfg, d: int, dv: int, sn: int, m: TileMacros):
    """The two halves of a steady-state key tile kt, shared by both loops: ``issue(smem, fr, acc, kt)`` starts S
    of kt and P V of kt - 1 (two wgmma groups); ``finish(scratch, fr, acc, rows, ti, tid, kt, causal,
    sm_scale)`` waits for S, runs the softmax while P V runs, waits for P V, rescales O and keeps P for the next
    tile. The ping-pong loop passes its turn between the two."""
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
    """The "wg2o" / "wg2k" loop (three stages, one block barrier a tile; "wg2t": four, ``cfg.ahead`` tiles
    loading ahead, which ``m.next_tile`` keeps): ``overlap(smem, scratch, fr, acc,
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


def make_pingpong(cfg, d: int, dv: int, sn: int, m: TileMacros):
    """The "wg2p" loop (module docstring), arguments as ``make_overlap``'s macro. The two warpgroups run the
    same key tiles (a block's tile range is the same for all its rows), so their barrier counts match."""
    tk, ns = cfg.tk, cfg.stages
    if ns != 4 or cfg.warps != 8:
        raise NotImplementedError(f"pagedkv.tir_kernels: the ping-pong loop takes 2 warpgroups and 4 stages, "
                                  f"tile {cfg.name!r} has {cfg.warps} warps and {cfg.stages} stages")

    issue, finish = steady_step(cfg, d, dv, sn, m)

    def end_of(ti):
        return T.truncdiv(ti[6] + tk - 1, tk)

    @T.macro
    def landed(ti, tid, kt):
        """This thread's copies of tile ``kt`` have landed (the newer group, tile kt + 1, may still be in flight)
        and are visible to wgmma; tell the other warpgroup, unless kt is past the last tile."""
        T.evaluate(cp_async_wait(1))
        T.evaluate(proxy_fence())
        if kt < end_of(ti):
            T.evaluate(bar_arrive(FULL_BAR + 2 * (1 - T.truncdiv(tid, 128)) + T.truncmod(kt, 2), PAIR))

    @T.macro
    def top(smem, ti, kvb, h, tid, kt):
        """Wait until both warpgroups' copies of tile kt landed, start tile kt + 2 (into tile kt - 2's stage),
        then wait for this warpgroup's turn to issue."""
        T.evaluate(bar_sync(FULL_BAR + 2 * T.truncdiv(tid, 128) + T.truncmod(kt, 2), PAIR))
        m.issue_kv(smem, T.truncmod(kt + 2, ns), kvb, ti, kt + 2, h, tid)
        T.evaluate(bar_sync(TURN_BAR + T.truncdiv(tid, 128), PAIR))

    @T.macro
    def pass_turn(ti, tid, kt):
        """Hand the turn to the other warpgroup (warpgroup 1 not after its last tile: it gave one up front)."""
        if T.Or(tid < 128, kt + 1 < end_of(ti)):
            T.evaluate(bar_arrive(TURN_BAR + 1 - T.truncdiv(tid, 128), PAIR))

    @T.macro
    def pingpong(smem, scratch, fr, acc, rows, ti, kvb, h, tid, causal, sm_scale):
        m.issue_kv(smem, T.truncmod(ti[7], ns), kvb, ti, ti[7], h, tid)
        m.issue_kv(smem, T.truncmod(ti[7] + 1, ns), kvb, ti, ti[7] + 1, h, tid)
        landed(ti, tid, ti[7])
        if T.And(tid >= 128, ti[7] < end_of(ti)):
            T.evaluate(bar_arrive(TURN_BAR, PAIR))  # warpgroup 0 goes first
        for kt in T.serial(ti[7], T.min(ti[7] + 1, end_of(ti))):
            top(smem, ti, kvb, h, tid, kt)
            m.wgg.score_issue(acc[0], fr[0], smem, cfg.k_base(T.truncmod(kt, ns), d, dv))
            pass_turn(ti, tid, kt)
            T.evaluate(wg_wait0())
            m.wgg.score_done(acc[0], fr[0])
            m.softmax(acc[0], acc[1], rows[0], rows[1], acc[2], rows[5], rows[2], rows[3], rows[4], ti, kt,
                      T.truncmod(tid, 32), causal, sm_scale)  # O is 0: its factor is not applied
            for e in T.unroll(sn):
                acc[3][e] = acc[1][e]
            landed(ti, tid, kt + 1)
        for kt in T.serial(ti[7] + 1, end_of(ti)):
            top(smem, ti, kvb, h, tid, kt)
            issue(smem, fr, acc, kt)
            pass_turn(ti, tid, kt)
            finish(scratch, fr, acc, rows, ti, tid, kt, causal, sm_scale)
            landed(ti, tid, kt + 1)
        for kt in T.serial(T.max(ti[7], end_of(ti) - 1), end_of(ti)):
            m.wgg.accumulate(acc[2], acc[3], smem, cfg.v_base(T.truncmod(kt, ns), d, dv))

    return pingpong


__all__ = ["FULL_BAR", "PAIR", "TURN_BAR", "TileMacros", "make_overlap", "make_pingpong"]
