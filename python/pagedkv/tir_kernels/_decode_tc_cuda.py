"""The tensor-core CUDA paged decode kernel (plain and, with ``_decode_tc_rope_cuda``, inline RoPE; fp16 /
bf16, head dims 64 / 128, GQA groups up to 16): the GQA group's ``G`` q rows, padded to 16, are the A operand of ``mma.sync.m16n8k16``
(``_mma_cuda``), so one K/V read from shared memory serves the whole group on the tensor cores.

Why (H200): the staged SIMT kernel (``_decode_staged_cuda``) reads each K/V byte once per group too, but its
dots, conversions and lane shuffles run on the FP32 pipes; at B >= 16 (enough blocks to reach the memory roof)
it is issue bound, and more so the larger the group (0.44-0.73x FlashInfer at group 8). Here the score and
``P V`` of a 16-key slice are 2 x D/16 + D/8 MMAs per warp, whatever the group up to 16.

Design, one block per (entry, kv head, key split), 4 warps (``TCD_WARPS``):

* key tiles of ``TCD_TK`` = 64 keys; warp ``w`` takes keys ``16 w ..`` of each tile: ``S = Q K^T`` (16 rows x
  16 keys: two n8 C fragments), online softmax of its rows (a row's scores are spread over the 4 lanes of a
  quad), ``O += P V`` with ``P`` rounded to the storage dtype as the A fragment of one k16 step (the C layout
  of two adjacent n8 tiles equals the A layout);
* K and V tiles in a 3-slot ring (``TCD_SLOTS``) of dynamic shared memory (``tcd_smem``, 4-byte words; every
  access is a ``cp.async`` / ``ldmatrix`` address), rows padded by 8 halves so each 8-row phase of an
  ``ldmatrix`` hits distinct banks; tiles ``it + 1`` and ``it + 2`` are in flight while tile ``it`` computes.
  The plain kernel's block copies whole tiles behind one block barrier a tile; the RoPE kernel's warps each
  copy and wait for their own 16 rows behind a warp barrier (``TCD_WARP_RING``: a warp's rotation then
  never waits for another's). The first tiles' copies start before q is loaded. The loads gather 16-byte
  chunks through the page table (the entry's first page slot held in a register; a step looks up the pages
  of the tile the next step copies at D 128, ``TCD_LOOKUP_AHEAD``, so those loads are in flight while a
  tile computes: 1-1.5% at B = 16-64 on the H200); keys past the split's last key are clamped to it (valid
  memory, real values, masked to P = 0, so no stale NaN meets a zero);
* Q (unscaled) is held in registers as A fragments (loaded once); scores scaled by ``sm_scale * log2(e)`` in
  fp32, capped / masked by ``CudaVariant`` (the window is the split ranges, as in the staged kernel);
* at the end the 4 warps' row states are merged through the (drained) ring (one barrier) and written as in
  the staged kernel: ``o`` / ``lse``, or with ``S > 1`` normalized partial states for the merge kernel.

Code: one frozen ``TcDecodeShape`` (kv heads, group, head dim, dtype, variant, warp ring) feeds the stage
factories (``make_load_q``, ``make_tile_loads``, ``make_score``, ``make_softmax``, ``make_accumulate``,
``make_tile_step``, ``make_store_rows`` on ``_epilogue_cuda.make_merged_rows``), each returning ``@T.macro`` s;
``make_tc_key_loop`` and ``make_tc_block`` compose them, ``make_tc_kernel`` binds the grid.

ptxas (sm_90a, no spills, no stack; ``tests/cpu/test_cuda_decode_tc.py``): D 128 about 160 registers with
104,448 bytes of dynamic shared memory (2 blocks an SM; the RoPE kernel about 230 registers and 512 bytes more),
D 64 about 100 (3 slots of 18,432 bytes... 55,296 bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from tvm.script import tirx as T

from ._common import EMPTY_LSE, LOG2E
from ._common_cuda import opaque_i32, paged_kv_len, shfl_xor, split_chunk
# The limits are data in the TVM-free kernel spec (a runtime-only process reports them too).
from ..kernel_spec import TCD_DTYPES, TCD_HEAD_DIMS, TCD_MAX_GROUP, tc_decode_limits  # noqa: F401
from ._decode_tc_rope_cuda import ANG_WORDS, make_tc_rope_parts, rope_words, syncwarp
from ._epilogue_cuda import make_merged_rows
from ._mma_cuda import (a_frag, c_frag, cp_async16, cp_async_commit, cp_async_wait, keep_extent, ldmatrix_x4,
                        mma_sync)

#: Warps per block, keys per tile (16 per warp), ring slots, shared row padding (halves).
TCD_WARPS, TCD_TK, TCD_SLOTS, TCD_PAD = 4, 64, 3, 8
TCD_NT = TCD_WARPS * 32
#: Blocks resident per SM at D 128 (104,448 bytes of shared memory, ~140 registers x 128 threads), x 132 SMs
#: of an H200: the split policy's wave (``_common_cuda.wave_split_count``).
TCD_RESIDENT_BLOCKS = 2 * 132

#: Who copies a tile, by kernel ("plain", "rope"): True, each warp the 16 keys it scores (its rows of the ring),
#: waiting for them alone (a warp barrier a tile); False, the block the whole tile behind one block barrier a
#: tile. H200, 32/8/128 fp16, three A/B pairs in one run: the RoPE kernel 1.05-1.06x the plain one's time at
#: B=64 L=4K per warp against 1.08-1.11x per block; the plain kernel 0.6% slower per warp at B=64.
TCD_WARP_RING = {"plain": False, "rope": True}
#: By head dim: the page-table lookups of the tile a loop step copies are made one step earlier (their loads
#: in flight while a tile computes; H200, D 128: 1-1.5% at B = 16-64); False: right before its copies, on
#: the step's critical path (D 64: with the 8 registers it takes, ptxas spills 4 bytes at bf16 group 1).
TCD_LOOKUP_AHEAD = {64: False, 128: True}


class TcRegs(NamedTuple):
    """A thread's local arrays, handed to the key loop by name: Q's A fragments, a B fragment, the scores,
    P, O's accumulators, the rows' max / sum, scratch; the RoPE angles (cos, sin) and rotation scratch; the
    pages and in-page slots of the next tile's copies (``lookup_tile``)."""

    qf: Any
    bfr: Any
    sacc: Any
    pf: Any
    oacc: Any
    m: Any
    lsum: Any
    st: Any
    angc: Any
    angs: Any
    rc: Any
    pgs: Any


def tile_loads(d: int) -> int:
    """16-byte chunks of K (and of V) a thread copies per tile (``lookup_tile`` keeps a page and a slot each)."""
    return TCD_TK * (d // 8) // TCD_NT


def smem_words(d: int, rope: bool = False) -> int:
    """4-byte words of the ring: ``TCD_SLOTS`` x (K tile + V tile), rows of ``d + TCD_PAD`` halves; with
    ``rope``, the RoPE frequencies after it (``_decode_tc_rope_cuda.rope_words``)."""
    return TCD_SLOTS * TCD_TK * (d + TCD_PAD) + (rope_words(d) if rope else 0)


def _layout(d: int):
    """Word offsets (ints or TIR expressions) of the ring: ``(k_base(slot), v_base(slot), row words)``."""
    rw = (d + TCD_PAD) // 2

    def k_base(slot):
        return slot * (2 * TCD_TK * rw)

    def v_base(slot):
        return k_base(slot) + TCD_TK * rw

    return k_base, v_base, rw


@dataclasses.dataclass(frozen=True)
class TcDecodeShape:
    """The kernel's compile-time parameters, declared once for all its stages: ``hkv`` kv heads of GQA groups of
    ``g`` q heads, head dim ``d``, the storage ``dtype``, the scores' ``CudaVariant`` ``var`` (mask, soft cap,
    window) and ``warp_ring`` (each warp copies its own rows of a tile: ``TCD_WARP_RING``)."""

    hkv: int
    g: int
    d: int
    dtype: str
    var: Any
    warp_ring: bool = False

    @property
    def hq(self) -> int:
        return self.hkv * self.g

    @property
    def nks(self) -> int:
        """k16 steps of a score (head dims / 16)."""
        return self.d // 16

    @property
    def ndn(self) -> int:
        """n8 tiles of O a warp (head dims / 8); also the 16-byte chunks of a K / V row."""
        return self.d // 8

    @property
    def loads(self) -> int:
        return tile_loads(self.d)

    def load_row(self, i, tid):
        """The tile row of thread ``tid``'s ``i``-th chunk (its column is ``tid % (d / 8)`` either way: 32 and NT
        are multiples of the chunks a row; a warp's 16 rows are ``loads`` chunks a lane, as the tile is a
        thread's)."""
        if self.warp_ring:
            return T.truncdiv(tid, 32) * 16 + T.truncdiv(i * 32 + T.truncmod(tid, 32), self.ndn)
        return T.truncdiv(i * TCD_NT + tid, self.ndn)


def make_load_q(p: TcDecodeShape):
    """``load_q(qf, q, b, h, lane)``: Q of the GQA group in registers, as A fragments."""
    NKS, G, dtype = p.nks, p.g, p.dtype

    @T.macro
    def load_q(qf, q, b, h, lane):
        """``qf[ks*8 + i]`` = element ``a_frag(lane, i)`` of dims ``16 ks ..`` of the group's rows (row ``r`` =
        q head ``h*G + r``; rows ``>= G`` are 0), unscaled."""
        for ks in T.unroll(NKS):
            for i in T.unroll(8):
                if a_frag(lane, i)[0] < G:
                    qf[ks * 8 + i] = q[b, h * G + a_frag(lane, i)[0], ks * 16 + a_frag(lane, i)[1]]
                else:
                    qf[ks * 8 + i] = T.Cast(dtype, T.float32(0))

    return load_q


def make_tile_loads(p: TcDecodeShape):
    """``(lookup_tile, issue_tile)``: the load stage of a K / V tile, its page-table lookups and its copies (split
    so that the kernel can look up a tile a step before it copies it: ``TCD_LOOKUP_AHEAD``)."""
    LOADS, PER_ROW, load_row = p.loads, p.ndn, p.load_row
    k_base, v_base, RW = _layout(p.d)

    @T.macro
    def lookup_tile(pgs, page_values, pbase, ps, t0, k1, tid):
        """``pgs[i]``, ``pgs[LOADS + i]``: the page and the slot in it of thread ``tid``'s ``i``-th row of the
        tile of keys ``t0 .. t0 + TK`` (keys clamped to ``k1 - 1``). ``warp_ring``: thread ``tid``'s warp
        ``w`` copies its rows ``16 w ..`` (chunk ``i*32 + lane`` of them), else the block copies the tile
        (chunk ``i*NT + tid``); a chunk's row is ``/ PER_ROW``, its column ``% PER_ROW``."""
        for i in T.unroll(LOADS):
            jc: T.let[T.int32] = T.min(t0 + load_row(i, tid), k1 - 1)
            pgs[i] = page_values[pbase + T.truncdiv(jc, ps)]
            pgs[LOADS + i] = T.truncmod(jc, ps)

    @T.macro
    def issue_tile(smem, pages, pgs, h, slot, tid):
        """Start the 16-byte copies of the K and V rows that ``lookup_tile`` located into ring slot ``slot``;
        the caller commits the group."""
        for i in T.unroll(LOADS):
            T.evaluate(cp_async16(
                T.address_of(smem[k_base(slot) + load_row(i, tid) * RW + T.truncmod(tid, PER_ROW) * 4]),
                T.address_of(pages[pgs[i], 0, h, pgs[LOADS + i], T.truncmod(tid, PER_ROW) * 8])))
            T.evaluate(cp_async16(
                T.address_of(smem[v_base(slot) + load_row(i, tid) * RW + T.truncmod(tid, PER_ROW) * 4]),
                T.address_of(pages[pgs[i], 1, h, pgs[LOADS + i], T.truncmod(tid, PER_ROW) * 8])))

    return lookup_tile, issue_tile


def make_score(p: TcDecodeShape):
    """``score(sacc, qf, bfr, smem, slot, w, lane)``: S of the warp's 16 keys of a tile on the tensor cores."""
    NKS, dtype = p.nks, p.dtype
    k_base, _v_base, RW = _layout(p.d)

    @T.macro
    def score(sacc, qf, bfr, smem, slot, w, lane):
        """``sacc[nt*4 ..]`` = C fragment of keys ``16 w + 8 nt ..`` of the slot's tile: one ``ldmatrix.x4``
        gives the B fragments of two k steps (matrix ``lane // 8`` = dims ``32 ks2 + 8 (lane // 8) ..``)."""
        for e in T.unroll(8):
            sacc[e] = T.float32(0)
        for ks2 in T.unroll(NKS // 2):
            for nt in T.unroll(2):
                T.evaluate(ldmatrix_x4(T.address_of(bfr[0]), T.address_of(
                    smem[k_base(slot) + (w * 16 + nt * 8 + lane % 8) * RW + ks2 * 16 + (lane // 8) * 4]), False))
                for u in T.unroll(2):
                    T.evaluate(mma_sync(dtype, T.address_of(sacc[nt * 4]), T.address_of(qf[(ks2 * 2 + u) * 8]),
                                        T.address_of(bfr[u * 2])))

    return score


def make_softmax(p: TcDecodeShape):
    """``softmax(sacc, pf, m, lsum, oacc, st, key0, k1, lane, sm_scale)``: the online softmax of a warp's rows."""
    NDN, dtype, var = p.ndn, p.dtype, p.var

    @T.macro
    def softmax(sacc, pf, m, lsum, oacc, st, key0, k1, lane, sm_scale):
        """Online softmax of the lane's rows ``lane // 4`` (``rr`` 0) and ``+ 8`` (``rr`` 1) over the warp's 16
        keys ``key0 ..`` (``>= k1`` masked): running max ``m`` (quad-uniform), the lane's partial sum ``lsum``,
        ``oacc`` rescaled; ``pf`` = P in the storage dtype, laid out as the A fragment of ``P V``."""
        for rr in T.unroll(2):
            st[0] = m[rr]
            for nt in T.unroll(2):
                for c in T.unroll(2):
                    sacc[nt * 4 + rr * 2 + c] = var.logits(sacc[nt * 4 + rr * 2 + c] * (sm_scale * T.float32(LOG2E)),
                                                           key0 + nt * 8 + c_frag(lane, c)[1] < k1)
                    st[0] = T.max(st[0], sacc[nt * 4 + rr * 2 + c])
            st[0] = T.max(st[0], shfl_xor(st[0], 1))
            st[0] = T.max(st[0], shfl_xor(st[0], 2))
            st[1] = T.exp2(m[rr] - st[0])
            m[rr] = st[0]
            lsum[rr] = lsum[rr] * st[1]
            for dn in T.unroll(NDN):
                for c in T.unroll(2):
                    oacc[dn * 4 + rr * 2 + c] = oacc[dn * 4 + rr * 2 + c] * st[1]
            for nt in T.unroll(2):
                for c in T.unroll(2):
                    st[2] = T.exp2(sacc[nt * 4 + rr * 2 + c] - st[0])
                    lsum[rr] = lsum[rr] + st[2]
                    pf[nt * 4 + rr * 2 + c] = T.Cast(dtype, st[2])

    return softmax


def make_accumulate(p: TcDecodeShape):
    """``accumulate(oacc, pf, bfr, smem, slot, w, lane)``: ``O += P V`` of the warp's 16 keys of a tile."""
    NDN, dtype = p.ndn, p.dtype
    _k_base, v_base, RW = _layout(p.d)

    @T.macro
    def accumulate(oacc, pf, bfr, smem, slot, w, lane):
        """``O += P V`` over the warp's 16 keys: per 16 dims one ``ldmatrix.x4.trans`` of the row-major V tile
        (matrix ``i = lane // 8`` = keys ``16 w + 8 (i % 2) ..`` x dims ``16 dn2 + 8 (i // 2) ..``) gives the B
        fragments of n tiles ``2 dn2`` and ``2 dn2 + 1``."""
        for dn2 in T.unroll(NDN // 2):
            T.evaluate(ldmatrix_x4(T.address_of(bfr[0]), T.address_of(
                smem[v_base(slot) + (w * 16 + ((lane // 8) % 2) * 8 + lane % 8) * RW + dn2 * 8 + (lane // 16) * 4]),
                True))
            for u in T.unroll(2):
                T.evaluate(mma_sync(dtype, T.address_of(oacc[(dn2 * 2 + u) * 4]), T.address_of(pf[0]),
                                    T.address_of(bfr[u * 2])))

    return accumulate


def make_tile_step(p: TcDecodeShape):
    """``tile_step(regs, smem, slot, key0, k1, w, lane, sm_scale)``: the score, softmax and accumulate stages of the
    warp's 16 keys ``key0 ..`` of the tile in ring slot ``slot`` (``regs``: ``TcRegs``)."""
    score, softmax, accumulate = make_score(p), make_softmax(p), make_accumulate(p)

    @T.macro
    def tile_step(regs, smem, slot, key0, k1, w, lane, sm_scale):
        qf, bfr, sacc, pf, oacc, m, lsum, st = regs[:8]  # TcRegs' first eight
        score(sacc, qf, bfr, smem, slot, w, lane)
        softmax(sacc, pf, m, lsum, oacc, st, key0, k1, lane, sm_scale)
        accumulate(oacc, pf, bfr, smem, slot, w, lane)

    return tile_step


def make_init_state(p: TcDecodeShape):
    """``init_state(m, lsum, oacc)``: a warp's rows before their first key: max ``EMPTY_LSE``, sums and O zero."""
    NDN = p.ndn

    @T.macro
    def init_state(m, lsum, oacc):
        for rr in T.unroll(2):
            m[rr] = T.float32(EMPTY_LSE)
            lsum[rr] = T.float32(0)
        for e in T.unroll(NDN * 4):
            oacc[e] = T.float32(0)

    return init_state


def make_store_rows(p: TcDecodeShape):
    """``store_rows(o, lse, ws_o, ws_l, smem, oacc, m, lsum, st, b, h, sp, S, w, lane, tid)``: the store stage."""
    D, G, NDN = p.d, p.g, p.ndn
    # The rows' (m, l) words follow the warps' o rows. A Python constant outside the macro: assigned inside it,
    # it becomes a TIR Bind, and one such Bind per kernel made s_tir.CompactBufferAllocation take ~60 s on a
    # PrimFunc holding two of these kernels (0.6 s each alone).
    ML0 = TCD_WARPS * 16 * D
    merged_rows = make_merged_rows(states=TCD_WARPS, group=G, d=D, nt=TCD_NT, heads=p.hq, dtype=p.dtype,
                                   m_at=lambda red, w, gg: red[ML0 + (w * 16 + gg) * 2],
                                   l_at=lambda red, w, gg: red[ML0 + (w * 16 + gg) * 2 + 1],
                                   o_at=lambda red, w, gg, dd: red[(w * 16 + gg) * D + dd])

    @T.macro
    def store_rows(o, lse, ws_o, ws_l, smem, oacc, m, lsum, st, b, h, sp, S, w, lane, tid):
        """Merge the 4 warps' states of each row through the drained ring (``red_o[w, r, d]`` then
        ``red_ml[w, r, 0 / 1]`` as words; one barrier) and write rows ``h*G + r`` (``_epilogue_cuda``): ``o`` /
        ``lse`` when ``S == 1``, else split ``sp``'s normalized partial state."""
        for rr in T.unroll(2):
            lsum[rr] = lsum[rr] + shfl_xor(lsum[rr], 1)
            lsum[rr] = lsum[rr] + shfl_xor(lsum[rr], 2)
            if lane // 4 + rr * 8 < G:
                for dn in T.unroll(NDN):
                    for c in T.unroll(2):
                        smem[(w * 16 + lane // 4 + rr * 8) * D + dn * 8 + c_frag(lane, c)[1]] = oacc[dn * 4 + rr * 2 + c]
                if lane % 4 == 0:
                    smem[ML0 + (w * 16 + lane // 4 + rr * 8) * 2] = m[rr]
                    smem[ML0 + (w * 16 + lane // 4 + rr * 8) * 2 + 1] = lsum[rr]
        T.tvm_storage_sync("shared")
        merged_rows(o, lse, ws_o, ws_l, smem, smem, st, b, h, sp, S, tid)

    return store_rows


def make_tc_parts(hkv: int, g: int, d: int, dtype: str, var, *, warp_ring: bool = False):
    """The kernel's stages as macros: ``(load_q, (lookup_tile, issue_tile), tile_step, store_rows)`` (the
    ``make_*`` stage factories of ``TcDecodeShape(hkv, g, d, dtype, var, warp_ring)``); ``warp_ring``: each warp
    copies its own rows of a tile (``TCD_WARP_RING``)."""
    p = TcDecodeShape(hkv, g, d, dtype, var, warp_ring)
    return make_load_q(p), make_tile_loads(p), make_tile_step(p), make_store_rows(p)


def make_issue_first(p: TcDecodeShape):
    """``issue_first(pgs, smem, pages, page_values, pbase, ps, h, k0, k1, tid)``: the copies of the split's first
    ``TCD_SLOTS - 1`` tiles started, a group each (the kernel calls it before loading q, so they overlap); with
    ``TCD_LOOKUP_AHEAD``, the pages of the key loop's first copy looked up into ``pgs`` (``TcRegs.pgs``)."""
    lookup_tile, issue_tile = make_tile_loads(p)
    TK, NS, ahead = TCD_TK, TCD_SLOTS, TCD_LOOKUP_AHEAD[p.d]

    @T.macro
    def issue_first(pgs, smem, pages, page_values, pbase, ps, h, k0, k1, tid):
        for j in T.unroll(NS - 1):
            if j < T.truncdiv(k1 - k0 + TK - 1, TK):
                lookup_tile(pgs, page_values, pbase, ps, k0 + j * TK, k1, tid)
                issue_tile(smem, pages, pgs, h, j, tid)
            T.evaluate(cp_async_commit())
        if ahead:
            if NS - 1 < T.truncdiv(k1 - k0 + TK - 1, TK):
                lookup_tile(pgs, page_values, pbase, ps, k0 + (NS - 1) * TK, k1, tid)

    return issue_first


def make_tc_key_loop(hkv: int, g: int, d: int, dtype: str, var, rotate_keys=None):
    """``(issue_first, key_loop)``: ``make_issue_first``'s macro, and ``key_loop(regs, smem, pages, page_values,
    pbase, ps, h, k0, k1, w, lane, tid, sm_scale)``: the warp's row states over the split's keys ``[k0, k1)``;
    with ``rotate_keys`` (inline RoPE, ``_decode_tc_rope_cuda``) each warp rotates its keys of a tile in place
    before scoring them. Ring of ``TCD_SLOTS`` (2 or 3) slots: tiles ``0 .. TCD_SLOTS - 2`` issued first; at tile
    ``it`` the wait leaves only the ``TCD_SLOTS - 2`` newer tiles in flight, and the barrier after it (the
    block's, or the warp's with ``TCD_WARP_RING``, each warp then copying and reading only its own rows) both
    publishes tile ``it`` and tells that every warp is done with tile ``it - 1``, whose slot ``(it + TCD_SLOTS -
    1) % TCD_SLOTS`` then takes tile ``it + TCD_SLOTS - 1``. Every step commits a group (empty past the last
    tile), so the wait counts stay uniform."""
    p = TcDecodeShape(hkv, g, d, dtype, var, TCD_WARP_RING["plain" if rotate_keys is None else "rope"])
    warp_ring, ahead = p.warp_ring, TCD_LOOKUP_AHEAD[d]
    (lookup_tile, issue_tile), tile_step = make_tile_loads(p), make_tile_step(p)
    TK, NS = TCD_TK, TCD_SLOTS
    if NS not in (2, 3):
        raise ValueError(f"pagedkv.tir_kernels: the tensor-core decode ring takes 2 or 3 slots, not {NS}")

    @T.macro
    def tile_barrier():
        if warp_ring:
            T.evaluate(syncwarp())
        else:
            T.tvm_storage_sync("shared")

    @T.macro
    def key_loop(regs, smem, pages, page_values, pbase, ps, h, k0, k1, w, lane, tid, sm_scale):
        tiles: T.let[T.int32] = T.truncdiv(k1 - k0 + TK - 1, TK)
        for it in T.serial(tiles):
            T.evaluate(cp_async_wait(NS - 2))
            tile_barrier()
            if it + NS - 1 < tiles:
                if ahead:
                    issue_tile(smem, pages, regs.pgs, h, T.truncmod(it + NS - 1, NS), tid)
                    # The next tile's pages load while this one computes.
                    if it + NS < tiles:
                        lookup_tile(regs.pgs, page_values, pbase, ps, k0 + (it + NS) * TK, k1, tid)
                else:
                    lookup_tile(regs.pgs, page_values, pbase, ps, k0 + (it + NS - 1) * TK, k1, tid)
                    issue_tile(smem, pages, regs.pgs, h, T.truncmod(it + NS - 1, NS), tid)
            T.evaluate(cp_async_commit())
            if rotate_keys is not None:
                # Key k0 + t at relative position t (q was rotated by q_pos - k_pos_offset - k0).
                rotate_keys(smem, T.truncmod(it, NS), it, w, lane, regs.angc, regs.angs, regs.rc)
            tile_step(regs, smem, T.truncmod(it, NS), k0 + it * TK + w * 16, k1, w, lane, sm_scale)
        # The ring is reused by the store: every copy landed, every warp done reading.
        T.evaluate(cp_async_wait(0))
        T.tvm_storage_sync("shared")

    return make_issue_first(p), key_loop


def _rope_stages(d: int, g: int, dtype: str):
    """``(rope_setup, load_q_rope, rotate_keys)`` of the inline-RoPE kernel (``_decode_tc_rope_cuda``) on this
    kernel's ring: its frequency table after the ring, keys rotated in place in their K rows."""
    k_base, _v_base, rw = _layout(d)
    return make_tc_rope_parts(d, g, dtype, table0=smem_words(d), nt=TCD_NT, tk=TCD_TK,
                              k_row=lambda slot, row: k_base(slot) + row * rw, row_words=rw)


def make_tc_block(p: TcDecodeShape, *, rope: bool = False):
    """A thread's work (``make_tc_kernel``'s arguments, then entry ``bx``, kv head ``h``, split ``sp``, thread
    ``tid``): its registers and the ring, the split's key range, its first copies, Q, the key loop, the store."""
    d, dtype, var = p.d, p.dtype, p.var
    load_q, store_rows = make_load_q(p), make_store_rows(p)
    rope_setup, load_q_rope, rotate_keys = _rope_stages(d, p.g, dtype) if rope else (None, None, None)
    issue_first, key_loop = make_tc_key_loop(p.hkv, p.g, d, dtype, var, rotate_keys)
    init_state, TK, NDN, NKS = make_init_state(p), TCD_TK, p.ndn, p.nks

    @T.macro
    def block(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps, rope_scale,
              rope_theta, sm_scale, S, C, ws_o, ws_l, bx, h, sp, tid):
        qf = T.alloc_buffer((NKS * 8,), dtype, scope="local")
        bfr = T.alloc_buffer((4,), "uint32", scope="local")
        sacc = T.alloc_buffer((8,), "float32", scope="local")
        pf = T.alloc_buffer((8,), dtype, scope="local")
        oacc = T.alloc_buffer((NDN * 4,), "float32", scope="local")
        m = T.alloc_buffer((2,), "float32", scope="local")
        lsum = T.alloc_buffer((2,), "float32", scope="local")
        st = T.alloc_buffer((4,), "float32", scope="local")
        rc = T.alloc_buffer((1,), "float32", scope="local")  # RoPE cos / sin
        rs = T.alloc_buffer((1,), "float32", scope="local")
        pbuf = T.alloc_buffer((1,), "int32", scope="local")  # the entry's first page slot
        # Pages and in-page slots of a thread's rows of the next tile copied (lookup_tile).
        pgs = T.alloc_buffer((2 * tile_loads(d),), "int32", scope="local")
        # A lane's RoPE angles (base, tile step, row step: _decode_tc_rope_cuda).
        angc = T.alloc_buffer((ANG_WORDS if rope else 1,), "float32", scope="local")
        angs = T.alloc_buffer((ANG_WORDS if rope else 1,), "float32", scope="local")
        # One dynamic buffer of words, named apart from the prefill's ``smem`` (same library).
        tcd_smem = T.alloc_buffer((smem_words(d, rope),), "float32", scope="shared.dyn")
        keep_extent(tcd_smem, smem_words(d, rope))  # the launch's bytes: every cp.async chunk whole
        w: T.let[T.int32] = T.truncdiv(tid, 32)
        lane: T.let[T.int32] = T.truncmod(tid, 32)
        # ldmatrix reaches bfr through its address only: without these stores TVM would size
        # it by the elements it sees indexed (bfr[0], bfr[2]).
        for e in T.unroll(4):
            bfr[e] = T.uint32(0)
        if bx < B:
            kvlen: T.let[T.int32] = paged_kv_len(page_indptr, last_page_len, bx, ps)
            Sk: T.let[T.int32] = opaque_i32(S)  # the split count, opaque inside the kernel
            # This split's keys: [k0, k1) (split_chunk: a chunked or an equal range).
            chunk: T.let[T.int32] = split_chunk(var, kvlen, Sk, opaque_i32(C), TK)
            k0: T.let[T.int32] = T.min(var.decode_key(kvlen, sp * chunk), kvlen)
            k1: T.let[T.int32] = T.min(k0 + chunk, kvlen)
            # In a register (a let of a load is inlined by TVM, and the copies' asm clobbers
            # memory: the load would be redone for every chunk).
            pbuf[0] = page_indptr[bx]
            # The first tiles' copies start before q is loaded (and the RoPE setup runs).
            issue_first(pgs, tcd_smem, pages, page_values, pbuf[0], ps, h, k0, k1, tid)
            if rope:
                rope_setup(tcd_smem, angc, angs, rope_theta, rope_scale, tid, lane)
                load_q_rope(qf, q, bx, h, lane, q_pos[bx] - k_pos_offset[bx] - k0, tcd_smem, rc, rs)
            elif k0 < k1:  # a split past the entry's keys (chunked ranges) stores its empty lse only
                load_q(qf, q, bx, h, lane)
            init_state(m, lsum, oacc)
            key_loop(TcRegs(qf, bfr, sacc, pf, oacc, m, lsum, st, angc, angs, rc, pgs),
                     tcd_smem, pages, page_values, pbuf[0], ps, h, k0, k1, w, lane, tid, sm_scale)
            store_rows(o, lse, ws_o, ws_l, tcd_smem, oacc, m, lsum, st, bx, h, sp, Sk, w, lane, tid)

    return block


def make_tc_kernel(hq: int, hkv: int, d: int, dtype: str, var, *, rope: bool = False):
    """The tensor-core decode kernel as a macro (same arguments as the staged kernel): grid (entry, kv head,
    split) x 128 threads, each running ``make_tc_block``'s work; ``rope``: the inline-RoPE kernel
    (``_decode_tc_rope_cuda``). Raises ``NotImplementedError`` naming the limits (``tc_decode_limits``) a
    shape breaks."""
    g = hq // hkv
    why = tc_decode_limits(g, d, dtype)
    if why:
        raise NotImplementedError("pagedkv.tir_kernels: the tensor-core CUDA decode kernel: " + "; ".join(why))
    block = make_tc_block(TcDecodeShape(hkv, g, d, dtype, var), rope=rope)

    @T.macro
    def kernel(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
               rope_scale, rope_theta, sm_scale, S, C, ws_o, ws_l):
        for bx in T.thread_binding(T.max(B, 1), thread="blockIdx.x"):
            for h in T.thread_binding(hkv, thread="blockIdx.y"):
                for sp in T.thread_binding(S, thread="blockIdx.z"):
                    for tid in T.thread_binding(TCD_NT, thread="threadIdx.x"):
                        block(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                              rope_scale, rope_theta, sm_scale, S, C, ws_o, ws_l, bx, h, sp, tid)

    return kernel


__all__ = ["TCD_DTYPES", "TCD_HEAD_DIMS", "TCD_MAX_GROUP", "TCD_NT", "TCD_PAD", "TCD_RESIDENT_BLOCKS", "TCD_SLOTS",
           "TCD_TK", "TCD_WARPS", "TcDecodeShape", "make_accumulate", "make_init_state", "make_issue_first",
           "make_load_q", "make_score", "make_softmax", "make_store_rows", "make_tc_block", "make_tc_kernel",
           "make_tc_key_loop", "make_tc_parts", "make_tile_loads", "make_tile_step", "smem_words", "tc_decode_limits"]
