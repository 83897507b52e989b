"""The two GEMMs of the tensor-core CUDA prefill's ``mma.sync`` tiles (``attention_cuda_prefill_tc``): S = Q K^T
(``make_score``) and O += P V (``make_accumulate``), on ``mma.sync.m16n8k16`` with their operands from
``ldmatrix`` of the row-major shared-memory tiles (``_prefill_tc_tiles``' index maps). The wgmma tiles take theirs
from ``_wgmma_cuda.wg_attention_gemms``. Each factory takes the kernel's ``TcParams`` and returns its ``@T.macro``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._mma_cuda import ldmatrix_x4, mma_sync
from ._prefill_tc_params import TcParams
from ._prefill_tc_tiles import k_ldsm_index, k_ldsm_index_nt2, q_ldsm_index, v_ldsm_index


def make_score(p: TcParams):
    """``score(sacc, qf, afr, smem, kb, bfr, w, lane)``: S of the warp's rows and the K tile at element ``kb``."""
    D, DV, MT, NKS, NSN, SN, QS, cfg, dtype, wrow = (p.d, p.dv, p.mt, p.nks, p.nsn, p.sn, p.qs, p.tile, p.dtype,
                                                     p.wrow)

    @T.macro
    def score(sacc, qf, afr, smem, kb, bfr, w, lane):
        """S (the warp's rows x the tile's keys) = Q K^T: C fragment ``mt * 8 + nt`` holds keys ``8 nt ..`` of m16
        tile ``mt``. Q in registers (``qf``, one m16 tile): one ``ldmatrix.x4`` gives the B fragments of two k
        steps (``k_ldsm_index``). Q in shared memory: per k step one ``ldmatrix.x4`` of each m16 tile's A fragment
        into ``afr`` (``q_ldsm_index``), and one of the B fragments of two n tiles (``k_ldsm_index_nt2``) used by
        every m16 tile of the warp."""
        for e in T.unroll(MT * SN):
            sacc[e] = T.float32(0)
        if QS:
            # k step outer: the A fragments of one k step (4 registers a m16 tile) stay live across the keys.
            for ks in T.unroll(NKS):
                for mt in T.unroll(MT):
                    T.evaluate(ldmatrix_x4(T.address_of(afr[mt * 4]), T.address_of(
                        smem[cfg.q_base(D, DV) + q_ldsm_index(lane, wrow(w, mt), ks, D)]), False))
                for nt2 in T.unroll(NSN // 2):
                    T.evaluate(ldmatrix_x4(T.address_of(bfr[0]), T.address_of(
                        smem[kb + k_ldsm_index_nt2(lane, nt2, ks, D)]), False))
                    for mt in T.unroll(MT):
                        for u in T.unroll(2):
                            T.evaluate(mma_sync(dtype, T.address_of(sacc[mt * SN + (nt2 * 2 + u) * 4]),
                                                T.address_of(afr[mt * 4]), T.address_of(bfr[u * 2])))
        else:
            for ks2 in T.unroll(NKS // 2):
                for nt in T.unroll(NSN):
                    T.evaluate(ldmatrix_x4(T.address_of(bfr[0]), T.address_of(
                        smem[kb + k_ldsm_index(lane, nt, ks2, D)]), False))
                    for u in T.unroll(2):
                        T.evaluate(mma_sync(dtype, T.address_of(sacc[nt * 4]), T.address_of(qf[(ks2 * 2 + u) * 8]),
                                            T.address_of(bfr[u * 2])))

    return score


def make_accumulate(p: TcParams):
    """``accumulate(oacc, pf, Vs, vb, bfr, lane)``: O += P V with the V tile at element ``vb`` of ``Vs``."""
    DV, MT, NKK, NDN, SN, ON, dtype = p.dv, p.mt, p.nkk, p.ndn, p.sn, p.on, p.dtype

    @T.macro
    def accumulate(oacc, pf, Vs, vb, bfr, lane):
        """k step ``kk`` (keys ``16 kk ..``) x n tiles ``2 dn2``, ``2 dn2 + 1`` (dims ``16 dn2 ..``), their B
        fragments from one ``ldmatrix.x4.trans`` of the row-major ``Vs`` (``v_ldsm_index``), used by every m16
        tile of the warp; P (``pf``, the storage dtype) is the A fragment as the softmax left it."""
        for kk in T.unroll(NKK):
            for dn2 in T.unroll(NDN // 2):
                T.evaluate(ldmatrix_x4(T.address_of(bfr[0]),
                                       T.address_of(Vs[vb + v_ldsm_index(lane, kk, dn2, DV)]), True))
                for mt in T.unroll(MT):
                    for u in T.unroll(2):
                        T.evaluate(mma_sync(dtype, T.address_of(oacc[mt * ON + (dn2 * 2 + u) * 4]),
                                            T.address_of(pf[mt * SN + kk * 8]), T.address_of(bfr[u * 2])))

    return accumulate


__all__ = ["make_accumulate", "make_score"]
