"""The tensor-core prefill's fragment bookkeeping, checked on the CPU against an independent NumPy model of
``mma.sync.m16n8k16.row.col`` (no GPU, no TVM lowering).

The kernel (``tir_kernels.attention_cuda_prefill_tc``) builds its operands with ``_mma_cuda.a_frag`` /
``b_frag`` / ``c_frag`` and the shared-memory index helpers; here the same helpers fill per-lane register
files, the model below (written from the PTX ISA's fragment tables, not from those helpers) executes the
MMAs, a model of ``ldmatrix`` (also from the ISA) loads the B fragments from the kernel's shared-memory
layout at the addresses the kernel's lanes give, and one warp's S = Q K^T and O = P V must equal plain
matmuls. Also: the ldmatrix rows are 16-byte aligned and hit 32 distinct banks per 8-lane phase, the 4
lanes sharing a row are a quad (``shfl_xor`` 1 and 2 reach all of them), and the K / V copies' chunks
(``_prefill_tc_copy``) cover each tile once, a fixed key step apart.
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


def ldmatrix_model(smem, row_addr, trans: bool):
    """PTX ``ldmatrix.m8n8.x4[.trans].b16``: lane ``8 i + r`` gives the address of row ``r`` of matrix ``i``;
    register ``i`` of lane ``t`` holds elements ``(t / 4, 2 (t % 4) + h)`` of matrix ``i`` (``.trans``:
    ``(2 (t % 4) + h, t / 4)``) for halves ``h`` = 0, 1. Returns ``regs[32, 4, 2]``."""
    mats = [np.array([smem[row_addr[8 * i + r]:row_addr[8 * i + r] + 8] for r in range(8)]) for i in range(4)]
    out = np.zeros((LANES, 4, 2))
    for t in range(LANES):
        for i in range(4):
            for h in range(2):
                out[t, i, h] = mats[i][(t % 4) * 2 + h, t // 4] if trans else mats[i][t // 4, (t % 4) * 2 + h]
    return out


def test_ldmatrix_elem_is_the_model():
    smem = np.arange(64 * 8, dtype=float)
    addr = [8 * lane for lane in range(LANES)]  # matrix i = rows 8 i .. of an 8-wide array
    for trans in (False, True):
        regs = ldmatrix_model(smem, addr, trans)
        for t in range(LANES):
            for i in range(4):
                for h in range(2):
                    r, c = mm.ldmatrix_elem(t, i, h, trans)
                    assert regs[t, i, h] == smem[addr[8 * i + r] + c]


@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_ldmatrix_rows_are_aligned_without_bank_conflicts(d):
    """Each 8-lane phase of an ldmatrix reads 8 rows of 16 bytes: 16-byte aligned, 32 distinct banks."""
    for idx in (lambda ln: tc.k_ldsm_index(ln, 3, 1, d), lambda ln: tc.v_ldsm_index(ln, 2, 1, d)):
        for phase in range(4):
            lanes = range(8 * phase, 8 * phase + 8)
            assert all(idx(ln) % 8 == 0 for ln in lanes)
            banks = {(idx(ln) // 2 + w) % 32 for ln in lanes for w in range(4)}
            assert len(banks) == 32


@pytest.mark.parametrize("d,dv", [(128, 128), (64, 64), (64, 128), (96, 32), (96, 96), (256, 256)])
def test_one_warp_tile_equals_matmul(d, dv):
    """S = Q K^T over d / 16 k steps x 8 n tiles, then O = P V with P straight from the S accumulators; the
    B fragments from the ldmatrix model at the kernel's addresses (K plain, V transposed)."""
    rng = np.random.default_rng(d + dv)
    tk = tc.TC_TK
    q, k, v = rng.standard_normal((16, d)), rng.standard_normal((tk, d)), rng.standard_normal((tk, dv))
    ks_smem = np.full(tk * (d + tc.TC_PAD), np.nan)  # padding never read
    vs_smem = np.full(tk * (dv + tc.TC_PAD), np.nan)
    for j in range(tk):
        for e in range(d):
            ks_smem[tc.k_store_index(j, e, d)] = k[j, e]
        for e in range(dv):
            vs_smem[tc.v_store_index(j, e, dv)] = v[j, e]
    qf = np.array([[q[mm.a_frag(lane, i)[0], ks * 16 + mm.a_frag(lane, i)[1]] for ks in range(d // 16)
                    for i in range(8)] for lane in range(LANES)])
    sacc = np.zeros((LANES, tk // 8 * 4))
    for ks2 in range(d // 32):
        for nt in range(tk // 8):
            regs = ldmatrix_model(ks_smem, [tc.k_ldsm_index(ln, nt, ks2, d) for ln in range(LANES)], False)
            for u in (0, 1):
                b = regs[:, 2 * u:2 * u + 2, :].reshape(LANES, 4)
                ks = 2 * ks2 + u
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
        for dn2 in range(dv // 16):
            regs = ldmatrix_model(vs_smem, [tc.v_ldsm_index(ln, kk, dn2, dv) for ln in range(LANES)], True)
            for u in (0, 1):
                b = regs[:, 2 * u:2 * u + 2, :].reshape(LANES, 4)
                dn = 2 * dn2 + u
                oacc[:, dn * 4:dn * 4 + 4] = mma_model(pf[:, kk * 8:kk * 8 + 8], b, oacc[:, dn * 4:dn * 4 + 4])
    o_ref = s_ref @ v
    got = np.zeros((16, dv))
    for lane in range(LANES):
        for dn in range(dv // 8):
            for i in range(4):
                row, col = mm.c_frag(lane, i)
                got[row, dn * 8 + col] = oacc[lane, dn * 4 + i]
    np.testing.assert_allclose(got, o_ref, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("tile,d,dv", [(t, d, dv) for t in ("tc2", "tc3") for d, dv in ((128, 128), (64, 64),
                                                                                          (64, 128), (96, 96))]
                         + [("tcq", 256, 256)])
def test_two_stage_buffer_regions(d, dv, tile):
    """The two-stage tiles' one dynamic buffer: the K and V tiles of both stages (and Q, when it is in shared
    memory) are disjoint, fill ``smem_bytes``, and start at multiples of 128 bytes (16-byte aligned rows, and
    the same banks as the base-0 buffers above)."""
    tile = tc.TC_TILES[tile]
    tk = tile.tk
    regions = []
    for stage in range(tile.stages):
        regions += [(tile.k_base(stage, d, dv), tk * (d + tc.TC_PAD)), (tile.v_base(stage, d, dv), tk * (dv + tc.TC_PAD))]
    if tile.q_in_smem:
        regions.append((tile.q_base(d, dv), tile.rows * (d + tc.TC_PAD)))
    assert all(start * 2 % 128 == 0 for start, _ in regions)
    assert all(a + n == b for (a, n), (b, _) in zip(regions, regions[1:])) and regions[0][0] == 0
    assert (regions[-1][0] + regions[-1][1]) * 2 == tile.smem_bytes(d, dv)
    # The largest index the kernel's ldmatrix rows reach (+ 8 elements) stays inside its tile.
    assert tc.k_ldsm_index(31, tk // 8 - 1, d // 32 - 1, d) + 8 <= tk * (d + tc.TC_PAD)
    assert tc.v_ldsm_index(31, tk // 16 - 1, dv // 16 - 1, dv) + 8 <= tk * (dv + tc.TC_PAD)


@pytest.mark.parametrize("d", [64, 128])
def test_q_in_shared_memory_fragments(d):
    """Q in shared memory ("tc3"): the ``ldmatrix.x4`` at ``q_ldsm_index`` gives each lane its A fragment
    (``a_frag``) of rows ``row0 ..`` x dims ``16 ks ..``, and the one at ``k_ldsm_index_nt2`` the B fragments
    (``b_frag``: k = dim, n = key) of n tiles ``2 nt2`` and ``2 nt2 + 1`` at k step ``ks``; then the k-step-outer
    S of two m16 tiles equals Q K^T."""
    rng = np.random.default_rng(d)
    tile = tc.TC_TILES["tc3"]
    rows, tk, stride = 32, tile.tk, d + tc.TC_PAD
    q, k = rng.standard_normal((rows, d)), rng.standard_normal((tk, d))
    q_smem, k_smem = np.full(rows * stride, np.nan), np.full(tk * stride, np.nan)
    for r in range(rows):
        q_smem[r * stride:r * stride + d] = q[r]
    for j in range(tk):
        k_smem[tc.k_store_index(j, 0, d):tc.k_store_index(j, 0, d) + d] = k[j]
    sacc = np.zeros((2, LANES, tk // 8 * 4))
    for ks in range(d // 16):
        afr = []
        for mt in range(2):
            regs = ldmatrix_model(q_smem, [tc.q_ldsm_index(ln, 16 * mt, ks, d) for ln in range(LANES)], False)
            a = regs.reshape(LANES, 8)
            for ln in range(LANES):
                for i in range(8):
                    r, c = mm.a_frag(ln, i)
                    assert a[ln, i] == q[16 * mt + r, 16 * ks + c]
            afr.append(a)
        for nt2 in range(tk // 16):
            regs = ldmatrix_model(k_smem, [tc.k_ldsm_index_nt2(ln, nt2, ks, d) for ln in range(LANES)], False)
            for u in (0, 1):
                b = regs[:, 2 * u:2 * u + 2, :].reshape(LANES, 4)
                for ln in range(LANES):
                    for i in range(4):
                        kk, n = mm.b_frag(ln, i)
                        assert b[ln, i] == k[8 * (2 * nt2 + u) + n, 16 * ks + kk]
                for mt in range(2):
                    nt = 2 * nt2 + u
                    sacc[mt, :, nt * 4:nt * 4 + 4] = mma_model(afr[mt], b, sacc[mt, :, nt * 4:nt * 4 + 4])
    s_ref = q @ k.T
    for mt in range(2):
        for ln in range(LANES):
            for nt in range(tk // 8):
                for i in range(4):
                    r, c = mm.c_frag(ln, i)
                    assert sacc[mt, ln, nt * 4 + i] == pytest.approx(s_ref[16 * mt + r, nt * 8 + c])


@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_q_and_k_nt2_rows_are_aligned_without_bank_conflicts(d):
    for idx in (lambda ln: tc.q_ldsm_index(ln, 16, 3, d), lambda ln: tc.k_ldsm_index_nt2(ln, 1, 2, d)):
        for phase in range(4):
            lanes = range(8 * phase, 8 * phase + 8)
            assert all(idx(ln) % 8 == 0 for ln in lanes)
            assert len({(idx(ln) // 2 + w) % 32 for ln in lanes for w in range(4)}) == 32


#: (tile, head dim) of the thread copies (tma tiles: none), every head dim each tile serves.
COPY_TILES = [(t, d) for t, c in sorted(tc.TC_TILES.items()) if not c.tma for d in c.dims]


@pytest.mark.parametrize("tile,d", COPY_TILES, ids=[f"{t}-{d}" for t, d in COPY_TILES])
def test_copy_chunks_cover_each_tile_once(tile, d):
    """``_prefill_tc_copy``'s 16-byte chunks of a K / V tile: every (key, 8-element dim chunk) of the ``tk`` x ``d``
    tile exactly once over the block's first ``active`` threads (the others idle: head dim 96), and chunk ``it`` of a
    thread ``KSTEP it`` keys past its chunk 0 at the same dims (the premise of the copy loop that steps one cursor
    from chunk to chunk). Each 8 consecutive threads (one shared-memory wavefront of 16-byte stores) read
    contiguous 16-byte chunks of one global row (of two where a row's 12 chunks straddle them: head dim 96) and
    write 8 different 16-byte bank groups (at most 2 to one where rows straddle)."""
    import operator

    from pagedkv.tir_kernels._prefill_tc_copy import _Chunks

    cfg = tc.TC_TILES[tile]
    ch = _Chunks(cfg.tk, d, cfg.threads, 8)
    assert ch.active <= cfg.threads and ch.count * ch.active * 8 == cfg.tk * d
    assert ch.idle == (d == 96)
    seen = []
    for t in range(ch.active):
        key0, dim0 = ch.at(t, operator.floordiv, operator.mod)
        seen += [(key0 + it * ch.kstep, dim0) for it in range(ch.count)]
    assert sorted(seen) == [(k, c) for k in range(cfg.tk) for c in range(0, d, 8)]

    def store(key, dim):
        return tc.k_store_index(key, dim, d)

    for it in range(ch.count):
        for t0 in range(0, ch.active, 8):
            at = [ch.at(t, operator.floordiv, operator.mod) for t in range(t0, min(t0 + 8, ch.active))]
            at = [(k + it * ch.kstep, c) for k, c in at]
            assert all(store(k, c) % 8 == 0 for k, c in at)
            groups = [store(k, c) // 8 % 8 for k, c in at]
            rows = sorted({k for k, _ in at})
            assert max(groups.count(g) for g in groups) <= len(rows) <= 2, (tile, d, t0, at)
            for r in rows:
                dims = [c for k, c in at if k == r]
                assert dims == list(range(dims[0], dims[0] + 8 * len(dims), 8))


@pytest.mark.parametrize("d,rows", [(128, 64), (64, 64), (128, 128)])
def test_sw128_layout_matches_its_descriptors(d, rows):
    """``_wgmma_cuda.Sw128Layout`` (the tiles TMA writes with ``CU_TENSOR_MAP_SWIZZLE_128B``: rows of 128 bytes,
    chunk ``c`` of row ``r`` at ``c ^ (r % 8)``) against the address a 128-byte-swizzle wgmma descriptor forms
    (PTX ISA; the emulator's ``wg_b``): K-major B (n, k) at ``(n/8) SBO + (n%8) 128 + 2k`` past the step's
    offset, MN-major B (k, n) at ``(n/64) LBO + (k/8) SBO + (k%8) 128 + 2 (n%64)``, then address bits 4-6 XOR
    bits 7-9 (the tile starts 1024-byte aligned). Every element once; every step's operand where the layout
    put it."""
    from pagedkv.tir_kernels._wgmma_cuda import Sw128Layout

    lay = Sw128Layout(d, rows)
    assert sorted(lay.index(r, c) for r in range(rows) for c in range(d)) == list(range(rows * d))

    def swz(addr):
        return addr ^ (((addr >> 7) & 7) << 4)

    for ks in range(d // 16):  # S = Q K^T: B = K tile, rows = keys (n), dims = k
        off, _lbo, sbo = lay.k_major(ks)
        for n in range(rows):
            for k in range(16):
                assert swz(off + (n // 8) * sbo + (n % 8) * 128 + 2 * k) == 2 * lay.index(n, 16 * ks + k)
    for kk in range(rows // 16):  # O += P V: B = V tile, rows = keys (k), dims = n
        off, lbo, sbo = lay.mn_major(kk)
        for k in range(16):
            for n in range(d):
                assert swz(off + (n // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + 2 * (n % 64)) == \
                    2 * lay.index(16 * kk + k, n)
