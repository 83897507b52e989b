"""The prologue stages of the tensor-core CUDA prefill (``attention_cuda_prefill_tc``): the block's entry and tile
(``make_locate``), Q into registers (``make_load_q``) or shared memory (``make_load_q_smem``), and the rows' online
softmax state (``make_init_rows``). Each factory takes the kernel's ``TcParams`` and returns its ``@T.macro``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._common import EMPTY_LSE
from ._common_cuda import ballot, popc
from ._mma_cuda import a_frag, aligned16, c_frag, cp_async16
from ._prefill_tc_params import TcParams


def make_locate(p: TcParams, kv_len):
    """``locate(ti, q_indptr, kvb, B, vt, causal, lane)``: the tile info ``ti`` of virtual tile ``vt``;
    ``kv_len(kvb, b)`` = keys of entry b (``_prefill_tc_copy.KvCopies.kv_len``)."""
    TQ, TK, WIN, var = p.tq, p.tk, p.win, p.var

    @T.macro
    def locate(ti, q_indptr, kvb, B, vt, causal, lane):
        """Tile info ``ti``: 0 entry b, 1 qlen, 2 qt0 (first token of the tile in the entry), 3 tokens, 4 first
        token row of q, 5 kvlen, 6 keys any row sees, 7 first key tile (``copies.prepare`` sets the slots from
        ``_prefill_tc_copy.TI_KV0`` on). Entry b: the last one whose first virtual tile ``q_indptr[b] // TQ + b``
        is <= vt (the SIMT kernel's grid), found by each warp in rounds of 32 probes (``ti[2]`` apart), one lane
        each, all loads in flight at once: one round up to 32 entries, two up to 1024 (a binary search waits for
        one dependent load a halving)."""
        ti[0] = 0
        ti[1] = B  # the entry is in [ti[0], ti[1])
        while ti[1] - ti[0] > 1:
            ti[2] = T.truncdiv(ti[1] - ti[0] + 31, 32)
            # Probes at or below vt: a prefix of the lanes (the first virtual tiles grow with b), lane 0 always.
            ti[3] = popc(ballot(T.if_then_else(
                ti[0] + lane * ti[2] < ti[1],
                T.truncdiv(q_indptr[T.min(ti[0] + lane * ti[2], B)], TQ) + ti[0] + lane * ti[2] <= vt, False)))
            ti[0] = ti[0] + (ti[3] - 1) * ti[2]
            ti[1] = T.min(ti[0] + ti[2], ti[1])
        ti[1] = T.if_then_else(B > 0, q_indptr[T.min(ti[0] + 1, B)] - q_indptr[ti[0]], 0)
        ti[2] = vt - (T.truncdiv(q_indptr[ti[0]], TQ) + ti[0])  # tile of the entry (temporarily)
        ti[5] = T.if_then_else(T.And(ti[2] >= 0, ti[2] < T.truncdiv(ti[1] + TQ - 1, TQ)), 1, 0)  # active
        # Last query tile first (it sees the most keys under causal).
        ti[2] = (T.truncdiv(ti[1] + TQ - 1, TQ) - 1 - ti[2]) * TQ
        ti[3] = T.if_then_else(ti[5] > 0, T.min(TQ, ti[1] - ti[2]), 0)
        ti[4] = q_indptr[ti[0]] + ti[2]
        ti[5] = T.if_then_else(ti[5] > 0, kv_len(kvb, ti[0]), 0)
        ti[6] = T.if_then_else(causal > 0, T.max(T.min(ti[5], ti[5] - ti[1] + ti[2] + ti[3]), 0), ti[5])
        ti[7] = var.first_tile(ti[5], ti[1], ti[2], ti[6], TK) if WIN else 0

    return locate


def make_load_q(p: TcParams):
    """``load_q(qf, q, ti, h, w, lane)``: Q in registers (one m16 tile a warp)."""
    G, NKS, dtype, row_ok, wrow = p.g, p.nks, p.dtype, p.row_ok, p.wrow

    @T.macro
    def load_q(qf, q, ti, h, w, lane):
        """The warp's rows as A fragments, ``qf[ks*8 + i]`` = element ``a_frag(lane, i)`` of dims ``16 ks ..``
        (storage dtype, unscaled: the scale is applied to the fp32 scores); padding rows 0."""
        for ks in T.unroll(NKS):
            for i in T.unroll(8):
                if row_ok(wrow(w, 0) + a_frag(lane, i)[0], ti):
                    qf[ks * 8 + i] = q[ti[4] + T.truncdiv(wrow(w, 0) + a_frag(lane, i)[0], G),
                                       h * G + T.truncmod(wrow(w, 0) + a_frag(lane, i)[0], G),
                                       ks * 16 + a_frag(lane, i)[1]]
                else:
                    qf[ks * 8 + i] = T.Cast(dtype, T.float32(0))

    return load_q


def _q_row_loader(p: TcParams, vec: bool):
    """The macro loading the block's Q rows into shared memory at ``q_base`` (row-major, stride D + TC_PAD;
    padding rows 0), once a block, consecutive threads on consecutive chunks of a row: ``vec``, 16-byte
    ``cp.async`` chunks, all in flight (they join the first key tile's group: its wait and barrier publish Q);
    else element loads through registers, 8 in flight a thread (q not 16-byte aligned)."""
    D, DV, G, KS, NT, cfg, dtype, row_ok = p.d, p.dv, p.g, p.ks, p.nt, p.tile, p.dtype, p.row_ok
    width = 8 if vec else 1
    per_row = D // width
    outer, inner = (1, cfg.rows * per_row // NT) if vec else (cfg.rows * per_row // NT // 8, 8)

    def at(it, tid):
        """(row, first dim) of chunk ``it`` of thread ``tid``."""
        return T.truncdiv(it * NT + tid, per_row), T.truncmod(it * NT + tid, per_row) * width

    @T.macro
    def load(smem, q, ti, h, tid):
        for it0 in T.serial(outer):
            for it1 in T.unroll(inner):
                if row_ok(at(it0 * inner + it1, tid)[0], ti):
                    if vec:
                        T.evaluate(cp_async16(
                            T.address_of(smem[cfg.q_base(D, DV) + at(it0 * inner + it1, tid)[0] * KS
                                              + at(it0 * inner + it1, tid)[1]]),
                            T.address_of(q[ti[4] + T.truncdiv(at(it0 * inner + it1, tid)[0], G),
                                           h * G + T.truncmod(at(it0 * inner + it1, tid)[0], G),
                                           at(it0 * inner + it1, tid)[1]])))
                    else:
                        smem[cfg.q_base(D, DV) + at(it0 * inner + it1, tid)[0] * KS + at(it0 * inner + it1, tid)[1]] = \
                            q[ti[4] + T.truncdiv(at(it0 * inner + it1, tid)[0], G),
                              h * G + T.truncmod(at(it0 * inner + it1, tid)[0], G), at(it0 * inner + it1, tid)[1]]
                else:
                    for e in T.vectorized(width):
                        smem[cfg.q_base(D, DV) + at(it0 * inner + it1, tid)[0] * KS
                             + at(it0 * inner + it1, tid)[1] + e] = T.Cast(dtype, T.float32(0))

    return load


def make_load_q_smem(p: TcParams):
    """``load_q_smem(smem, q, ti, h, tid)``: Q in shared memory (``TcParams.qs``)."""
    q_rows_vec, q_rows_elem = _q_row_loader(p, True), _q_row_loader(p, False)

    @T.macro
    def load_q_smem(smem, q, ti, h, tid):
        """16-byte copies when q's first element is 16-byte aligned (rows of ``Hq * D`` elements keep it, as for
        k / v), else element loads."""
        if aligned16(T.address_of(q[0, 0, 0])) == 1:
            q_rows_vec(smem, q, ti, h, tid)
        else:
            q_rows_elem(smem, q, ti, h, tid)

    return load_q_smem


def make_init_rows(p: TcParams):
    """``init_rows(lim, m, lsum, oacc, ti, w, lane, causal)``: the online softmax's row state."""
    G, MT, ON, var, row_ok, wrow = p.g, p.mt, p.on, p.var, p.row_ok, p.wrow

    @T.macro
    def init_rows(lim, m, lsum, oacc, ti, w, lane, causal):
        """Row state of the lane's rows (``c_frag`` rows g and g + 8 of each m16 tile; index ``2 mt + rr``):
        bound, running max (``EMPTY_LSE``: a row that sees no key keeps it), sum, O."""
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                lim[mt * 2 + rr] = var.row_bound(row_ok(wrow(w, mt) + c_frag(lane, 2 * rr)[0], ti), ti[5], ti[1],
                                                 ti[2], T.truncdiv(wrow(w, mt) + c_frag(lane, 2 * rr)[0], G), causal)
                m[mt * 2 + rr] = T.float32(EMPTY_LSE)
                lsum[mt * 2 + rr] = T.float32(0)
        for e in T.unroll(MT * ON):
            oacc[e] = T.float32(0)

    return init_rows


__all__ = ["make_init_rows", "make_load_q", "make_load_q_smem", "make_locate"]
