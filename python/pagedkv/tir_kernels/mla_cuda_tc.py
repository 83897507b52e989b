"""Tensor-core CUDA MLA decode (``mla_attn_decode_paged``), fp16 / bf16, sm_80+, on ``mma.sync.m16n8k16``
(``_mma_cuda``); chosen by the path switch ``cuda_mla_decode_kernel`` (``pagedkv.kernel_spec.SWITCHES``): "tc"
forces it (raising with ``tc_unserved``'s reasons on a spec it does not serve), "simt" the SIMT kernel of
``mla_cuda``, auto takes it wherever it serves (below wgq: ``pagedkv.kernel_table``). The same block serves the paged prefill
(``mla_attn_prefill_paged``, one block a query token: ``_mla_frame_cuda.make_prefill_frame``; switch
``cuda_mla_prefill_kernel``).

Why: every query head of a decode token attends to the same latent rows, so a block of 16 or 32 heads does
``rows x 64 x (DL + DV)`` multiply-adds per 64-key tile it loads: compute-bound, where the SIMT kernel's
float32 FMAs run at a few percent of the tensor cores. Semantics are ``mla_cuda``'s (base-2 lse, float32
accumulation, ``o = 0`` / ``lse = -1e30`` for a row that sees no key, keys at or past the length never read).

Design: one block of 8 warps per (head group, entry, key split) (``blockIdx`` x, y, z):

* A head group is ``rows`` = 16 (``H <= 16``; padding rows past ``H`` compute on zero q and are never
  stored) or 32 heads (two m16 tiles), so ``ceil(H / rows)`` groups an entry.
* Key tiles of ``TK`` latent rows (all ``DL`` elements), loaded with 16-byte ``cp.async`` into a ring of
  ``NS`` stages in one dynamic shared-memory buffer (rows padded by 8 elements: each 8-lane phase of an
  ``ldmatrix`` hits 32 banks); tiles ``kt + 1 .. kt + NS - 1`` load during tile ``kt`` (one copy group a
  tile). ``TILE_PLANS`` by block rows: 16 rows (memory-bound) 4 stages of 32 keys, three tiles (112 KB) in
  flight an SM (H200, 16 heads: 1.05-1.09x the speed of 2 x 64 at 1K keys; 5 stages gained nothing); 32
  rows (compute-bound, registers at the limit) 2 stages of 64. Keys at or past the split's end are
  zero-filled (never read from the pages, whose tails may hold anything).
* S = Q K^T over DL, the warps as ``DG = 4`` dim groups x 2 key groups: warp ``w`` holds Q's A fragments of
  dims ``DL / 4 * (w % 4) ..`` of every m16 tile in registers (36 a tile at 576; all of Q would take 144) and
  computes the partial scores of keys ``32 (w // 4) ..`` over them, per k step one ``ldmatrix.x4`` of the
  tile giving the B fragments of two n tiles (``k_ldsm_index_nt2``), used by every m16 tile: the tile is the
  scores' only shared-memory operand. The fp32 partials go to a static shared array ``Ss[DG, rows, TK + 4]``.
* Online softmax: ``NT / rows`` threads a row, ``TK * rows / NT`` keys each (the sum of the ``DG`` partial
  scores); the row's max over its lanes (shuffles), ``alpha = exp2(m_old - m_new)`` published in ``St``, P in
  the storage dtype in ``Ps`` (the running max and each lane's partial sum stay in that thread's registers).
* O += P V with V = the first DV columns of the same tile (no second load): warp ``w`` owns dims
  ``DV / 8 * w ..`` of every row (``DV / 16`` fp32 accumulators a lane per m16 tile), rescales them by
  ``alpha``, then per 16 keys one ``ldmatrix.x4`` of P (A) and ``DV / 128`` of the tile (``.trans``, B).
* Three barriers a tile (tile visible / S complete / P complete); the top one also tells that every warp
  is done with the stage that tile ``kt + NS - 1`` then overwrites.
* Splits: ``S`` key splits an entry from the shapes and the runtime's ``max_kv_len`` (``wave_split_count``:
  blocks of one wave per SM, the kernel holds one block an SM); ``cuda_decode_splits`` forces it; ``S > 1``: partial states in a float32
  workspace and ``mla_cuda``'s merge kernel.

Resources (ptxas, sm_90a, DeepSeek 512 + 64, no spills, no stack): 16 heads fp16: 125 registers, 150,784
bytes of dynamic + 9,472 of static shared memory; 128 heads bf16 / fp16 (32 rows): 248 registers (near the
limit: a change that adds live values spills; ``tests/cpu/test_mla_tc_compile.py`` checks), 154,112 + 35,328
bytes. One block (8 warps) an SM either way.

Code: ``BlockShape`` (frozen) holds every compile-time constant; the stages are factories of it returning
``@T.macro`` s (``make_issue``, ``make_load_q``, ``make_score``, ``make_softmax``, ``make_accumulate``, bundled as
``TcTileOps``; ``make_init``, ``make_store`` with ``_epilogue_cuda``'s lse rule), and ``make_block`` runs them.

Limits as data (``tc_unserved``): fp16 / bf16, ``DL % 64 == 0`` and ``DL <= TC_MAX_LATENT`` (shared memory),
``DV % 128 == 0`` and ``DV <= DL`` (8 warps of whole ldmatrix.x4.trans column pairs).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tvm.script import tirx as T

from ..ops import MLA_ATTN_DECODE_PAGED
from ._common import EMPTY_LSE, LOG2E, MASKED
from ._common_cuda import decode_splits, shfl_xor
from ._epilogue_cuda import make_put_lse, row_lse, row_scale
from ._mla_frame_cuda import SWITCHES, make_frame, mla_prim_func
from ._mma_cuda import (a_frag, c_frag, cp_async16, cp_async_commit, cp_async_wait, keep_extent, ldmatrix_x4,
                        mma_sync)
from ._prefill_tc_tiles import TC_PAD, k_ldsm_index_nt2, q_ldsm_index, v_ldsm_index

#: The path switch and its values.
SWITCH = "cuda_mla_decode_kernel"
#: Warps and threads a block, storage dtypes served; the score's warps: DG dim groups x the rest key groups.
WARPS, DG = 8, 4
NT = WARPS * 32
TC_DTYPES = ("float16", "bfloat16")
#: Largest latent served (the one run): either ring (``TILE_PLANS``) takes 150 KB at 576; 32 rows of Q
#: fragments a warp group already hold 248 registers there.
TC_MAX_LATENT = 576
#: fp32 row stride of ``St`` (alpha, m, l per row); ``Ss`` (scores) rows are ``keys + 4`` floats.
STW = 4


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """The key ring of a block: ``keys`` latent rows a tile (a multiple of 32: two key groups of whole n16
    pairs), ``stages`` tiles in the ring (``stages - 1`` in flight while one computes)."""

    keys: int
    stages: int


#: By block rows. 32 rows (17+ heads) are compute-bound and at the register limit: 64-key tiles, two stages.
#: 16 rows are memory-bound (16 x 64 x (512 + 576) x 2 flops a 74 KB tile), and two 64-key stages keep at
#: most one tile (74 KB) in flight an SM while a tile computes; four 32-key stages keep three (112 KB) in the
#: same shared memory.
TILE_PLANS = {16: TilePlan(keys=32, stages=4), 32: TilePlan(keys=64, stages=2)}


def group_rows(num_heads: int) -> int:
    """Rows (heads) of a block: one m16 tile up to 16 heads, else two."""
    return 16 if num_heads <= 16 else 32


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """A block's work for ``heads`` heads of latent ``latent`` (Q and K rows) and ``dv`` value dims, every
    derived constant in one place: the macros and the kernel read them from here."""

    heads: int
    latent: int
    dv: int
    dtype: str

    @property
    def rows(self) -> int:
        return group_rows(self.heads)

    @property
    def groups(self) -> int:
        """Head groups an entry (blocks along ``blockIdx.x``)."""
        return (self.heads + self.rows - 1) // self.rows

    @property
    def plan(self) -> TilePlan:
        return TILE_PLANS[self.rows]

    @property
    def mtiles(self) -> int:
        """m16 tiles a block."""
        return self.rows // 16

    @property
    def ksteps(self) -> int:
        """k steps of a score warp's dim group (``KPG``)."""
        return self.latent // 16 // DG

    @property
    def score_ntiles(self) -> int:
        """n8 key tiles of a score warp (``NSW``)."""
        return self.plan.keys // (WARPS // DG) // 8

    @property
    def out_ntiles(self) -> int:
        """n8 tiles of O a warp (``NDN``)."""
        return self.dv // WARPS // 8

    @property
    def softmax_threads(self) -> int:
        """Softmax threads a row (``TPR``)."""
        return NT // self.rows

    @property
    def softmax_keys(self) -> int:
        """Keys a softmax thread (``KPT``)."""
        return self.plan.keys // self.softmax_threads

    @property
    def k_stride(self) -> int:
        """Elements a latent row of the ring (``LS``: padded by ``TC_PAD``, ldmatrix phases on distinct banks)."""
        return self.latent + TC_PAD

    @property
    def p_stride(self) -> int:
        """Elements a row of P (``PS``), padded as the ring's."""
        return self.plan.keys + TC_PAD

    @property
    def s_stride(self) -> int:
        """Floats a row of the partial scores ``Ss`` (``SS``)."""
        return self.plan.keys + 4

    @property
    def p0(self) -> int:
        """Element offset of P in the dynamic buffer, past the ring (``P0``)."""
        return self.plan.stages * self.plan.keys * self.k_stride


def smem_bytes(rows: int, latent_dim: int, dtype: str = "float16") -> int:
    """Dynamic shared memory of a block (bytes): the ring's tiles (``TILE_PLANS``) and the P rows, padded by
    ``TC_PAD`` elements."""
    del dtype  # both served dtypes are 2 bytes
    plan = TILE_PLANS[rows]
    return 2 * (plan.stages * plan.keys * (latent_dim + TC_PAD) + rows * (plan.keys + TC_PAD))


def static_smem_bytes(rows: int) -> int:
    """Static shared memory of a block (bytes): the ``DG`` partial scores ``Ss`` and the row state ``St``."""
    return 4 * rows * (DG * (TILE_PLANS[rows].keys + 4) + STW)


def tc_unserved(spec) -> list[str]:
    """Why the tensor-core MLA decode does not serve ``spec`` (a ``KernelSpec``): [] when it does."""
    dl, dv, out = spec.latent_dim, spec.kv_lora_rank, []
    if spec.dtype not in TC_DTYPES:
        out.append(f"dtype {spec.dtype} (it takes {', '.join(TC_DTYPES)})")
    if dl % 64 or dl > TC_MAX_LATENT:
        out.append(f"latent dim {dl} (it takes multiples of 64 up to {TC_MAX_LATENT}: 16-byte chunks, k-step "
                   f"pairs, the ring's stages in shared memory)")
    if dv % 128 or dv > dl:
        out.append(f"kv_lora_rank {dv} (it takes multiples of 128 up to the latent dim: 8 warps of 16-dim "
                   f"column pairs)")
    return out


class TcTileOps(NamedTuple):
    """``make_tile_ops``' per-tile stages of a block shape, by name."""

    issue: object
    load_q: object
    score: object
    softmax: object
    accumulate: object


def make_issue(bs: BlockShape):
    """The load stage: ``issue(smem, stage, pages, page_values, pbase, ps, kbase, kend, tid)``."""
    DL, dtype, TK, LS = bs.latent, bs.dtype, bs.plan.keys, bs.k_stride
    CPR = DL // 8  # 16-byte chunks a latent row
    CPK = NT // TK  # threads a key row of the tile load

    @T.macro
    def issue(smem, stage, pages, page_values, pbase, ps, kbase, kend, tid):
        """Start copying keys ``kbase ..`` into stage ``stage`` (zeros at or past ``kend``); the caller commits
        the group. Thread ``tid`` copies key ``tid // CPK``, chunks ``tid % CPK + CPK it``: one page lookup (two
        divisions by the run-time page size) a thread a tile, and consecutive threads on consecutive 16 bytes
        of a row."""
        key: T.let[T.int32] = T.truncdiv(tid, CPK)
        if kbase + key < kend:
            pg: T.let[T.int32] = page_values[pbase + T.truncdiv(kbase + key, ps)]
            off: T.let[T.int32] = T.truncmod(kbase + key, ps)
            for it in T.unroll(CPR // CPK):
                T.evaluate(cp_async16(
                    T.address_of(smem[stage * TK * LS + key * LS + (it * CPK + T.truncmod(tid, CPK)) * 8]),
                    T.address_of(pages[pg, 0, 0, off, (it * CPK + T.truncmod(tid, CPK)) * 8])))
        else:
            for it in T.unroll(CPR // CPK):
                for e in T.vectorized(8):
                    smem[stage * TK * LS + key * LS + (it * CPK + T.truncmod(tid, CPK)) * 8 + e] = T.Cast(
                        dtype, T.float32(0))

    return issue


def make_load_q(bs: BlockShape):
    """``load_q(qf, q, b, h0, w, lane)``: Q's A fragments of a warp's dim group in registers."""
    H, dtype, MT, KPG = bs.heads, bs.dtype, bs.mtiles, bs.ksteps

    @T.macro
    def load_q(qf, q, b, h0, w, lane):
        """Q in registers: the A fragments of the warp's dim group (k steps ``KPG (w % DG) ..``) of every m16
        tile, ``qf[(mt KPG + ks) 8 + i]`` = element ``a_frag(lane, i)``; unscaled (the scale goes on the fp32
        scores), 0 for rows past ``H``."""
        for mt in T.unroll(MT):
            for ks in T.unroll(KPG):
                for i in T.unroll(8):
                    qf[(mt * KPG + ks) * 8 + i] = T.if_then_else(
                        h0 + mt * 16 + a_frag(lane, i)[0] < H,
                        q[b, T.min(h0 + mt * 16 + a_frag(lane, i)[0], H - 1),
                          (T.truncmod(w, DG) * KPG + ks) * 16 + a_frag(lane, i)[1]], T.Cast(dtype, T.float32(0)))

    return load_q


def make_score(bs: BlockShape):
    """``score(smem, Ss, stage, qf, sacc, bfr, w, lane)``: a warp's partial scores of a tile into ``Ss``."""
    DL, rows, dtype, TK = bs.latent, bs.rows, bs.dtype, bs.plan.keys
    MT, KPG, NSW, LS, SS = bs.mtiles, bs.ksteps, bs.score_ntiles, bs.k_stride, bs.s_stride

    @T.macro
    def score(smem, Ss, stage, qf, sacc, bfr, w, lane):
        """``Ss[dg, row, key]`` = the partial q . latent (fp32) over dim group ``dg = w % DG`` for keys
        ``TK / (WARPS / DG) * (w // DG) ..`` of the tile in ``stage``: per k step one ``ldmatrix.x4`` gives
        the B fragments of two n tiles (``k_ldsm_index_nt2``), used by every m16 tile; Q stays in registers,
        so the tile is the only shared-memory operand."""
        for e in T.unroll(MT * NSW * 4):
            sacc[e] = T.float32(0)
        for ks in T.unroll(KPG):
            for j in T.unroll(NSW // 2):
                T.evaluate(ldmatrix_x4(T.address_of(bfr[0]), T.address_of(smem[
                    stage * TK * LS + k_ldsm_index_nt2(lane, T.truncdiv(w, DG) * (NSW // 2) + j,
                                                       T.truncmod(w, DG) * KPG + ks, DL)]), False))
                for mt in T.unroll(MT):
                    for u in T.unroll(2):
                        T.evaluate(mma_sync(dtype, T.address_of(sacc[(mt * NSW + j * 2 + u) * 4]),
                                            T.address_of(qf[(mt * KPG + ks) * 8]), T.address_of(bfr[u * 2])))
        for mt in T.unroll(MT):
            for nt in T.unroll(NSW):
                for i in T.unroll(4):
                    Ss[(T.truncmod(w, DG) * rows + mt * 16 + c_frag(lane, i)[0]) * SS
                       + (T.truncdiv(w, DG) * NSW + nt) * 8 + c_frag(lane, i)[1]] = sacc[(mt * NSW + nt) * 4 + i]

    return score


def make_softmax(bs: BlockShape):
    """``softmax(smem, Ss, St, rs, sv, kbase, kend, scale2, tid)``: the online softmax of a row's share of keys."""
    rows, dtype, TPR, KPT = bs.rows, bs.dtype, bs.softmax_threads, bs.softmax_keys
    PS, SS, P0 = bs.p_stride, bs.s_stride, bs.p0

    @T.macro
    def softmax(smem, Ss, St, rs, sv, kbase, kend, scale2, tid):
        """Row ``tid // TPR``, keys ``KPT * (tid % TPR) ..``: ``rs`` = (running max, this lane's partial sum)."""
        row: T.let[T.int32] = T.truncdiv(tid, TPR)
        sub: T.let[T.int32] = T.truncmod(tid, TPR)
        sv[KPT] = rs[0]
        for e in T.unroll(KPT):
            sv[e] = Ss[row * SS + sub * KPT + e]
            for dg in T.unroll(1, DG):
                sv[e] = sv[e] + Ss[(dg * rows + row) * SS + sub * KPT + e]
            sv[e] = T.if_then_else(kbase + sub * KPT + e < kend, sv[e] * scale2, T.float32(MASKED))
            sv[KPT] = T.max(sv[KPT], sv[e])
        for sh in T.unroll(TPR.bit_length() - 1):
            sv[KPT] = T.max(sv[KPT], shfl_xor(sv[KPT], 1 << sh))
        # alpha: every lane of the row has the same new max, so the partial sums stay consistently scaled.
        sv[KPT + 1] = T.exp2(rs[0] - sv[KPT])
        rs[0] = sv[KPT]
        rs[1] = rs[1] * sv[KPT + 1]
        for e in T.unroll(KPT):
            sv[e] = T.exp2(sv[e] - sv[KPT])
            rs[1] = rs[1] + sv[e]
            smem[P0 + row * PS + sub * KPT + e] = T.Cast(dtype, sv[e])
        if sub == 0:
            St[row * STW] = sv[KPT + 1]

    return softmax


def make_accumulate(bs: BlockShape):
    """``accumulate(smem, St, stage, oacc, pa, bfr, w, lane)``: O rescaled, then O += P V of a tile."""
    DL, dtype, TK, MT, NDN = bs.latent, bs.dtype, bs.plan.keys, bs.mtiles, bs.out_ntiles
    ON, LS, P0 = NDN * 4, bs.k_stride, bs.p0

    @T.macro
    def accumulate(smem, St, stage, oacc, pa, bfr, w, lane):
        """O (dims ``DV / 8 * w ..``) = alpha O + P V, V the first DV columns of the tile in ``stage``."""
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                for dn in T.unroll(NDN):
                    for c in T.unroll(2):
                        oacc[mt * ON + dn * 4 + rr * 2 + c] = oacc[mt * ON + dn * 4 + rr * 2 + c] * St[
                            (mt * 16 + c_frag(lane, rr * 2)[0]) * STW]
        for kk in T.unroll(TK // 16):
            for mt in T.unroll(MT):
                T.evaluate(ldmatrix_x4(T.address_of(pa[mt * 4]),
                                       T.address_of(smem[P0 + q_ldsm_index(lane, mt * 16, kk, TK)]), False))
            for j in T.unroll(NDN // 2):
                T.evaluate(ldmatrix_x4(T.address_of(bfr[0]), T.address_of(
                    smem[stage * TK * LS + v_ldsm_index(lane, kk, w * (NDN // 2) + j, DL)]), True))
                for mt in T.unroll(MT):
                    for u in T.unroll(2):
                        T.evaluate(mma_sync(dtype, T.address_of(oacc[mt * ON + (j * 2 + u) * 4]),
                                            T.address_of(pa[mt * 4]), T.address_of(bfr[u * 2])))

    return accumulate


def make_tile_ops(bs: BlockShape) -> TcTileOps:
    """The per-tile stages (load, Q, score, softmax, accumulate) of block shape ``bs``."""
    return TcTileOps(make_issue(bs), make_load_q(bs), make_score(bs), make_softmax(bs), make_accumulate(bs))


def make_init(bs: BlockShape):
    """``init(bfr, pa, oacc, rs)``: a thread's registers before the first tile: the fragments and O zero, the
    row's running max ``EMPTY_LSE`` and its partial sum zero."""
    MT, ON = bs.mtiles, bs.out_ntiles * 4

    @T.macro
    def init(bfr, pa, oacc, rs):
        # TVM sizes a local array by the elements it sees indexed; ldmatrix reaches these through addresses only.
        for e in T.unroll(4):
            bfr[e] = T.uint32(0)
        for e in T.unroll(MT * 4):
            pa[e] = T.uint32(0)
        for e in T.unroll(MT * ON):
            oacc[e] = T.float32(0)
        rs[0] = T.float32(EMPTY_LSE)
        rs[1] = T.float32(0)

    return init


def make_store(bs: BlockShape):
    """The store stage, ``(store_lse, store_o)``: o / lse (``S == 1``) or the split's partial state in the
    workspace (``_epilogue_cuda``)."""
    H = bs.heads
    MT, NDN, TPR = bs.mtiles, bs.out_ntiles, bs.softmax_threads
    ON = NDN * 4
    put_lse = make_put_lse(H)

    @T.macro
    def store_lse(St, rs, lse, ws_l, b, live, h0, S, sp, tid):
        """The softmax threads: row sums over their lanes; ``St[row]`` = (., m, l); lse of the row."""
        row: T.let[T.int32] = T.truncdiv(tid, TPR)
        for sh in T.unroll(TPR.bit_length() - 1):
            rs[1] = rs[1] + shfl_xor(rs[1], 1 << sh)
        if T.truncmod(tid, TPR) == 0:
            St[row * STW + 1] = rs[0]
            St[row * STW + 2] = rs[1]
            if live and h0 + row < H:
                put_lse(lse, ws_l, row_lse(rs[0], rs[1]), b, h0, row, S, sp)

    @T.macro
    def store_o(St, oacc, o, ws_o, b, h0, S, sp, w, lane):
        """Each warp its dims of every row: O / l (0 for a row that saw no key)."""
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                r: T.let[T.int32] = mt * 16 + c_frag(lane, rr * 2)[0]
                rl: T.let[T.float32] = row_scale(St[r * STW + 2])
                if h0 + r < H:
                    for dn in T.unroll(NDN):
                        for c in T.unroll(2):
                            if S == 1:
                                o[b, h0 + r, (w * NDN + dn) * 8 + c_frag(lane, c)[1]] = T.Cast(
                                    o.dtype, oacc[mt * ON + dn * 4 + rr * 2 + c] * rl)
                            else:
                                ws_o[(b * H + h0 + r) * S + sp, (w * NDN + dn) * 8 + c_frag(lane, c)[1]] = \
                                    oacc[mt * ON + dn * 4 + rr * 2 + c] * rl

    return store_lse, store_o


def make_block(bs: BlockShape):
    """The per-thread block macro of ``_mla_frame_cuda``'s frames: a block's work of block shape ``bs``."""
    DL, dtype, rows = bs.latent, bs.dtype, bs.rows
    MT, TK, NS = bs.mtiles, bs.plan.keys, bs.plan.stages
    KPG, NSW, ON, KPT = bs.ksteps, bs.score_ntiles, bs.out_ntiles * 4, bs.softmax_keys
    issue, load_q, score, softmax, accumulate = make_tile_ops(bs)
    init, (store_lse, store_o) = make_init(bs), make_store(bs)
    NE = smem_bytes(rows, DL) // 2

    @T.macro
    def block(q, pages, page_values, o, lse, ws, sm_scale, ps, at, n, keys):
        """A block's work (``_mla_frame_cuda.make_split_frame``): keys ``[k0, k1)`` of entry ``bx`` for head
        group ``g``, as split ``sp`` of ``S``."""
        bx, g, sp, tid = at
        B, S = n
        k0, k1, pbase = keys
        smem = T.alloc_buffer((NE,), dtype, scope="shared.dyn")
        keep_extent(smem, NE)  # its launch bytes: every cp.async / ldmatrix chunk whole
        Ss = T.alloc_buffer((DG * rows * (TK + 4),), "float32", scope="shared")
        St = T.alloc_buffer((rows * STW,), "float32", scope="shared")
        qf = T.alloc_buffer((MT * KPG * 8,), dtype, scope="local")
        sacc = T.alloc_buffer((MT * NSW * 4,), "float32", scope="local")
        oacc = T.alloc_buffer((MT * ON,), "float32", scope="local")
        pa = T.alloc_buffer((MT * 4,), "uint32", scope="local")
        bfr = T.alloc_buffer((4,), "uint32", scope="local")
        rs = T.alloc_buffer((2,), "float32", scope="local")
        sv = T.alloc_buffer((KPT + 2,), "float32", scope="local")
        w: T.let[T.int32] = T.truncdiv(tid, 32)
        lane: T.let[T.int32] = T.truncmod(tid, 32)
        init(bfr, pa, oacc, rs)
        load_q(qf, q, T.min(bx, T.max(B - 1, 0)), g * rows, w, lane)
        # One copy group a tile, empty past the split's keys, so that waiting for all but the newest NS - 2
        # groups always means tile kt.
        for s in T.unroll(NS - 1):
            if k0 + s * TK < k1:
                issue(smem, s, pages, page_values, pbase, ps, k0 + s * TK, k1, tid)
            T.evaluate(cp_async_commit())
        for kt in T.serial(T.truncdiv(k1 - k0 + TK - 1, TK)):
            T.evaluate(cp_async_wait(NS - 2))
            # Tile kt visible; every warp done with tile kt - 1's stage, which tile kt + NS - 1 takes.
            T.tvm_storage_sync("shared")
            if k0 + (kt + NS - 1) * TK < k1:
                issue(smem, T.truncmod(kt + NS - 1, NS), pages, page_values, pbase, ps, k0 + (kt + NS - 1) * TK, k1,
                      tid)
            T.evaluate(cp_async_commit())
            score(smem, Ss, T.truncmod(kt, NS), qf, sacc, bfr, w, lane)
            T.tvm_storage_sync("shared")
            softmax(smem, Ss, St, rs, sv, k0 + kt * TK, k1, sm_scale * T.float32(LOG2E), tid)
            T.tvm_storage_sync("shared")
            accumulate(smem, St, T.truncmod(kt, NS), oacc, pa, bfr, w, lane)
        store_lse(St, rs, lse, ws[1], bx, bx < B, g * rows, S, sp, tid)
        T.tvm_storage_sync("shared")
        if bx < B:
            store_o(St, oacc, o, ws[0], bx, g * rows, S, sp, w, lane)

    return block


def mla_attn_paged_tc(spec, op: str = MLA_ATTN_DECODE_PAGED):
    """``pagedkv_mla_attn_decode_paged`` (grid: head group, entry, key split) or ``pagedkv_mla_attn_prefill_paged``
    (head group, query token, key split; ``_mla_frame_cuda``) on tensor cores (arguments: ``pagedkv.ops.OP_SPECS``),
    for a ``KernelSpec`` that ``tc_unserved`` accepts (module docstring)."""
    reasons = tc_unserved(spec)
    if reasons:
        raise NotImplementedError(f"pagedkv.tir_kernels: {SWITCHES[op]}=tc: the tensor-core CUDA MLA kernel does not "
                                  f"serve {'; '.join(reasons)}")
    bs = BlockShape(spec.num_qo_heads, spec.latent_dim, spec.kv_lora_rank, spec.dtype)
    return mla_prim_func(op, spec, make_frame(op, spec, make_block(bs), groups=bs.groups, threads=NT,
                                              tk=bs.plan.keys, splits=decode_splits(spec)))


__all__ = ["BlockShape", "SWITCH", "TC_DTYPES", "TC_MAX_LATENT", "TILE_PLANS", "TilePlan", "group_rows",
           "mla_attn_paged_tc", "smem_bytes", "tc_unserved"]
#: The kernel's stages, each importable: factories of its block shape (and their named tuple).
__all__ += ["TcTileOps", "make_accumulate", "make_block", "make_init", "make_issue", "make_load_q", "make_score",
            "make_softmax", "make_store", "make_tile_ops"]
