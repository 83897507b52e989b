"""The wgmma CUDA MLA decode (``mla_attn_decode_paged``) with Q in shared memory and the warpgroups in two roles,
fp16 / bf16, sm_90a; forced with the path switch ``cuda_mla_decode_kernel=wgq``, and auto's choice where
it serves the spec with 16 heads or more (sm_90a; ``pagedkv.kernel_table``).

Why: ``mla_cuda_wg``'s kernel (and its TMA variant, measured before this one) holds Q's A fragments in
registers (72 a thread at DeepSeek's 576), so each warpgroup can only take half of the latent dims; both then wait for each other's partial scores every tile, and run the same
softmax. Its tile is a serial chain (S, exchange, softmax, P V) in lockstep; the MLA probe found the tensor cores
idle most of it (BENCHMARKS.md run 23). Here Q lives in shared memory (read by the S wgmma's through a
descriptor), which frees the registers for a whole tile's S in one warpgroup:

* **Warpgroup 1, the score warpgroup**: S = Q K^T of all 64 rows x ``TK`` keys over all ``DL`` dims (``DL / 16``
  wgmma's, both operands in shared memory), the mask and online softmax on full rows (no exchange), P into the
  shared buffer ``P`` with the rows' rescale factors, then O[:, DV/2 ..] += P V from its registers (left in
  flight; the next tile waits for it first and frees the stage *before* it waits for its own tile, so two tiles
  load at once: freed after the next tile's S was issued, the ring held one tile in flight, BENCHMARKS.md run 25).
  The softmax takes the row's max from four partial maxima and its sum from four partial sums, the key mask only
  in a split's last tile.
* **Warpgroup 0, the value warpgroup**: lane 0 of its warps issues the TMA boxes of the ring (off the score
  warpgroup's path; boxes of ``box_rows(ps)`` keys of one page x 64 dims, the pages looked up a tile ahead), then
  per tile: waits for P, rescales its O half, O[:, .. DV/2] += P V with P from shared memory, and frees ``P`` and
  the stage.
* Synchronization: mbarriers ``full[s]`` (the TMA's bytes) and ``empty[s]`` (8 arrivals: each warp's lane 0 once its
  reads of the stage are complete), named barriers ``BAR_P`` (P and the factors written), ``BAR_PFREE`` (warpgroup 0's
  P V done with ``P``), ``BAR_FIN`` (the rows' max and sum handed to warpgroup 0 for the store) and ``BAR_TAIL``
  (warpgroup 1 alone: the tail's zeroed V rows visible to its own P V). The buffers warpgroup 1 writes for
  warpgroup 0 are reached through the opaque shared accessors (``_wgmma_cuda.st_shared_f32`` ...), so TVM's
  barrier planner adds no ``__syncthreads`` to the loop.
* Shared memory (``smem_bytes``): Q (64 x ``DL``, 128-byte swizzle), ``NS`` stages of ``TK`` keys (128-byte
  swizzle), P (64 x ``TK``, core matrices), the factors, the mbarriers: 2 stages of 64 keys at DeepSeek's 576
  (225 KB of the 227 KB a block may have; 32-key tiles in 4 stages ran 1.2x slower, run 25).
* V rows at or past the split's end are zeroed before P V (a box brings whole 8-key groups; a group past the end
  is not issued), and where TMA cannot read the pool the PrimFunc's host code runs ``mla_cuda_wg``'s kernel
  (``make_wg_body``).

Code: one frozen ``WgqShape`` (heads, latent, value dims, dtype, keys a tile) feeds every stage factory: the value
warpgroup's boxes (``make_issue``), Q (``make_load_q``), S and the tail's zeroing (``make_score``), the softmax, the
hand-off through shared memory (``make_handoff``) and P V (``make_accumulate``), bundled as ``WgqTileOps``; the two
roles (``make_score_role``, ``make_value_role``) and the block (``make_block``, ``mla_cuda_wg``'s store) on top.

Limits as data: ``mla_cuda_wg.wg_unserved``'s (the same 64-head block and latent limits); ``wgq_unserved`` names
this value.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tvm.script import tirx as T

from ..ops import MLA_ATTN_DECODE_PAGED
from . import mla_cuda_wg as wgk
from ._common import LOG2E, MASKED
from ._common_cuda import decode_splits, shfl_xor
from ._mla_frame_cuda import SWITCHES, make_frame, mla_prim_func
from ._mma_cuda import c_frag, cp_async16, cp_async_commit, cp_async_wait, keep_extent
from ._tma_cuda import (MBAR_BYTES, SW128_ALIGN, LatentPageMap, mbar_arrive, mbar_expect_tx,
                        mbar_init, mbar_wait, sw128_pad, tma_load3)
from ._wgmma_cuda import (CoreLayout, Sw128Layout, acc_fence, bar_arrive, bar_sync, ld_shared_f32, proxy_fence,
                          st_shared_b32, st_shared_f32, st_shared_zero16, warp_uniform, wg_attention_gemms, wg_commit,
                          wg_fence, wg_wait0, wgmma_ss)

SWITCH, VALUE = "cuda_mla_decode_kernel", "wgq"
#: Heads a block (one m64 tile), threads (two warpgroups), keys a tile.
ROWS, NT, TK = wgk.ROWS, wgk.NT, 64
#: Dynamic shared memory a block may have on sm_90 (227 KB), and the most ring stages used.
SMEM_LIMIT, MAX_STAGES = 232448, 4
#: Named barriers (0 is ``__syncthreads``).
BAR_P, BAR_PFREE, BAR_FIN, BAR_TAIL = 1, 2, 3, 4
#: Which specs auto sends here (sm_90a, 16+ heads) is the selection table's (``pagedkv.kernel_table``).
#: Warps of the value warpgroup issuing boxes (lane 0 each; ``issue``): key groups ``w, w + 4`` of warp ``w``, or,
#: with one group a tile, its column blocks ``w, w + 4, ..``.
ISSUERS = 4


def box_rows(ps, tk: int | None = None):
    """Rows of the TMA boxes for pages of ``ps`` keys (an int, or a TIR expression in the kernel and its host
    code): the largest of 64, 32, 16, 8 that divides ``ps``, at most ``tk``; a box never crosses a page, and a
    tile of ``tk`` keys is ``tk / box_rows`` boxes a column block (one at DeepSeek's pages of 64: 9 boxes a tile,
    against 72 of 8 rows)."""
    tk = tk or TK
    out = 8
    for r in (16, 32, 64):
        if r <= tk:
            out = (r if ps % r == 0 else out) if isinstance(ps, int) else T.if_then_else(ps % r == 0, r, out)
    return out


def stages(latent_dim: int, tk: int) -> int:
    """Ring stages that fit beside Q, P, the factors and the mbarriers (at most ``MAX_STAGES``)."""
    fixed = 2 * (ROWS * latent_dim + ROWS * tk + 2 * ROWS) + 2 * MAX_STAGES * MBAR_BYTES + SW128_ALIGN
    return min(MAX_STAGES, (SMEM_LIMIT - fixed) // (2 * tk * latent_dim))


def smem_bytes(latent_dim: int, tk: int | None = None) -> int:
    """Dynamic shared memory of a block (bytes): Q, the ring, P, the factors, the mbarriers and the slack to a
    1024-byte boundary."""
    tk = tk or TK
    ns = stages(latent_dim, tk)
    return 2 * (ROWS * latent_dim + ns * tk * latent_dim + ROWS * tk + 2 * ROWS) + 2 * ns * MBAR_BYTES + SW128_ALIGN


def wgq_unserved(spec) -> list[str]:
    """Why this kernel does not serve ``spec``: ``mla_cuda_wg.wg_unserved``'s reasons, and too little shared memory
    for two stages."""
    out = wgk.wg_unserved(spec)
    if not out and stages(spec.latent_dim, TK) < 2:
        out.append(f"latent dim {spec.latent_dim} (Q and two stages of {TK} keys do not fit {SMEM_LIMIT} bytes)")
    return out


class _Smem:
    """Element offsets (of the 2-byte dtype) of a block's regions past the 1024-byte boundary, and the addresses
    of the ring's mbarriers."""

    def __init__(self, dl: int, tk: int):
        self.ns, self.tile = stages(dl, tk), tk * dl
        self.ring = ROWS * dl
        self.p = self.ring + self.ns * self.tile
        self.alpha = self.p + ROWS * tk
        self.mbar = self.alpha + 2 * ROWS
        self.total = (smem_bytes(dl, tk)) // 2

    def stage(self, s):
        return self.ring + s * self.tile

    def full(self, smem, s):
        """``full[s]``: the mbarrier of stage ``s``'s TMA bytes."""
        return T.address_of(smem[self.mbar + s * (MBAR_BYTES // 2)])

    def empty(self, smem, s):
        """``empty[s]``: the mbarrier of stage ``s``'s readers done (8 arrivals, a warp's lane 0 each)."""
        return T.address_of(smem[self.mbar + (self.ns + s) * (MBAR_BYTES // 2)])


@dataclasses.dataclass(frozen=True)
class WgqShape:
    """The block's compile-time parameters, declared once for its stages: ``heads`` query heads, ``latent`` dims of
    Q and of a latent row, ``dv`` value dims (a latent row's first), the storage ``dtype``, ``tk`` keys a tile."""

    heads: int
    latent: int
    dv: int
    dtype: str
    tk: int = TK

    @property
    def smem(self) -> _Smem:
        return _Smem(self.latent, self.tk)

    @property
    def dvh(self) -> int:
        """Value dims of a warpgroup (its half of O)."""
        return self.dv // 2

    @property
    def ndn(self) -> int:
        """n8 tiles of a warpgroup's O."""
        return self.dv // 2 // 8

    @property
    def lay(self) -> Sw128Layout:
        """A ring stage: ``tk`` latent rows, 128-byte swizzled."""
        return Sw128Layout(self.latent, self.tk)

    def gemms(self):
        """The score warpgroup's S over all ``latent`` dims and its O half over ``dvh`` value dims
        (``_wgmma_cuda.wg_attention_gemms``)."""
        return wg_attention_gemms(self.dtype, s_steps=self.latent // 16, tk=self.tk, k_lay=self.lay, dv=self.dvh,
                                  v_lay=self.lay)


def make_softmax(sh: WgqShape):
    """The score warpgroup's online softmax of a tile (``mla_cuda_wg``'s rules: log2 units, keys at or past
    ``kend`` masked, ``EMPTY_LSE`` start), the rows' factors in ``al`` (O is rescaled by ``rescale``).

    Written for instruction-level parallelism (the probe's stall samples put a third of the score warpgroup's
    time in a serial softmax): the key mask only in a split's last tile (a whole tile branches once), the row's max
    from four partial maxima and its sum from four partial sums (``tk`` >= 32)."""
    dtype, tk = sh.dtype, sh.tk
    NSN = tk // 8  # 8-key column groups: a thread holds 2 keys of each, per row

    @T.macro
    def softmax(sacc, pf, m, lsum, al, st, kbase, kend, scale2, lane):
        if kbase + tk <= kend:
            for e in T.unroll(NSN * 4):
                sacc[e] = sacc[e] * scale2
        else:
            for nt in T.unroll(NSN):
                for e in T.unroll(4):
                    sacc[nt * 4 + e] = T.if_then_else(kbase + nt * 8 + c_frag(lane, e % 2)[1] < kend,
                                                      sacc[nt * 4 + e] * scale2, T.float32(MASKED))
        for rr in T.unroll(2):
            # Four partial maxima (chains of NSN / 4), then their tree.
            for j in T.unroll(4):
                st[j] = T.max(sacc[j * 4 + rr * 2], sacc[j * 4 + rr * 2 + 1])
            for nt in T.unroll(4, NSN):
                st[nt % 4] = T.max(st[nt % 4], T.max(sacc[nt * 4 + rr * 2], sacc[nt * 4 + rr * 2 + 1]))
            st[0] = T.max(T.max(st[0], st[1]), T.max(st[2], st[3]))
            st[0] = T.max(st[0], m[rr])
            st[0] = T.max(st[0], shfl_xor(st[0], 1))
            st[0] = T.max(st[0], shfl_xor(st[0], 2))
            al[rr] = T.exp2(m[rr] - st[0])
            m[rr] = st[0]
            for j in T.unroll(4):
                st[1 + j] = T.float32(0)
            for nt in T.unroll(NSN):
                for c in T.unroll(2):
                    sacc[nt * 4 + rr * 2 + c] = T.exp2(sacc[nt * 4 + rr * 2 + c] - st[0])
                    st[1 + (nt * 2 + c) % 4] = st[1 + (nt * 2 + c) % 4] + sacc[nt * 4 + rr * 2 + c]
                    pf[nt * 4 + rr * 2 + c] = T.Cast(dtype, sacc[nt * 4 + rr * 2 + c])
            lsum[rr] = lsum[rr] * al[rr] + ((st[1] + st[2]) + (st[3] + st[4]))

    return softmax


def make_issue(sh: WgqShape):
    """The load stage of the value warpgroup's issuing lanes: ``(look_up, issue)``, a tile's page lookups and its
    TMA boxes into a ring stage."""
    DL, tk, L = sh.latent, sh.tk, sh.smem
    NCB, GROUPS = DL // 64, tk // 8

    def group(w, j, br):
        """Key group of an issuing lane's slot ``j`` (0, 1): with one group a tile (``br == tk``) group 0 in slot 0
        (every issuing lane takes some of its column blocks), else groups ``w`` and ``w + 4`` (all their column
        blocks); ``GROUPS`` (none) for an unused slot."""
        return T.if_then_else(br == tk, T.if_then_else(j == 0, 0, GROUPS), w + ISSUERS * j)

    @T.macro
    def look_up(pg, page_values, pbase, ps, kbase, kend, w, br):
        """An issuing lane: the pages of its groups of the tile at ``kbase`` into ``pg`` (looked up a tile ahead:
        the load's latency then passes off the path from a free stage to its boxes)."""
        for j in T.unroll(2):
            if T.And(group(w, j, br) < T.truncdiv(tk, br), kbase + group(w, j, br) * br < kend):
                pg[j] = page_values[pbase + T.truncdiv(kbase + group(w, j, br) * br, ps)]

    @T.macro
    def box(smem, s, pmap, ps, kbase, g, cb, br, page):
        T.evaluate(tma_load3(T.address_of(smem[L.stage(s) + (cb * tk + g * br) * 64]), L.full(smem, s), pmap, cb * 64,
                             T.truncmod(kbase + g * br, ps), page))

    @T.macro
    def issue(smem, s, pmap, page_values, pbase, ps, kbase, kend, pg, w):
        """An issuing lane (lane 0 of warp ``w`` of the value warpgroup): its boxes of the tile at ``kbase`` into
        stage ``s`` (key groups of ``box_rows(ps)`` keys; none at or past ``kend``), warp 0 arming ``full[s]`` with
        the tile's bytes first; then its pages of the next tile. One group a tile (pages of 64 keys or more): lane
        ``w`` takes column blocks ``w, w + 4, ..``; else groups ``w`` and ``w + 4`` whole."""
        br: T.let[T.int32] = box_rows(ps, tk)
        if w == 0:
            T.evaluate(mbar_expect_tx(L.full(smem, s), T.min(T.truncdiv(kend - kbase + br - 1, br), T.truncdiv(tk, br))
                                      * br * DL * 2))
        if br == tk:
            for i in T.unroll((NCB + ISSUERS - 1) // ISSUERS):
                if w + ISSUERS * i < NCB:
                    box(smem, s, pmap, ps, kbase, 0, w + ISSUERS * i, br, pg[0])
        else:
            for j in T.unroll(2):
                if T.And(w + ISSUERS * j < T.truncdiv(tk, br), kbase + (w + ISSUERS * j) * br < kend):
                    for cb in T.unroll(NCB):
                        box(smem, s, pmap, ps, kbase, w + ISSUERS * j, cb, br, pg[j])
        look_up(pg, page_values, pbase, ps, kbase + tk, kend, w, br)

    return look_up, issue


def make_load_q(sh: WgqShape):
    """``load_q(smem, q, b, h0, H, tid)``: Q's 64 rows into shared memory, where both S operands are read."""
    DL, QLAY = sh.latent, Sw128Layout(sh.latent, ROWS)

    @T.macro
    def load_q(smem, q, b, h0, H, tid):
        """Q's 64 rows (0 past ``H``) into shared memory, 128-byte swizzled (16-byte ``cp.async``, complete on
        return)."""
        for it in T.serial((ROWS * DL // 8 + NT - 1) // NT):
            if it * NT + tid < ROWS * DL // 8:
                row: T.let[T.int32] = T.truncdiv(it * NT + tid, DL // 8)
                col: T.let[T.int32] = T.truncmod(it * NT + tid, DL // 8) * 8
                if h0 + row < H:
                    T.evaluate(cp_async16(T.address_of(smem[QLAY.index(row, col)]),
                                          T.address_of(q[b, T.min(h0 + row, H - 1), col])))
                else:
                    T.evaluate(st_shared_zero16(T.address_of(smem[QLAY.index(row, col)])))
        T.evaluate(cp_async_commit())
        T.evaluate(cp_async_wait(0))

    return load_q


def make_score(sh: WgqShape):
    """The score warpgroup's score stage: ``(score, zero_tail)``, S of a stage issued, and the V rows of a split's
    last tile past its keys zeroed."""
    DL, DV, dtype, tk, L, LAY = sh.latent, sh.dv, sh.dtype, sh.tk, sh.smem, sh.lay
    NKS, QLAY = DL // 16, Sw128Layout(DL, ROWS)

    @T.macro
    def score(smem, s, sacc):
        """Issue S of stage ``s`` (all ``DL`` dims, both operands in shared memory)."""
        T.evaluate(wg_fence())
        for ks in T.unroll(NKS):
            T.evaluate(wgmma_ss(dtype, tk, 0, T.address_of(sacc[0]), T.address_of(smem[0]),
                                (*QLAY.k_major(ks), QLAY.swizzle), T.address_of(smem[L.stage(s)]),
                                (*LAY.k_major(ks), LAY.swizzle), accumulate=ks > 0))
        T.evaluate(wg_commit())

    @T.macro
    def zero_tail(smem, s, kbase, kend, t):
        """The score warpgroup (thread ``t`` of 128): V rows of stage ``s`` at or past ``kend`` zeroed, visible to
        both warpgroups' P V (its own through ``BAR_TAIL``, the other's through ``BAR_P``)."""
        for it in T.unroll(tk * DV // 8 // 128):
            if kbase + T.truncdiv(it * 128 + t, DV // 8) >= kend:
                T.evaluate(st_shared_zero16(T.address_of(smem[L.stage(s) + LAY.index(
                    T.truncdiv(it * 128 + t, DV // 8), T.truncmod(it * 128 + t, DV // 8) * 8)])))
        T.evaluate(proxy_fence())
        T.evaluate(bar_sync(BAR_TAIL, 128))

    return score, zero_tail


def make_handoff(sh: WgqShape):
    """What the score warpgroup hands the value warpgroup through shared memory: ``(publish, hand_out,
    take_over)``, a tile's P and factors, and at the end the rows' max and sums (the value warpgroup stores the
    lse)."""
    tk, L, PLAY = sh.tk, sh.smem, CoreLayout(sh.tk)
    GROUPS = tk // 8

    @T.macro
    def publish(smem, pf, al, wl, lane):
        """P (this warp's 16 rows) and the rows' factors into shared memory for the value warpgroup."""
        for rr in T.unroll(2):
            for nt in T.unroll(GROUPS):
                T.evaluate(st_shared_b32(
                    T.address_of(smem[L.p + PLAY.index(wl * 16 + rr * 8 + T.truncdiv(lane, 4),
                                                       nt * 8 + T.truncmod(lane, 4) * 2)]),
                    T.address_of(pf[nt * 4 + rr * 2])))
            if T.truncmod(lane, 4) == 0:
                T.evaluate(st_shared_f32(T.address_of(smem[L.alpha + (wl * 16 + rr * 8 + T.truncdiv(lane, 4)) * 2]),
                                         al[rr]))
        T.evaluate(proxy_fence())

    @T.macro
    def hand_out(smem, m, lsum, t):
        """The score warpgroup: the rows' max and partial sums into P's buffer (free once the last P V is done)."""
        for rr in T.unroll(2):
            T.evaluate(st_shared_f32(T.address_of(smem[L.p + ((rr * 2) * 128 + t) * 2]), m[rr]))
            T.evaluate(st_shared_f32(T.address_of(smem[L.p + ((rr * 2 + 1) * 128 + t) * 2]), lsum[rr]))

    @T.macro
    def take_over(smem, m, lsum, t):
        """The value warpgroup: ``hand_out``'s values of the score warpgroup's thread ``t`` (the same rows)."""
        for rr in T.unroll(2):
            m[rr] = ld_shared_f32(T.address_of(smem[L.p + ((rr * 2) * 128 + t) * 2]))
            lsum[rr] = ld_shared_f32(T.address_of(smem[L.p + ((rr * 2 + 1) * 128 + t) * 2]))

    return publish, hand_out, take_over


def make_accumulate(sh: WgqShape):
    """The value warpgroup's accumulate stage (and the score warpgroup's rescale): ``(rescale, pv_smem)``."""
    dtype, tk, DVH, NDN, L, LAY = sh.dtype, sh.tk, sh.dvh, sh.ndn, sh.smem, sh.lay
    PLAY = CoreLayout(tk)

    @T.macro
    def rescale(oacc, al):
        for rr in T.unroll(2):
            if al[rr] < T.float32(1):
                for dn in T.unroll(NDN):
                    for c in T.unroll(2):
                        oacc[dn * 4 + rr * 2 + c] = oacc[dn * 4 + rr * 2 + c] * al[rr]

    @T.macro
    def pv_smem(smem, s, oacc):
        """The value warpgroup's O[:, .. DV/2] += P V, P from shared memory; complete on return."""
        T.evaluate(acc_fence(DVH, T.address_of(oacc[0])))
        T.evaluate(wg_fence())
        for kk in T.unroll(tk // 16):
            T.evaluate(wgmma_ss(dtype, DVH, 1, T.address_of(oacc[0]), T.address_of(smem[L.p]),
                                (*PLAY.k_major(kk), PLAY.swizzle), T.address_of(smem[L.stage(s)]),
                                (*LAY.mn_major(kk), LAY.swizzle)))
        T.evaluate(wg_commit())
        T.evaluate(wg_wait0())
        T.evaluate(acc_fence(DVH, T.address_of(oacc[0])))

    return rescale, pv_smem


class WgqTileOps(NamedTuple):
    """``make_tile_ops``' layout and stages by name."""

    L: _Smem
    wgg: object
    full: object
    empty: object
    look_up: object
    issue: object
    load_q: object
    score: object
    zero_tail: object
    publish: object
    rescale: object
    pv_smem: object
    hand_out: object
    take_over: object


def make_tile_ops(sh: WgqShape) -> WgqTileOps:
    """The stages of both roles of block shape ``sh``."""
    L = sh.smem
    (look_up, issue), (score, zero_tail) = make_issue(sh), make_score(sh)
    (publish, hand_out, take_over), (rescale, pv_smem) = make_handoff(sh), make_accumulate(sh)
    return WgqTileOps(L, sh.gemms(), L.full, L.empty, look_up, issue, make_load_q(sh), score, zero_tail, publish,
                      rescale, pv_smem, hand_out, take_over)


def make_score_role(sh: WgqShape):
    """``score_role(smem, oacc, m, lsum, k0, k1, sm_scale, w, lane, t)``: warpgroup 1's loop over the split's tiles
    (S, softmax, P handed out, its O half += P V) and its rows' max and sums handed to warpgroup 0 at the end."""
    ops, softmax, dtype, tk = make_tile_ops(sh), make_softmax(sh), sh.dtype, sh.tk
    L, wgg = ops.L, ops.wgg
    SN, NS, DVH = tk // 2, L.ns, sh.dvh

    @T.macro
    def score_role(smem, oacc, m, lsum, k0, k1, sm_scale, w, lane, t):
        sacc = T.alloc_buffer((SN,), "float32", scope="local")
        pf = T.alloc_buffer((SN,), dtype, scope="local")
        al = T.alloc_buffer((2,), "float32", scope="local")
        st = T.alloc_buffer((5,), "float32", scope="local")
        nt: T.let[T.int32] = T.truncdiv(k1 - k0 + tk - 1, tk)
        for kt in T.serial(nt):
            if kt > 0:
                # P V of tile kt - 1 done: its stage is free of this warpgroup. Before the wait for tile kt, so
                # that tile kt + 1 loads while tile kt does (released after S(kt) was issued, the ring held
                # one tile in flight: BAR 25 probe).
                T.evaluate(wg_wait0())
                wgg.pv_done(oacc, pf)
                if lane == 0:
                    T.evaluate(mbar_arrive(ops.empty(smem, T.truncmod(kt - 1, NS))))
            T.evaluate(mbar_wait(ops.full(smem, T.truncmod(kt, NS)), T.truncmod(T.truncdiv(kt, NS), 2)))
            ops.score(smem, T.truncmod(kt, NS), sacc)
            T.evaluate(wg_wait0())
            T.evaluate(acc_fence(tk, T.address_of(sacc[0])))
            if k0 + (kt + 1) * tk > k1:
                ops.zero_tail(smem, T.truncmod(kt, NS), k0 + kt * tk, k1, t)
            softmax(sacc, pf, m, lsum, al, st, k0 + kt * tk, k1, sm_scale * T.float32(LOG2E), lane)
            if kt > 0:
                T.evaluate(bar_sync(BAR_PFREE, NT))  # the value warpgroup's P V of tile kt - 1 done with P
            ops.publish(smem, pf, al, T.truncmod(w, 4), lane)
            T.evaluate(bar_arrive(BAR_P, NT))
            ops.rescale(oacc, al)
            wgg.pv_issue(oacc, pf, smem, L.stage(T.truncmod(kt, NS)) + (DVH // 64) * tk * 64)
        # Unconditional (nothing in flight without tiles): ptxas then sees every path complete the last P V before
        # O is read, and keeps the wgmma's asynchronous (else C7517 / C7515: a wait injected, wgmma's serialized).
        T.evaluate(wg_wait0())
        wgg.pv_done(oacc, pf)
        if nt > 0:
            if lane == 0:
                T.evaluate(mbar_arrive(ops.empty(smem, T.truncmod(nt - 1, NS))))
            T.evaluate(bar_sync(BAR_PFREE, NT))
        ops.hand_out(smem, m, lsum, t)
        T.evaluate(bar_arrive(BAR_FIN, NT))

    return score_role


def make_value_role(sh: WgqShape):
    """``value_role(smem, oacc, m, lsum, pmap, page_values, pbase, ps, k0, k1, w, lane, t)``: warpgroup 0's loop
    (the ring's boxes issued by its warps' lane 0, its O half rescaled and += P V with P from shared memory), and
    the rows' max and sums taken over at the end."""
    ops, tk = make_tile_ops(sh), sh.tk
    L = ops.L
    NS = L.ns

    @T.macro
    def value_role(smem, oacc, m, lsum, pmap, page_values, pbase, ps, k0, k1, w, lane, t):
        al = T.alloc_buffer((2,), "float32", scope="local")
        pg = T.alloc_buffer((2,), "int32", scope="local")
        nt: T.let[T.int32] = T.truncdiv(k1 - k0 + tk - 1, tk)
        if lane == 0:
            ops.look_up(pg, page_values, pbase, ps, k0, k1, w, box_rows(ps, tk))
            for s in T.unroll(NS):
                if k0 + s * tk < k1:
                    ops.issue(smem, s, pmap, page_values, pbase, ps, k0 + s * tk, k1, pg, w)
        for kt in T.serial(nt):
            if kt > 0 and lane == 0 and k0 + (kt + NS - 1) * tk < k1:
                T.evaluate(mbar_wait(ops.empty(smem, T.truncmod(kt - 1, NS)), T.truncmod(T.truncdiv(kt - 1, NS), 2)))
                ops.issue(smem, T.truncmod(kt - 1, NS), pmap, page_values, pbase, ps, k0 + (kt + NS - 1) * tk, k1, pg,
                          w)
            T.evaluate(bar_sync(BAR_P, NT))
            T.evaluate(mbar_wait(ops.full(smem, T.truncmod(kt, NS)), T.truncmod(T.truncdiv(kt, NS), 2)))
            for rr in T.unroll(2):
                al[rr] = ld_shared_f32(T.address_of(smem[L.alpha + (w * 16 + rr * 8 + T.truncdiv(lane, 4)) * 2]))
            ops.rescale(oacc, al)
            ops.pv_smem(smem, T.truncmod(kt, NS), oacc)
            T.evaluate(bar_arrive(BAR_PFREE, NT))
            if lane == 0:
                T.evaluate(mbar_arrive(ops.empty(smem, T.truncmod(kt, NS))))
        T.evaluate(bar_sync(BAR_FIN, NT))
        ops.take_over(smem, m, lsum, t)

    return value_role


def make_block(sh: WgqShape):
    """The per-thread block macro of ``make_split_frame`` (``pages`` = (pool, its tensor map)): Q, the mbarriers,
    the two roles and the store (``mla_cuda_wg.make_store``)."""
    H, DV, dtype, L, load_q = sh.heads, sh.dv, sh.dtype, sh.smem, make_load_q(sh)
    score_role, value_role = make_score_role(sh), make_value_role(sh)
    store, init = wgk.make_store(H, DV, dtype), wgk.make_init(DV // 4)
    ON, NS = DV // 4, L.ns

    @T.macro
    def block(q, pages, page_values, o, lse, ws, sm_scale, ps, at, n, keys):
        bx, g, sp, tid = at
        B, S = n
        k0, k1, pbase = keys
        smem_all = T.alloc_buffer((L.total,), dtype, scope="shared.dyn")
        keep_extent(smem_all, L.total)
        # Q and the ring from the first 1024-byte boundary (the swizzle's period; the allocation has the slack).
        smem = T.decl_buffer((L.total,), dtype, data=smem_all.data,
                             elem_offset=sw128_pad(T.address_of(smem_all[0]), 2), scope="shared.dyn")
        oacc = T.alloc_buffer((ON,), "float32", scope="local")
        m = T.alloc_buffer((2,), "float32", scope="local")
        lsum = T.alloc_buffer((2,), "float32", scope="local")
        wg: T.let[T.int32] = warp_uniform(T.truncdiv(tid, 128))
        w: T.let[T.int32] = T.truncdiv(tid, 32)
        lane: T.let[T.int32] = T.truncmod(tid, 32)
        init(oacc, m, lsum)
        if tid == 0:
            for s in T.unroll(NS):
                T.evaluate(mbar_init(L.full(smem, s), 1))
                T.evaluate(mbar_init(L.empty(smem, s), 8))
        load_q(smem, q, T.min(bx, T.max(B - 1, 0)), g * ROWS, H, tid)
        T.evaluate(proxy_fence())  # Q's stores visible to the S wgmma's
        T.tvm_storage_sync("shared")  # and the mbarriers initialized before any box counts on one
        if wg == 1:
            score_role(smem, oacc, m, lsum, k0, k1, sm_scale, w, lane, T.truncmod(tid, 128))
        else:
            value_role(smem, oacc, m, lsum, pages[1], page_values, pbase, ps, k0, k1, w, lane, T.truncmod(tid, 128))
        store(oacc, m, lsum, o, lse, ws[0], ws[1], bx, bx < B, g * ROWS, S, sp, wg, w, lane)

    return block


def mla_attn_paged_wgq(spec, op: str = MLA_ATTN_DECODE_PAGED):
    """``pagedkv_mla_attn_decode_paged`` or ``pagedkv_mla_attn_prefill_paged`` (``_mla_frame_cuda``'s grids) on
    warpgroup tensor cores, Q in shared memory, a score and a value warpgroup (arguments: ``pagedkv.ops.OP_SPECS``),
    for a ``KernelSpec`` that ``wgq_unserved`` accepts (module docstring); the host code runs ``mla_cuda_wg``'s kernel
    where TMA cannot read the pool."""
    reasons = wgq_unserved(spec)
    if reasons:
        raise NotImplementedError(f"pagedkv.tir_kernels: {SWITCHES[op]}={VALUE}: the Q-in-shared-memory wgmma CUDA MLA "
                                  f"kernel does not serve {'; '.join(reasons)}")
    H, DV, DL, dtype = spec.num_qo_heads, spec.kv_lora_rank, spec.latent_dim, spec.dtype
    frame = make_frame(op, spec, make_block(WgqShape(H, DL, DV, dtype, TK)), groups=(H + ROWS - 1) // ROWS, threads=NT,
                       tk=TK, splits=decode_splits(spec))
    body = wgk.make_tma_body(spec, frame, lambda ps: LatentPageMap(DL, box_rows(ps)), op)
    return mla_prim_func(op, spec, body, any_align=("pages",))


__all__ = ["NT", "ROWS", "SWITCH", "TK", "VALUE", "box_rows", "mla_attn_paged_wgq",
           "smem_bytes", "stages", "wgq_unserved"]
#: The kernel's stages, each importable: factories of its block shape (and their named tuple).
__all__ += ["WgqShape", "WgqTileOps", "make_accumulate", "make_block", "make_handoff", "make_issue", "make_load_q",
            "make_score", "make_score_role", "make_softmax", "make_tile_ops", "make_value_role"]
