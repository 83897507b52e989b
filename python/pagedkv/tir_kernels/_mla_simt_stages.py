"""The stages of the SIMT MLA row tile (``mla_cuda.py``, whose docstring has the design), one ``@T.macro`` factory
each, all of them taking the tile's compile-time layout (``RowTilePlan``).

A block of ``NT = 8 x 16`` threads computes ``R = 8 * RI`` rows of one entry over one key range
(``make_row_tile``). A key tile is ``NS = NKC + NVC`` statically unrolled *steps* (``make_step``), software
pipelined through two chunk buffers:

``load_step``      the 64 latent dims of the next step's ``TK`` rows, global memory into registers;
``store_step``     the registers into a chunk buffer (float32; zeros for keys and dims past the end);
``score_chunk``    partial q.k over 64 dims (a key chunk);
``online_softmax`` after the last key chunk: mask, running max and sum, O rescaled, P published to shared memory;
``value_chunk``    O += P @ V over 64 value dims (a value chunk);
``write_rows``     the rows' o / lse, or a key split's partial state (the empty-row state, ``o = 0`` and
                   ``lse = -1e30``, for a row that saw no key).

The block-uniform scalars of the tile live in shared memory (``blk``, slots ``B_*``, ``publish_block``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from ._common import EMPTY_LSE, LOG2E, MASKED
from ._common_cuda import ceildiv, shfl_xor, vec16
from ._epilogue_cuda import row_lse, row_scale

#: Threads per attention block: TY row groups x TX lanes (a half warp per row group).
TY, TX = 8, 16
NT = TY * TX
#: Keys per key tile (one per lane of a row group).
TK = TX
#: Latent dims per pipeline step, and the row stride of a chunk buffer (float4-aligned, bank-spread).
DC = 64
CS = DC + 4
#: Slots of the block-uniform scalars kept in shared memory by the attention row tile.
B_TOKB, B_ROW0, B_NROWS, B_K0, B_K1, B_SHIFT, B_KEND, B_NTILES, B_PBASE, B_SIZE = range(10)


@dataclass(frozen=True)
class RowTilePlan:
    """Compile-time layout of a row tile: ``h`` query heads, latents of ``dl`` elements whose first ``dv`` are
    the value, ``ri`` rows per thread (``mla_cuda.rows_per_thread``), storage ``dtype``."""

    h: int
    dl: int
    dv: int
    ri: int
    dtype: str

    @property
    def r(self) -> int:
        """Rows of the tile."""
        return TY * self.ri

    @property
    def vec(self) -> int:
        """Elements of a 16-byte vector (it divides ``dl`` and ``dv``, both multiples of 16)."""
        return vec16(self.dtype)

    @property
    def cpr(self) -> int:
        """16-byte vectors per chunk row."""
        return DC // self.vec

    @property
    def nu(self) -> int:
        """Vectors per thread per step."""
        return TK * self.cpr // NT

    @property
    def nkc(self) -> int:
        """Key (score) chunks of a key tile."""
        return ceildiv(self.dl, DC)

    @property
    def nvc(self) -> int:
        """Value chunks of a key tile."""
        return ceildiv(self.dv, DC)

    @property
    def ns(self) -> int:
        """Steps of a key tile."""
        return self.nkc + self.nvc

    @property
    def qs(self) -> int:
        """Row stride of ``Qs``: the latent rounded up to whole chunks, +4 to spread the rows over the banks."""
        return self.nkc * DC + 4

    @property
    def cq(self) -> int:
        """16-byte vectors of a ``Qs`` row (zero past ``dl``)."""
        return self.nkc * DC // self.vec


def make_load_step(p: RowTilePlan):
    """``load_step(Xr, Xok, kt, j, pages, page_values, pbase, ps, k0, kend, tid)``: registers ``Xr[u, :]`` = the
    ``VEC`` dims that thread ``tid`` stages for step ``j`` (static once unrolled) of key tile ``kt``: chunk ``j``
    of the keys (``j < NKC``) or chunk ``j - NKC`` of the values, of latent row ``jr`` (key ``k0 + kt*TK + jr``).

    ``Xok[u] = 0`` marks keys at or past ``kend`` and dims past the part, which ``store_step`` turns into zeros.
    Their load is clamped to the last visible key (valid memory, never past the entry; ``kend > k0`` whenever a
    step runs) instead of branched around (fewer divergent branches, fewer registers)."""
    VEC, CPR, NU, NKC, DL, DV = p.vec, p.cpr, p.nu, p.nkc, p.dl, p.dv

    @T.macro
    def load_step(Xr, Xok, kt, j, pages, page_values, pbase, ps, k0, kend, tid):
        for u in T.unroll(NU):
            key: T.let[T.int32] = k0 + kt * TK + T.truncdiv(u * NT + tid, CPR)
            d0: T.let[T.int32] = (T.if_then_else(j < NKC, j, j - NKC) * DC
                                  + T.truncmod(u * NT + tid, CPR) * VEC)
            Xok[u] = T.if_then_else(key < kend and d0 < T.if_then_else(j < NKC, DL, DV), 1, 0)
            for e in T.vectorized(VEC):
                Xr[u, e] = pages[page_values[pbase + T.truncdiv(T.min(key, kend - 1), ps)], 0, 0,
                                 T.truncmod(T.min(key, kend - 1), ps), T.min(d0, DL - VEC) + e]

    return load_step


def make_store_step(p: RowTilePlan):
    """``store_step(Cb, Xr, Xok, tid)``: ``Cb[j, :]`` (row-major, stride ``CS``) = the staged registers as
    float32, 0 where ``Xok`` is 0 (a select, so whatever the clamped load read never reaches the accumulation).

    fp16 is converted element by element first: a vectorized cast makes TVM's CUDA codegen bind
    ``half4 v_ = *(half4*)(Xr + 0)`` once and reuse it in a later step, after Xr was reloaded."""
    VEC, CPR, NU = p.vec, p.cpr, p.nu

    @T.macro
    def store_step(Cb, Xr, Xok, tid):
        Xf = T.alloc_buffer((VEC,), "float32", scope="local")
        for u in T.unroll(NU):
            for e in T.unroll(VEC):
                Xf[e] = T.if_then_else(Xok[u] != 0, T.Cast("float32", Xr[u, e]), T.float32(0))
            for h in T.unroll(VEC // 4):
                for e in T.vectorized(4):
                    Cb[T.truncdiv(u * NT + tid, CPR) * CS + T.truncmod(u * NT + tid, CPR) * VEC
                       + h * 4 + e] = Xf[h * 4 + e]

    return store_step


def make_load_q(p: RowTilePlan):
    """``load_q(Qs, q, tokb, row0, nrows, scale, tid)``: ``Qs[r, d] = q[token, head, d] * scale`` for the
    tile's rows (row ``r``: token ``tokb + (row0 + r) // H``, head ``(row0 + r) % H``); 0 for padding rows and
    dims."""
    H, DL, R, VEC, QS, CQ, dtype = p.h, p.dl, p.r, p.vec, p.qs, p.cq, p.dtype

    @T.macro
    def load_q(Qs, q, tokb, row0, nrows, scale, tid):
        xr = T.alloc_buffer((VEC,), dtype, scope="local")
        for it in T.serial(ceildiv(R * CQ, NT)):
            if it * NT + tid < R * CQ:
                r: T.let[T.int32] = T.truncmod(it * NT + tid, R)
                cc: T.let[T.int32] = T.truncdiv(it * NT + tid, R)
                if r < nrows and cc * VEC < DL:
                    for e in T.unroll(VEC):
                        xr[e] = q[tokb + T.truncdiv(row0 + r, H), T.truncmod(row0 + r, H), cc * VEC + e]
                    for e in T.unroll(VEC):
                        Qs[r * QS + cc * VEC + e] = T.Cast("float32", xr[e]) * scale
                else:
                    for e in T.unroll(VEC):
                        Qs[r * QS + cc * VEC + e] = T.float32(0)

    return load_q


def make_score_chunk(p: RowTilePlan):
    """``score_chunk(acc, Qs, Cb, c, ty, tx)``: ``acc[i] += q[row RI*ty + i] . k[key tx]`` over dims ``c*DC ..``
    (float4 shared reads)."""
    RI, QS = p.ri, p.qs

    @T.macro
    def score_chunk(acc, Qs, Cb, c, ty, tx):
        qv = T.alloc_buffer((4,), "float32", scope="local")
        kv = T.alloc_buffer((4,), "float32", scope="local")
        for d4 in T.serial(DC // 4):
            for e in T.vectorized(4):
                kv[e] = Cb[tx * CS + d4 * 4 + e]
            for i in T.unroll(RI):
                for e in T.vectorized(4):
                    qv[e] = Qs[(ty * RI + i) * QS + c * DC + d4 * 4 + e]
                for e in T.unroll(4):
                    acc[i] = acc[i] + qv[e] * kv[e]

    return score_chunk


def make_online_softmax(p: RowTilePlan):
    """``online_softmax(acc, m, lsum, Ol, Ps, blk, key, ty, tx)``: mask key ``key`` (this lane's) per row, update
    the row state, rescale O and publish the tile's probabilities: ``Ps[r, tx]`` = P of row ``r``, key ``tx``
    (read by the value chunks after the next barrier; shared memory instead of a register copy per lane keeps the
    register count down)."""
    H, RI, NVC = p.h, p.ri, p.nvc

    @T.macro
    def online_softmax(acc, m, lsum, Ol, Ps, blk, key, ty, tx):
        st = T.alloc_buffer((3,), "float32", scope="local")
        for i in T.unroll(RI):
            # Keys row r sees: [k0, min(k1, shift + token)) (bottom-right causal); none for padding rows.
            lim: T.let[T.int32] = T.if_then_else(
                ty * RI + i < blk[B_NROWS],
                T.min(blk[B_K1], blk[B_SHIFT] + T.truncdiv(blk[B_ROW0] + ty * RI + i, H)), 0)
            st[0] = T.if_then_else(key < lim, acc[i], T.float32(MASKED))
            st[1] = T.max(st[0], m[i])
            for sh in T.unroll(4):
                st[1] = T.max(st[1], shfl_xor(st[1], T.shift_right(8, sh)))
            # Same new max in all 16 lanes, so the per-lane partial sums stay consistently scaled.
            st[2] = T.exp2(m[i] - st[1])
            m[i] = st[1]
            st[0] = T.exp2(st[0] - st[1])
            lsum[i] = lsum[i] * st[2] + st[0]
            for c in T.unroll(NVC * 4):
                Ol[i, c] = Ol[i, c] * st[2]
            Ps[(ty * RI + i) * TK + tx] = st[0]

    return online_softmax


def make_value_chunk(p: RowTilePlan):
    """``value_chunk(Ol, Ps, Cb, vc, ty, tx)``: ``O[i, vc*DC + tx + 16 c4] += sum_k P[i, k] * V[k, ...]`` for
    one (static) value chunk; P is read 4 keys at a time (float4, the same address for the 16 lanes of a row
    group: a broadcast)."""
    RI = p.ri

    @T.macro
    def value_chunk(Ol, Ps, Cb, vc, ty, tx):
        vv = T.alloc_buffer((4,), "float32", scope="local")
        pv = T.alloc_buffer((RI, 4), "float32", scope="local")
        for k4 in T.unroll(TK // 4):
            for i in T.unroll(RI):
                for e in T.vectorized(4):
                    pv[i, e] = Ps[(ty * RI + i) * TK + k4 * 4 + e]
            for kk in T.unroll(4):
                for c4 in T.unroll(4):
                    vv[c4] = Cb[(k4 * 4 + kk) * CS + c4 * TX + tx]
                for i in T.unroll(RI):
                    for c4 in T.unroll(4):
                        Ol[i, vc * 4 + c4] = Ol[i, vc * 4 + c4] + pv[i, kk] * vv[c4]

    return value_chunk


def make_step(p: RowTilePlan):
    """``step(Cb, kt, j, ntiles, blk, Xr, Xok, acc, m, lsum, Ol, Ps, Qs, pages, page_values, ps, tid, ty, tx)``:
    step ``j`` (an unrolled index) of key tile ``kt``: stage the registers into ``Cb``, barrier, issue the loads
    of the next step (the next tile's first at ``j = NS - 1``), then compute step ``j`` from ``Cb``: a score
    chunk (and, after the last, the online softmax) or a value chunk."""
    RI, NKC, NS = p.ri, p.nkc, p.ns
    load_step, store_step = make_load_step(p), make_store_step(p)
    score_chunk, online_softmax, value_chunk = make_score_chunk(p), make_online_softmax(p), make_value_chunk(p)

    @T.macro
    def step(Cb, kt, j, ntiles, blk, Xr, Xok, acc, m, lsum, Ol, Ps, Qs, pages, page_values, ps, tid, ty, tx):
        store_step(Cb, Xr, Xok, tid)
        T.tvm_storage_sync("shared")
        # The next step's global loads are in flight while this step computes.
        if j + 1 < NS:
            load_step(Xr, Xok, kt, j + 1, pages, page_values, blk[B_PBASE], ps, blk[B_K0], blk[B_KEND], tid)
        elif kt + 1 < ntiles:
            load_step(Xr, Xok, kt + 1, 0, pages, page_values, blk[B_PBASE], ps, blk[B_K0], blk[B_KEND], tid)
        if j < NKC:
            if j == 0:
                for i in T.unroll(RI):
                    acc[i] = T.float32(0)
            score_chunk(acc, Qs, Cb, j, ty, tx)
            if j == NKC - 1:
                online_softmax(acc, m, lsum, Ol, Ps, blk, blk[B_K0] + kt * TK + tx, ty, tx)
        else:
            value_chunk(Ol, Ps, Cb, j - NKC, ty, tx)

    return step


def make_key_loop(p: RowTilePlan):
    """``key_loop(Cb0, Cb1, ntiles, blk, Xr, Xok, acc, m, lsum, Ol, Ps, Qs, pages, page_values, ps, tid, ty, tx)``:
    the tile's ``ntiles`` key tiles, each ``NS`` steps over the two chunk buffers (the first step's loads are
    issued before the loop)."""
    NS = p.ns
    step = make_step(p)

    @T.macro
    def key_loop(Cb0, Cb1, ntiles, blk, Xr, Xok, acc, m, lsum, Ol, Ps, Qs, pages, page_values, ps, tid, ty, tx):
        for kt in T.serial(ntiles):
            # Consecutive steps alternate the chunk buffers, so one barrier per step suffices: a buffer
            # written in step j was last read in step j - 2, which every thread finished before the
            # barrier of step j - 1.
            for jj in T.unroll(NS // 2):
                step(Cb0, kt, 2 * jj, ntiles, blk, Xr, Xok, acc, m, lsum, Ol, Ps, Qs, pages, page_values, ps,
                     tid, ty, tx)
                step(Cb1, kt, 2 * jj + 1, ntiles, blk, Xr, Xok, acc, m, lsum, Ol, Ps, Qs, pages, page_values,
                     ps, tid, ty, tx)
            if NS % 2 == 1:
                step(Cb0, kt, NS - 1, ntiles, blk, Xr, Xok, acc, m, lsum, Ol, Ps, Qs, pages, page_values, ps,
                     tid, ty, tx)
                # The next tile starts with Cb0 again: everyone must be done with this last step.
                T.tvm_storage_sync("shared")

    return key_loop


def make_publish_block(p: RowTilePlan):
    """``publish_block(blk, tokb, row0, nrows, k0, k1, kend, pbase, causal, qlen, kvlen, tid)``: thread 0 writes
    the tile's block-uniform scalars to ``blk`` (the caller's barrier publishes them).

    Every thread re-reads them after a barrier instead of holding them in registers across the key loop: with
    every thread writing, nvcc forwards its own store and keeps the values live (spills at 128 registers)."""

    @T.macro
    def publish_block(blk, tokb, row0, nrows, k0, k1, kend, pbase, causal, qlen, kvlen, tid):
        if tid == 0:
            blk[B_TOKB] = tokb
            blk[B_K1] = k1
            # Row r sees keys [k0, min(k1, shift + token)), token = (row0 + r) // H (bottom-right causal).
            blk[B_SHIFT] = T.if_then_else(causal != 0, kvlen - qlen + 1, 1 << 30)
            blk[B_ROW0] = row0
            blk[B_NROWS] = nrows
            blk[B_K0] = k0
            blk[B_KEND] = kend
            blk[B_NTILES] = T.truncdiv(T.max(kend - k0, 0) + TK - 1, TK)
            blk[B_PBASE] = pbase

    return publish_block


def make_write_rows(p: RowTilePlan):
    """``write_rows(o, lse, ws_o, ws_l, Ol, m, lsum, blk, S, sp, ty, tx)``: the row sums folded over the 16
    lanes, then the tile's rows stored: ``o`` / ``lse`` (``S == 1``) or the split's partial state in the
    workspace (row ``(token * H + head) * S + sp``); ``o = 0``, ``lse = -1e30`` for a row that saw no key."""
    H, DV, RI, NVC = p.h, p.dv, p.ri, p.nvc

    @T.macro
    def write_rows(o, lse, ws_o, ws_l, Ol, m, lsum, blk, S, sp, ty, tx):
        tokb: T.let[T.int32] = blk[B_TOKB]
        row0: T.let[T.int32] = blk[B_ROW0]
        nrows: T.let[T.int32] = blk[B_NROWS]
        for i in T.unroll(RI):
            for sh in T.unroll(4):
                lsum[i] = lsum[i] + shfl_xor(lsum[i], T.shift_right(8, sh))
        for i in T.unroll(RI):
            if ty * RI + i < nrows:
                tok: T.let[T.int32] = tokb + T.truncdiv(row0 + ty * RI + i, H)
                hd: T.let[T.int32] = T.truncmod(row0 + ty * RI + i, H)
                # lsum >= 1 once any key was seen (its max contributes 2^0); else 0: the empty-row state
                # through the two selects, so the stores below are the same for every row.
                rl: T.let[T.float32] = row_scale(lsum[i])
                ls: T.let[T.float32] = row_lse(m[i], lsum[i])
                # One branch per row (not per element); the dim guard folds once c is unrolled (DV % 16 == 0).
                if S == 1:
                    for c in T.unroll(NVC * 4):
                        if T.truncdiv(c, 4) * DC + T.truncmod(c, 4) * TX < DV:
                            o[tok, hd, T.truncdiv(c, 4) * DC + T.truncmod(c, 4) * TX + tx] = T.Cast(
                                o.dtype, Ol[i, c] * rl)
                    if tx == 0:
                        lse[tok, hd] = ls
                else:
                    for c in T.unroll(NVC * 4):
                        if T.truncdiv(c, 4) * DC + T.truncmod(c, 4) * TX < DV:
                            ws_o[(tok * H + hd) * S + sp, T.truncdiv(c, 4) * DC + T.truncmod(c, 4) * TX + tx] = \
                                Ol[i, c] * rl
                    if tx == 0:
                        ws_l[(tok * H + hd) * S + sp] = ls

    return write_rows


def make_row_tile(p: RowTilePlan):
    """``row_tile(q, o, lse, ws_o, ws_l, pages, page_values, pbase, ps, tokb, row0, nrows, qlen, kvlen, causal,
    k0, k1, S, sp, sm_scale, tid)``: rows ``row0 .. row0 + nrows`` of an entry (row ``r``: token
    ``tokb + r // H``, head ``r % H``) over its keys ``[k0, k1)``; ``nrows = 0`` idles (zero-trip loops, no
    memory access). No branch around a barrier depends on the thread."""
    H, R, RI, NU, NVC, QS, VEC, dtype = p.h, p.r, p.ri, p.nu, p.nvc, p.qs, p.vec, p.dtype
    load_q, load_step, key_loop = make_load_q(p), make_load_step(p), make_key_loop(p)
    publish_block, write_rows = make_publish_block(p), make_write_rows(p)

    @T.macro
    def row_tile(q, o, lse, ws_o, ws_l, pages, page_values, pbase, ps, tokb, row0, nrows, qlen, kvlen,
                 causal, k0, k1, S, sp, sm_scale, tid):
        Qs = T.alloc_buffer((R * QS,), "float32", scope="shared")
        Cb0 = T.alloc_buffer((TK * CS,), "float32", scope="shared")
        Cb1 = T.alloc_buffer((TK * CS,), "float32", scope="shared")
        Ps = T.alloc_buffer((R * TK,), "float32", scope="shared")
        blk = T.alloc_buffer((B_SIZE,), "int32", scope="shared")
        Xr = T.alloc_buffer((NU, VEC), dtype, scope="local")
        Xok = T.alloc_buffer((NU,), "int32", scope="local")
        acc = T.alloc_buffer((RI,), "float32", scope="local")
        m = T.alloc_buffer((RI,), "float32", scope="local")
        lsum = T.alloc_buffer((RI,), "float32", scope="local")
        Ol = T.alloc_buffer((RI, NVC * 4), "float32", scope="local")
        ty: T.let[T.int32] = T.truncdiv(tid, TX)
        tx: T.let[T.int32] = T.truncmod(tid, TX)
        for i in T.unroll(RI):
            m[i] = T.float32(EMPTY_LSE)
            lsum[i] = T.float32(0)
            for c in T.unroll(NVC * 4):
                Ol[i, c] = T.float32(0)
        # kend: the last key the tile's last row sees.
        kend: T.let[T.int32] = T.if_then_else(nrows > 0, T.min(k1, T.if_then_else(
            causal != 0, kvlen - qlen + T.truncdiv(row0 + nrows - 1, H) + 1, kvlen)), k0)
        publish_block(blk, tokb, row0, nrows, k0, k1, kend, pbase, causal, qlen, kvlen, tid)
        T.tvm_storage_sync("shared")
        ntiles: T.let[T.int32] = blk[B_NTILES]
        tokb_s: T.let[T.int32] = blk[B_TOKB]
        row0_s: T.let[T.int32] = blk[B_ROW0]
        nrows_s: T.let[T.int32] = blk[B_NROWS]
        load_q(Qs, q, tokb_s, row0_s, nrows_s, sm_scale * T.float32(LOG2E), tid)
        if ntiles > 0:
            load_step(Xr, Xok, 0, 0, pages, page_values, blk[B_PBASE], ps, blk[B_K0], blk[B_KEND], tid)
        key_loop(Cb0, Cb1, ntiles, blk, Xr, Xok, acc, m, lsum, Ol, Ps, Qs, pages, page_values, ps, tid, ty, tx)
        write_rows(o, lse, ws_o, ws_l, Ol, m, lsum, blk, S, sp, ty, tx)

    return row_tile
