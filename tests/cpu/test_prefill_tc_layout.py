"""The tensor-core prefill's fragment bookkeeping, checked on the CPU against an independent NumPy model of
``mma.sync.m16n8k16.row.col`` (no GPU, no TVM lowering).

The kernel (``tir_kernels.attention_cuda_prefill_tc``) builds its operands with ``_mma_cuda.a_frag`` /
``b_frag`` / ``c_frag`` and the shared-memory index helpers; here the same helpers fill per-lane register
files, the model below (written from the PTX ISA's fragment tables, not from those helpers) executes the
MMAs, and one warp's S = Q K^T and O = P V must equal plain matmuls. Also: the 32-bit B-fragment reads are
pairs of adjacent elements, they hit 32 distinct banks, and the 4 lanes sharing a row are a quad
(``shfl_xor`` 1 and 2 reach all of them).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.tir_kernels import _mma_cuda as mm
from pagedkv.tir_kernels import attention_cuda_prefill_tc as tc

LANES = 32


def _ptx_a(lane, reg_half):
    """PTX ISA, m16n8k16 .f16/.bf16 A: a0..a7; row groupID for a0, a1, a4, a5, groupID + 8 for the others;
    col threadID_in_group * 2 + (i & 1), + 8 for a4..a7."""
    gid, tig = lane >> 2, lane & 3
    row = gid if reg_half in (0, 1, 4, 5) else gid + 8
    return row, tig * 2 + (reg_half & 1) + (8 if reg_half >= 4 else 0)


def _ptx_b(lane, reg_half):
    """B: b0..b3; row (k) threadID_in_group * 2 + (i & 1), + 8 for b2, b3; col (n) groupID."""
    gid, tig = lane >> 2, lane & 3
    return tig * 2 + (reg_half & 1) + (8 if reg_half >= 2 else 0), gid


def _ptx_c(lane, i):
    """C / D: c0..c3; row groupID for c0, c1, groupID + 8 for c2, c3; col threadID_in_group * 2 + (i & 1)."""
    gid, tig = lane >> 2, lane & 3
    return gid + (8 if i >= 2 else 0), tig * 2 + (i & 1)


def mma_model(a_regs, b_regs, c_regs):
    """One warp's m16n8k16: ``a_regs[32, 8]``, ``b_regs[32, 4]``, ``c_regs[32, 4]`` -> ``d_regs[32, 4]``."""
    a, b, c = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(LANES):
        for i in range(8):
            a[_ptx_a(lane, i)] = a_regs[lane, i]
        for i in range(4):
            b[_ptx_b(lane, i)] = b_regs[lane, i]
            c[_ptx_c(lane, i)] = c_regs[lane, i]
    d = a @ b + c
    return np.array([[d[_ptx_c(lane, i)] for i in range(4)] for lane in range(LANES)])


def test_layouts_match_the_ptx_tables():
    for lane in range(LANES):
        assert [mm.a_frag(lane, i) for i in range(8)] == [_ptx_a(lane, i) for i in range(8)]
        assert [mm.b_frag(lane, i) for i in range(4)] == [_ptx_b(lane, i) for i in range(4)]
        assert [mm.c_frag(lane, i) for i in range(4)] == [_ptx_c(lane, i) for i in range(4)]


def test_p_accumulator_is_the_a_fragment():
    """pf[8 kk + i] = C element i % 4 of n tile 2 kk + i // 4: the same (row, key) as A element i of k step kk."""
    for lane in range(LANES):
        for i in range(8):
            row, col = mm.c_frag(lane, i % 4)
            assert (row, col + 8 * (i // 4)) == mm.a_frag(lane, i)


def test_quad_shares_rows():
    for lane in range(LANES):
        for x in (1, 2, 3):
            assert mm.c_frag(lane ^ x, 0)[0] == mm.c_frag(lane, 0)[0]


@pytest.mark.parametrize("d", [64, 128])
def test_b_reads_are_adjacent_pairs_without_bank_conflicts(d):
    for lane in range(LANES):
        for u in (0, 1):
            k, n = mm.b_frag(lane, 2 * u)
            assert mm.b_frag(lane, 2 * u + 1) == (k + 1, n)
            assert tc.k_smem_index(lane, 0, 0, u, d) == tc.k_store_index(n, k, d)
            assert tc.v_smem_index(lane, 0, 0, u) == tc.v_store_index(k, n)
    for u in (0, 1):
        for idx in (lambda ln: tc.k_smem_index(ln, 3, 1, u, d), lambda ln: tc.v_smem_index(ln, 5, 2, u)):
            words = [idx(lane) // 2 for lane in range(LANES)]
            assert all(idx(lane) % 2 == 0 for lane in range(LANES))  # 4-byte aligned
            assert len({w % 32 for w in words}) == 32


@pytest.mark.parametrize("d,dv", [(128, 128), (64, 64), (64, 128)])
def test_one_warp_tile_equals_matmul(d, dv):
    """S = Q K^T over d / 16 k steps x 8 n tiles, then O = P V with P straight from the S accumulators."""
    rng = np.random.default_rng(d + dv)
    tk = tc.TC_TK
    q, k, v = rng.standard_normal((16, d)), rng.standard_normal((tk, d)), rng.standard_normal((tk, dv))
    ks_smem = np.zeros(tk * (d + tc.TC_PAD))
    vt_smem = np.zeros(dv * (tk + tc.TC_PAD))
    for j in range(tk):
        for e in range(d):
            ks_smem[tc.k_store_index(j, e, d)] = k[j, e]
        for e in range(dv):
            vt_smem[tc.v_store_index(j, e)] = v[j, e]
    qf = np.array([[q[mm.a_frag(lane, i)[0], ks * 16 + mm.a_frag(lane, i)[1]] for ks in range(d // 16)
                    for i in range(8)] for lane in range(LANES)])
    sacc = np.zeros((LANES, tk // 8 * 4))
    for ks in range(d // 16):
        for nt in range(tk // 8):
            b = np.array([[ks_smem[tc.k_smem_index(lane, nt, ks, u, d) + h] for u in (0, 1) for h in (0, 1)]
                          for lane in range(LANES)])
            sacc[:, nt * 4:nt * 4 + 4] = mma_model(qf[:, ks * 8:ks * 8 + 8], b, sacc[:, nt * 4:nt * 4 + 4])
    s_ref = q @ k.T
    for lane in range(LANES):
        for nt in range(tk // 8):
            for i in range(4):
                row, col = mm.c_frag(lane, i)
                assert sacc[lane, nt * 4 + i] == pytest.approx(s_ref[row, nt * 8 + col])
    pf = sacc  # the kernel's pf[e] = cast(p[e]): same index
    oacc = np.zeros((LANES, dv // 8 * 4))
    for kk in range(tk // 16):
        for dn in range(dv // 8):
            b = np.array([[vt_smem[tc.v_smem_index(lane, dn, kk, u) + h] for u in (0, 1) for h in (0, 1)]
                          for lane in range(LANES)])
            oacc[:, dn * 4:dn * 4 + 4] = mma_model(pf[:, kk * 8:kk * 8 + 8], b, oacc[:, dn * 4:dn * 4 + 4])
    o_ref = s_ref @ v
    got = np.zeros((16, dv))
    for lane in range(LANES):
        for dn in range(dv // 8):
            for i in range(4):
                row, col = mm.c_frag(lane, i)
                got[row, dn * 8 + col] = oacc[lane, dn * 4 + i]
    np.testing.assert_allclose(got, o_ref, rtol=1e-10, atol=1e-9)
