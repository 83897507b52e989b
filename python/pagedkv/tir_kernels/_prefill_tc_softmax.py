"""The online softmax of the tensor-core CUDA prefill (``attention_cuda_prefill_tc``), on the C fragments of S a
lane holds (rows g and g + 8 of each m16 tile; a row's scores spread over the 4 lanes of a quad): scores to
log2-unit logits (``_mask_scores``: scale, soft cap, mask by ``CudaVariant``), the running max and sum, P in the
storage dtype laid out as the A fragments of P V, and O's rescale, at once (``make_softmax(p, False)``) or
deferred to ``make_rescale_o`` (the wgmma tiles: applied once the P V in flight is complete). Each factory takes
the kernel's ``TcParams`` and returns its ``@T.macro``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._common import LOG2E
from ._common_cuda import shfl_xor
from ._mma_cuda import c_frag
from ._prefill_tc_params import TcParams


def _mask_scores(p: TcParams, masked: bool):
    """The macro turning m16 tile ``mt``'s raw scores (of the lane) into log2-unit logits: scaled, soft-capped
    and (``masked``) masked by ``CudaVariant`` (``logits(s, True)`` is the cap alone)."""
    TK, NSN, SN, var = p.tk, p.nsn, p.sn, p.var

    @T.macro
    def scores(sacc, mx, m, lim, ti, kt, lane, causal, sm_scale, mt):
        # mx: the lane's running max of each row (folded in as each score is made: fewer live values)
        for rr in T.unroll(2):
            mx[mt * 2 + rr] = m[mt * 2 + rr]
            for nt in T.unroll(NSN):
                for c in T.unroll(2):
                    sacc[mt * SN + nt * 4 + rr * 2 + c] = var.logits(
                        sacc[mt * SN + nt * 4 + rr * 2 + c] * (sm_scale * T.float32(LOG2E)),
                        var.visible(kt * TK + nt * 8 + c_frag(lane, c)[1], lim[mt * 2 + rr], ti[5], causal)
                        if masked else True)
                    mx[mt * 2 + rr] = T.max(mx[mt * 2 + rr], sacc[mt * SN + nt * 4 + rr * 2 + c])

    return scores


def make_softmax(p: TcParams, defer: bool):
    """``softmax(sacc, pf, m, lsum, oacc, fac, lim, mx, st, ti, kt, lane, causal, sm_scale)``; ``defer``: each
    row's O rescale factor goes to ``fac`` (``make_rescale_o`` applies it) instead of being applied to ``oacc``
    at once."""
    TK, MT, NSN, NDN, SN, ON, WIN, dtype = p.tk, p.mt, p.nsn, p.ndn, p.sn, p.on, p.win, p.dtype
    scores_masked, scores_visible = _mask_scores(p, True), _mask_scores(p, False)

    @T.macro
    def softmax(sacc, pf, m, lsum, oacc, fac, lim, mx, st, ti, kt, lane, causal, sm_scale):
        """Online softmax of the lane's rows (m16 tile ``mt``, ``rr``: C elements 2rr, 2rr + 1 of its
        fragments); a row's scores are spread over the 4 lanes of a quad. ``pf`` = P in the storage dtype,
        already laid out as the A fragments of P V (``pf[mt * SN + 8 kk + i]`` = C element ``i % 4`` of
        fragment ``2 kk + i // 4``)."""
        for mt in T.unroll(MT):
            if WIN:
                scores_masked(sacc, mx, m, lim, ti, kt, lane, causal, sm_scale, mt)
            else:
                # Without a window a row sees keys < lim: a tile below both rows' bounds needs no mask (the
                # branch is per lane, with no shuffle inside; padding rows have lim 0, so they take the mask).
                if (kt + 1) * TK <= T.min(lim[mt * 2], lim[mt * 2 + 1]):
                    scores_visible(sacc, mx, m, lim, ti, kt, lane, causal, sm_scale, mt)
                else:
                    scores_masked(sacc, mx, m, lim, ti, kt, lane, causal, sm_scale, mt)
            for rr in T.unroll(2):
                st[0] = T.max(mx[mt * 2 + rr], shfl_xor(mx[mt * 2 + rr], 1))
                st[0] = T.max(st[0], shfl_xor(st[0], 2))
                st[1] = T.exp2(m[mt * 2 + rr] - st[0])
                m[mt * 2 + rr] = st[0]
                lsum[mt * 2 + rr] = lsum[mt * 2 + rr] * st[1]
                if defer:
                    fac[mt * 2 + rr] = st[1]
                elif st[1] != T.float32(1):  # the max moved (else O times 1: skipped, same bits)
                    for dn in T.unroll(NDN):
                        for c in T.unroll(2):
                            oacc[mt * ON + dn * 4 + rr * 2 + c] = oacc[mt * ON + dn * 4 + rr * 2 + c] * st[1]
                for nt in T.unroll(NSN):
                    for c in T.unroll(2):
                        st[2] = T.exp2(sacc[mt * SN + nt * 4 + rr * 2 + c] - st[0])
                        lsum[mt * 2 + rr] = lsum[mt * 2 + rr] + st[2]
                        pf[mt * SN + nt * 4 + rr * 2 + c] = T.Cast(dtype, st[2])

    return softmax


def make_rescale_o(p: TcParams):
    """``rescale_o(oacc, fac)``: O of the lane's rows times their deferred factors (``make_softmax(p, True)``)."""
    MT, NDN, ON = p.mt, p.ndn, p.on

    @T.macro
    def rescale_o(oacc, fac):
        # A row whose max did not move (factor 1, most rows after the first key tiles) skips its multiplies.
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                if fac[mt * 2 + rr] != T.float32(1):
                    for dn in T.unroll(NDN):
                        for c in T.unroll(2):
                            oacc[mt * ON + dn * 4 + rr * 2 + c] = oacc[mt * ON + dn * 4 + rr * 2 + c] * fac[mt * 2 + rr]

    return rescale_o


__all__ = ["make_rescale_o", "make_softmax"]
