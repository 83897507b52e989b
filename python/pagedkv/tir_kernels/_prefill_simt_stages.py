"""The stages of the SIMT (FP32 FMA) CUDA prefill kernel (``attention_cuda_prefill``), ragged and paged, with and
without inline RoPE, one ``@T.macro`` factory each, all of them taking the kernel's compile-time parameters
(``PrefillPlan``).

A block of ``PF_TY x PF_TX = 8 x 16`` threads computes one query tile of ``TQ`` tokens of one entry and one kv
head (``R = TQ * G`` rows: token x GQA head): thread (``ty``, ``tx``) owns rows ``RI*ty ..`` and, per key tile
of ``TK`` keys, keys ``KJ*tx ..`` for the scores and output dims ``tx + 16 c`` for P @ V. Per key tile, in
shared memory that K and V take turns in (``KV``):

``load_k``      the K tile, transposed (``Kt[d, j]``; rotated with inline RoPE);
``score``       the rows' scores against the thread's keys (log2 units: q is pre-scaled);
``softmax``     the online softmax of each row over its 16 lanes (mask and soft cap first; P in registers);
``load_v``      the V tile, row-major;
``accumulate``  O += P @ V, P taken from the lane that owns the key by shuffles.

Before the key loop: the block's entry (``_common_cuda.find_tile_entry``, a binary search over the virtual
tiles), ``rope_setup`` (the RoPE frequencies), ``load_q`` (the Q tile, pre-scaled, rotated with inline RoPE) and
``init_rows`` (the row state and mask bounds); after it, ``store`` (o and lse of each row, or the empty-row
state). ``make_prefill_kernel`` puts them together.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from ._common import EMPTY_LSE, LOG2E, no_keys
from ._common_cuda import (ceildiv, cos_approx, find_tile_entry, paged_kv_len, rope_angle, rope_divisor, shfl_xor,
                           sin_approx, vec16)
from ._rope_table import divisor_value
from ._variant_cuda import CudaVariant

#: Prefill block: 8 row groups x 16 lanes (128 threads).
PF_TY, PF_TX = 8, 16
PF_NT = PF_TY * PF_TX


@dataclass(frozen=True)
class PrefillPlan:
    """Compile-time parameters of a prefill kernel (``attention_cuda_prefill._prefill_plan`` picks the tile)."""

    #: kv heads, GQA group, qk and v head dims, storage dtype
    hkv: int
    g: int
    d: int
    dv: int
    dtype: str
    #: rows and keys per thread
    ri: int
    kj: int
    #: elements per global-memory chunk of a q / k row and of a v row
    vec: int
    vecv: int
    #: K/V source (pages, else ragged k / v), inline RoPE, mask and logits rules
    paged: bool
    rope: bool
    var: CudaVariant
    #: a RoPE variant's table (``KernelSpec.rope``, whole head in halves: ``rope_spec.cuda_inline_serves``) for
    #: the inline RoPE kernel; None: the kernels' own formula (code unchanged)
    rope_table: object = None

    @property
    def r(self) -> int:
        """Rows of the tile (``TQ * G`` of them hold a token's head)."""
        return PF_TY * self.ri

    @property
    def tk(self) -> int:
        """Keys per key tile."""
        return PF_TX * self.kj

    @property
    def tq(self) -> int:
        """Query tokens per tile."""
        return self.r // self.g

    @property
    def cd(self) -> int:
        """Output dims per thread."""
        return self.dv // PF_TX

    @property
    def kvsz(self) -> int:
        """Elements of the shared K / V tile."""
        return max(self.d * self.tk, self.tk * self.dv)


def _shfl_idx(value, lane):
    """``__shfl_sync(full, value, lane, 16)``: lane ``lane`` of the caller's 16-lane half warp."""
    return T.call_extern("float32", "__shfl_sync", T.uint32(0xFFFFFFFF), value, lane, PF_TX)


def _as_f32(p: PrefillPlan, x, partner, d, pos, rope_scale, invf):
    """Element ``d`` of a q / k row as float32 from storage-dtype ``x``; with inline RoPE rotated to position
    ``pos`` with its partner (dim ``d +- D/2``). One function for q and k, so that both rotate alike."""
    if not p.rope:
        return T.Cast("float32", x)
    half = p.d // 2
    angle = rope_angle(pos, rope_scale, invf[T.truncmod(d, half)])
    sign = T.if_then_else(d < half, T.float32(-1), T.float32(1))
    return T.Cast("float32", x) * cos_approx(angle) + sign * T.Cast("float32", partner) * sin_approx(angle)


def kv_len(p: PrefillPlan, kvb, b):
    """Keys of entry ``b`` (``kvb``: ``(pages, page_values, page_indptr, ps, last_page_len)`` or
    ``(k, v, kv_indptr)``)."""
    if p.paged:
        return paged_kv_len(kvb[2], kvb[4], b, kvb[3])
    return kvb[2][b + 1] - kvb[2][b]


def make_load_row_chunk(p: PrefillPlan):
    """``load_row_chunk(dst, base, kvb, c01, b, key, d0, h, nvec, v16)``: ``dst[base + e]`` (registers, storage
    dtype) = element ``d0 + e`` (``e < nvec``) of K (c01 = 0) or V (c01 = 1) of key ``key`` of entry ``b``, kv
    head ``h``; pages read ``v16`` elements (16 bytes at most) at a time."""
    paged = p.paged

    @T.macro
    def load_row_chunk(dst, base, kvb, c01, b, key, d0, h, nvec, v16):
        if paged:
            pages, page_values, page_indptr, ps = kvb[0], kvb[1], kvb[2], kvb[3]  # kvb[4]: last_page_len
            pg: T.let[T.int32] = page_values[page_indptr[b] + T.truncdiv(key, ps)]
            for u in T.unroll(nvec // v16):
                for e in T.vectorized(v16):
                    dst[base + u * v16 + e] = pages[pg, c01, h, T.truncmod(key, ps), d0 + u * v16 + e]
        else:
            k, v, kv_indptr = kvb
            if c01 == 0:
                for e in T.unroll(nvec):
                    dst[base + e] = k[kv_indptr[b] + key, h, d0 + e]
            else:
                for e in T.unroll(nvec):
                    dst[base + e] = v[kv_indptr[b] + key, h, d0 + e]

    return load_row_chunk


def make_rope_setup(p: PrefillPlan):
    """``rope_setup(invf, rope_theta, tid)`` (inline RoPE): ``invf[i]`` (shared) = the divisor of rotation pair
    ``i``, computed once a block, published by a barrier. With a variant's table (``p.rope_table``) the divisor is
    the table's ``1 / inv_freq[i]`` and ``rope_theta`` carries the set (``apply_rope``: 2 = LongRoPE's long one;
    the kernel's caller passes it, and ``rope_scale`` 1: the table holds the scale)."""
    HALF, D, TABLE = p.d // 2, p.d, p.rope_table

    @T.macro
    def rope_setup(invf, rope_theta, tid):
        for it in T.serial(ceildiv(HALF, PF_NT)):
            if it * PF_NT + tid < HALF:
                if TABLE is None:  # static
                    invf[it * PF_NT + tid] = rope_divisor(it * PF_NT + tid, rope_theta, D)
                else:
                    invf[it * PF_NT + tid] = divisor_value(TABLE, it * PF_NT + tid, rope_theta)
        T.tvm_storage_sync("shared")

    return rope_setup


def make_load_q(p: PrefillPlan):
    """``load_q(Qt, xr, invf, q, q_pos, tok0, ntok, h, rope_scale, sm_scale, tid)``: the Q tile, transposed:
    ``Qt[d, r] = rope(q[token, head])[d] * sm_scale * log2(e)`` (row ``r``: token ``tok0 + r // G``, head
    ``h * G + r % G``); 0 past the tile's ``ntok`` tokens."""
    D, G, R, TQ, VEC, ROPE = p.d, p.g, p.r, p.tq, p.vec, p.rope
    CQ, HALF = p.d // p.vec, p.d // 2

    @T.macro
    def load_q(Qt, xr, invf, q, q_pos, tok0, ntok, h, rope_scale, sm_scale, tid):
        for it in T.serial(ceildiv(R * CQ, PF_NT)):
            if it * PF_NT + tid < R * CQ:
                r: T.let[T.int32] = T.truncmod(it * PF_NT + tid, R)
                c: T.let[T.int32] = T.truncdiv(it * PF_NT + tid, R)
                if r < TQ * G and T.truncdiv(r, G) < ntok:
                    for e in T.unroll(VEC):
                        xr[e] = q[tok0 + T.truncdiv(r, G), h * G + T.truncmod(r, G), c * VEC + e]
                    if ROPE:  # the partner elements (dims d +- D/2)
                        for e in T.unroll(VEC):
                            xr[VEC + e] = q[tok0 + T.truncdiv(r, G), h * G + T.truncmod(r, G),
                                            T.truncmod(c * VEC + HALF + e, D)]
                    for e in T.unroll(VEC):
                        Qt[c * VEC + e, r] = _as_f32(p, xr[e], xr[VEC + e], c * VEC + e,
                                                     q_pos[tok0 + T.truncdiv(r, G)], rope_scale, invf) * (
                            sm_scale * T.float32(LOG2E))
                else:
                    for e in T.unroll(VEC):
                        Qt[c * VEC + e, r] = T.float32(0)

    return load_q


def make_init_rows(p: PrefillPlan):
    """``init_rows(lim, m, lsum, Ol, ty, ntok, kvlen, qlen, qt0, kv_end, causal)``: the empty row state, and
    ``lim`` = the thread's row bounds (``CudaVariant.row_bound``: without a window the keys a row sees,
    bottom-right causal, 0 for padding rows); with a window ``lim[RI]`` = the first key tile."""
    G, RI, TQ, TK, CD, var = p.g, p.ri, p.tq, p.tk, p.cd, p.var
    WIN = var.has_window  # a bool: TVMScript evaluates ``if WIN:`` at parse time

    @T.macro
    def init_rows(lim, m, lsum, Ol, ty, ntok, kvlen, qlen, qt0, kv_end, causal):
        for i in T.unroll(RI):
            lim[i] = var.row_bound(ty * RI + i < TQ * G and T.truncdiv(ty * RI + i, G) < ntok, kvlen,
                                   qlen, qt0, T.truncdiv(ty * RI + i, G), causal)
            m[i] = T.float32(EMPTY_LSE)
            lsum[i] = T.float32(0)
            for c in T.unroll(CD):
                Ol[i, c] = T.float32(0)
        if WIN:
            # Skip the tiles below every row's window. In a register: as a let, TVM would
            # inline the expression into every key index of the loop.
            lim[RI] = var.first_tile(kvlen, qlen, qt0, kv_end, TK)

    return init_rows


def make_load_k(p: PrefillPlan):
    """``load_k(KV, xr, invf, kvb, b, h, kt, kv_end, k_pos_offset, rope_scale, tid)``: key tile ``kt``
    transposed into ``KV``: ``Kt[d, j] = KV[d * TK + j]`` (a thread per key and chunk; rotated to the key's
    position with inline RoPE); 0 for keys at or past ``kv_end``."""
    D, TK, VEC, ROPE = p.d, p.tk, p.vec, p.rope
    CQ, HALF, V16 = p.d // p.vec, p.d // 2, min(p.vec, vec16(p.dtype))
    load_row_chunk = make_load_row_chunk(p)

    @T.macro
    def load_k(KV, xr, invf, kvb, b, h, kt, kv_end, k_pos_offset, rope_scale, tid):
        for it in T.serial(ceildiv(TK * CQ, PF_NT)):
            if it * PF_NT + tid < TK * CQ:
                j: T.let[T.int32] = T.truncmod(it * PF_NT + tid, TK)
                c: T.let[T.int32] = T.truncdiv(it * PF_NT + tid, TK)
                if kt * TK + j < kv_end:
                    load_row_chunk(xr, 0, kvb, 0, b, kt * TK + j, c * VEC, h, VEC, V16)
                    if ROPE:  # the partner elements (dims d +- D/2)
                        load_row_chunk(xr, VEC, kvb, 0, b, kt * TK + j, T.truncmod(c * VEC + HALF, D), h, VEC, V16)
                    for e in T.unroll(VEC):
                        KV[(c * VEC + e) * TK + j] = _as_f32(p, xr[e], xr[VEC + e], c * VEC + e,
                                                             k_pos_offset[b] + kt * TK + j, rope_scale, invf)
                else:
                    for e in T.unroll(VEC):
                        KV[(c * VEC + e) * TK + j] = T.float32(0)

    return load_k


def make_load_v(p: PrefillPlan):
    """``load_v(KV, vr, kvb, b, h, kt, kv_end, tid)``: value tile ``kt`` into ``KV``, row-major:
    ``Vs[j, d] = KV[j * DV + d]``; 0 for keys at or past ``kv_end``."""
    DV, TK, VECV = p.dv, p.tk, p.vecv
    CV, V16V = p.dv // p.vecv, min(p.vecv, vec16(p.dtype))
    load_row_chunk = make_load_row_chunk(p)

    @T.macro
    def load_v(KV, vr, kvb, b, h, kt, kv_end, tid):
        for it in T.serial(ceildiv(TK * CV, PF_NT)):
            if it * PF_NT + tid < TK * CV:
                j: T.let[T.int32] = T.truncdiv(it * PF_NT + tid, CV)
                c: T.let[T.int32] = T.truncmod(it * PF_NT + tid, CV)
                if kt * TK + j < kv_end:
                    load_row_chunk(vr, 0, kvb, 1, b, kt * TK + j, c * VECV, h, VECV, V16V)
                    for e in T.unroll(VECV):
                        KV[j * DV + c * VECV + e] = T.Cast("float32", vr[e])
                else:
                    for e in T.unroll(VECV):
                        KV[j * DV + c * VECV + e] = T.float32(0)

    return load_v


def make_score(p: PrefillPlan):
    """``score(acc, qv, kv, Qt, KV, ty, tx)``: ``acc[i, kk]`` = row ``RI*ty + i`` . key ``KJ*tx + kk`` (log2
    units: q is pre-scaled), from the transposed Q and K tiles (vector reads of ``RI`` rows, ``KJ`` keys)."""
    D, RI, KJ, TK = p.d, p.ri, p.kj, p.tk

    @T.macro
    def score(acc, qv, kv, Qt, KV, ty, tx):
        for i in T.unroll(RI):
            for kk in T.unroll(KJ):
                acc[i, kk] = T.float32(0)
        for d4 in T.serial(D // 4):
            for dd in T.unroll(4):
                for i in T.vectorized(RI):
                    qv[i] = Qt[d4 * 4 + dd, ty * RI + i]
                for kk in T.vectorized(KJ):
                    kv[kk] = KV[(d4 * 4 + dd) * TK + tx * KJ + kk]
                for i in T.unroll(RI):
                    for kk in T.unroll(KJ):
                        acc[i, kk] = acc[i, kk] + qv[i] * kv[kk]

    return score


def make_softmax(p: PrefillPlan):
    """``softmax(acc, m, lsum, Ol, st, lim, kt, kvlen, causal, tx)``: the online softmax step of each row (max
    over the 16 lanes of the row): keys the row does not see masked (``CudaVariant.visible``; the soft cap, when
    on, applies before the mask, as in the reference), ``m`` / ``lsum`` updated, ``Ol`` rescaled; ``acc``
    becomes P."""
    RI, KJ, TK, CD, var = p.ri, p.kj, p.tk, p.cd, p.var

    @T.macro
    def softmax(acc, m, lsum, Ol, st, lim, kt, kvlen, causal, tx):
        for i in T.unroll(RI):
            st[0] = m[i]
            for kk in T.unroll(KJ):
                acc[i, kk] = var.logits(acc[i, kk],
                                        var.visible(kt * TK + tx * KJ + kk, lim[i], kvlen, causal))
                st[0] = T.max(st[0], acc[i, kk])
            for sh in T.unroll(4):
                st[0] = T.max(st[0], shfl_xor(st[0], T.shift_right(8, sh)))
            st[1] = T.exp2(m[i] - st[0])
            m[i] = st[0]
            lsum[i] = lsum[i] * st[1]
            for c in T.unroll(CD):
                Ol[i, c] = Ol[i, c] * st[1]
            for kk in T.unroll(KJ):
                acc[i, kk] = T.exp2(acc[i, kk] - st[0])
                lsum[i] = lsum[i] + acc[i, kk]

    return softmax


def make_accumulate(p: PrefillPlan):
    """``accumulate(Ol, pv, vv, acc, KV, tx)``: ``O[rows, tx + 16 c] += P @ V``; P[row, key] comes from the lane
    that owns the key (a shuffle per key and row), V from the row-major tile."""
    RI, KJ, CD, DV = p.ri, p.kj, p.cd, p.dv

    @T.macro
    def accumulate(Ol, pv, vv, acc, KV, tx):
        for sl in T.unroll(PF_TX):
            for kk in T.unroll(KJ):
                for i in T.unroll(RI):
                    pv[i] = _shfl_idx(acc[i, kk], sl)
                for c in T.unroll(CD):
                    vv[c] = KV[(sl * KJ + kk) * DV + c * PF_TX + tx]
                for i in T.unroll(RI):
                    for c in T.unroll(CD):
                        Ol[i, c] = Ol[i, c] + pv[i] * vv[c]

    return accumulate


def make_store(p: PrefillPlan):
    """``store(o, lse, Ol, m, lsum, tok0, ntok, h, ty, tx)``: the row sums folded over the 16 lanes, then each
    of the thread's rows written: ``o = O / lsum`` and ``lse = m + log2(lsum)``, or for a row that saw no key
    the empty-row state, ``o = 0`` and ``lse = -1e30``."""
    G, RI, TQ, CD = p.g, p.ri, p.tq, p.cd

    @T.macro
    def put_row(o, lse, Ol, m, lsum, i, tok, hd, tx, empty):
        # ``empty`` is a Python bool: one row store, the empty-row state chosen at parse time.
        for c in T.unroll(CD):
            if empty:
                o[tok, hd, c * PF_TX + tx] = T.Cast(o.dtype, T.float32(0))
            else:
                o[tok, hd, c * PF_TX + tx] = T.Cast(o.dtype, Ol[i, c] / lsum[i])
        if tx == 0:
            if empty:
                lse[tok, hd] = T.float32(EMPTY_LSE)
            else:
                lse[tok, hd] = m[i] + T.log2(lsum[i])

    @T.macro
    def store(o, lse, Ol, m, lsum, tok0, ntok, h, ty, tx):
        # Row sums: each lane summed its own keys (same running max in every lane).
        for i in T.unroll(RI):
            for sh in T.unroll(4):
                lsum[i] = lsum[i] + shfl_xor(lsum[i], T.shift_right(8, sh))
        for i in T.unroll(RI):
            if ty * RI + i < TQ * G and T.truncdiv(ty * RI + i, G) < ntok:
                if no_keys(lsum[i]):
                    put_row(o, lse, Ol, m, lsum, i, tok0 + T.truncdiv(ty * RI + i, G),
                            h * G + T.truncmod(ty * RI + i, G), tx, True)
                else:
                    put_row(o, lse, Ol, m, lsum, i, tok0 + T.truncdiv(ty * RI + i, G),
                            h * G + T.truncmod(ty * RI + i, G), tx, False)

    return store


def make_tile(p: PrefillPlan):
    """``tile(bufs, vt, h, tid, q, q_indptr, q_pos, k_pos_offset, o, lse, kvb, B, causal, rope_scale, rope_theta,
    sm_scale)``: virtual tile ``vt`` of kv head ``h`` with the block's buffers ``bufs`` (``make_prefill_kernel``):
    the entry and query tile it owns, then the stages in order (module docstring).

    No branch around the barriers: an idle block (past its entry's queries, or B == 0) runs the same code with
    zero-trip loops and masked memory accesses."""
    TQ, TK, RI, ROPE, WIN = p.tq, p.tk, p.ri, p.rope, p.var.has_window
    rope_setup, load_q, init_rows = make_rope_setup(p), make_load_q(p), make_init_rows(p)
    load_k, score, softmax, load_v = make_load_k(p), make_score(p), make_softmax(p), make_load_v(p)
    accumulate, store = make_accumulate(p), make_store(p)

    def tiles_before(q_indptr, b):
        """Virtual tiles of the entries before ``b`` but their spare ones (``find_tile_entry``)."""
        return T.truncdiv(q_indptr[b], TQ)

    @T.macro
    def tile(bufs, vt, h, tid, q, q_indptr, q_pos, k_pos_offset, o, lse, kvb, B, causal, rope_scale, rope_theta,
             sm_scale):
        Qt, KV, invf, srch, xr, vr, qv, kv, pv, vv, acc, Ol, m, lsum, lim, st = bufs  # names only: no TIR
        tx: T.let[T.int32] = T.truncmod(tid, PF_TX)
        ty: T.let[T.int32] = T.truncdiv(tid, PF_TX)
        # Entry b: the last one whose first virtual tile q_indptr[b] // TQ + b is <= vt.
        find_tile_entry(srch, q_indptr, B, vt, tiles_before)
        b: T.let[T.int32] = srch[0]
        qlen: T.let[T.int32] = T.if_then_else(B > 0, q_indptr[T.min(b + 1, B)] - q_indptr[b], 0)
        tin: T.let[T.int32] = vt - (tiles_before(q_indptr, b) + b)
        active: T.let[T.bool] = tin >= 0 and tin < T.truncdiv(qlen + TQ - 1, TQ)
        # Last query tile first (it sees the most keys under causal).
        qt0: T.let[T.int32] = (T.truncdiv(qlen + TQ - 1, TQ) - 1 - tin) * TQ
        ntok: T.let[T.int32] = T.if_then_else(active, T.min(TQ, qlen - qt0), 0)
        tok0: T.let[T.int32] = q_indptr[b] + qt0
        kvlen: T.let[T.int32] = T.if_then_else(active, kv_len(p, kvb, b), 0)
        # Keys any row of the tile sees (causal: the last token's limit).
        kv_end: T.let[T.int32] = T.if_then_else(
            causal > 0, T.max(T.min(kvlen, kvlen - qlen + qt0 + ntok), 0), kvlen)
        if ROPE:
            rope_setup(invf, rope_theta, tid)
        load_q(Qt, xr, invf, q, q_pos, tok0, ntok, h, rope_scale, sm_scale, tid)
        init_rows(lim, m, lsum, Ol, ty, ntok, kvlen, qlen, qt0, kv_end, causal)
        for kt in T.serial(lim[RI] if WIN else 0, T.truncdiv(kv_end + TK - 1, TK)):
            # The previous tile's PV is done with KV (and, first time, Qt is written).
            T.tvm_storage_sync("shared")
            load_k(KV, xr, invf, kvb, b, h, kt, kv_end, k_pos_offset, rope_scale, tid)
            T.tvm_storage_sync("shared")
            score(acc, qv, kv, Qt, KV, ty, tx)
            softmax(acc, m, lsum, Ol, st, lim, kt, kvlen, causal, tx)
            # Everyone is done reading Kt: the V tile takes KV.
            T.tvm_storage_sync("shared")
            load_v(KV, vr, kvb, b, h, kt, kv_end, tid)
            T.tvm_storage_sync("shared")
            accumulate(Ol, pv, vv, acc, KV, tx)
        store(o, lse, Ol, m, lsum, tok0, ntok, h, ty, tx)

    return tile


def make_prefill_kernel(p: PrefillPlan):
    """``kernel(q, q_indptr, q_pos, k_pos_offset, o, lse, kvb, B, n, causal, rope_scale, rope_theta, sm_scale)``:
    the grid (a block per virtual query tile and kv head; entry ``b`` owns virtual tiles from
    ``q_indptr[b] // TQ + b``, surplus ones idle) and the block's buffers, then ``make_tile``'s tile."""
    HKV, D, R, RI, KJ, CD, dtype = p.hkv, p.d, p.r, p.ri, p.kj, p.cd, p.dtype
    TQ, KVSZ, VEC, VECV, ROPE, HALF = p.tq, p.kvsz, p.vec, p.vecv, p.rope, p.d // 2
    WIN = p.var.has_window
    tile = make_tile(p)

    @T.macro
    def kernel(q, q_indptr, q_pos, k_pos_offset, o, lse, kvb, B, n, causal, rope_scale, rope_theta, sm_scale):
        for vt in T.thread_binding(T.max(n // TQ + B, 1), thread="blockIdx.x"):
            for h in T.thread_binding(HKV, thread="blockIdx.y"):
                for tid in T.thread_binding(PF_NT, thread="threadIdx.x"):
                    # Every buffer here, where the tile's stages find them (a macro returns nothing, and one
                    # allocated inside a stage would sit elsewhere in the TIR).
                    Qt = T.alloc_buffer((D, R), "float32", scope="shared")
                    KV = T.alloc_buffer((KVSZ,), "float32", scope="shared")
                    invf = T.alloc_buffer((HALF if ROPE else 1,), "float32", scope="shared" if ROPE else "local")
                    srch = T.alloc_buffer((2,), "int32", scope="local")
                    xr = T.alloc_buffer((2 * VEC,), dtype, scope="local")
                    vr = T.alloc_buffer((VECV,), dtype, scope="local")
                    qv = T.alloc_buffer((RI,), "float32", scope="local")
                    kv = T.alloc_buffer((KJ,), "float32", scope="local")
                    pv = T.alloc_buffer((RI,), "float32", scope="local")
                    vv = T.alloc_buffer((CD,), "float32", scope="local")
                    acc = T.alloc_buffer((RI, KJ), "float32", scope="local")
                    Ol = T.alloc_buffer((RI, CD), "float32", scope="local")
                    m = T.alloc_buffer((RI,), "float32", scope="local")
                    lsum = T.alloc_buffer((RI,), "float32", scope="local")
                    # Row bounds (``CudaVariant.row_bound``); with a window lim[RI] is the first key tile.
                    lim = T.alloc_buffer((RI + 1 if WIN else RI,), "int32", scope="local")
                    st = T.alloc_buffer((2,), "float32", scope="local")
                    tile((Qt, KV, invf, srch, xr, vr, qv, kv, pv, vv, acc, Ol, m, lsum, lim, st), vt, h, tid, q,
                         q_indptr, q_pos, k_pos_offset, o, lse, kvb, B, causal, rope_scale, rope_theta, sm_scale)

    return kernel
