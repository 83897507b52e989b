"""The stages of the CUDA paged decode kernel (``attention_cuda_decode.py``), one ``@T.macro`` factory each.

A block is ``NW`` lane groups of ``L`` threads (``DecodePlan``); every stage below runs in all of them.
Per block step of ``TKB = NW * KPT`` keys, lane group ``ty`` takes keys ``key0 + kk`` (``kk < KPT``,
``key0 = k0 + it * TKB + ty * KPT``):

``load_kv``   K and V rows of the step's keys into registers, all loads issued before any use;
``score``     partial q.k per lane (keys rotated first with inline RoPE), folded over the ``L`` lanes;
``softmax``   online softmax of the lane group (mask, soft cap, running max and sum, O rescaled);
``accumulate`` O += P @ V;
``store``     the ``NW`` lane-group states merged through shared memory, o / lse (or a split's partial
              state) written coalesced.

Inline RoPE (``apply_rope == 1``) adds, from ``_decode_rope_cuda``: the per-thread frequencies and key-offset
rotations (``rope_setup``), a per-batch table of q rows rotated to the batch's key positions
(``rope_q_table``) and its read (``load_q_table``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from ._common import EMPTY_LSE, LOG2E
from ._common_cuda import shfl_xor, vec16
from ._epilogue_cuda import make_merged_store


@dataclass(frozen=True)
class DecodePlan:
    """Compile-time layout of the decode kernel (``attention_cuda_decode._decode_plan`` picks it)."""

    hq: int
    hkv: int
    d: int
    dtype: str
    #: dims per lane, lanes holding dims, lanes per group (a power of 2), lane groups per block
    vec: int
    l0: int
    l: int
    nw: int
    #: q rows per block (of the GQA group), keys per lane group and step
    gc: int
    kpt: int

    @property
    def g(self) -> int:
        return self.hq // self.hkv

    @property
    def nz(self) -> int:
        """Row chunks of a GQA group (over blockIdx.z)."""
        return self.g // self.gc

    @property
    def tkb(self) -> int:
        """Keys per block step."""
        return self.nw * self.kpt

    @property
    def lanes_width(self) -> int:
        """Elements of a lane-major shared row (``L * VEC``, at least ``D``)."""
        return self.l * self.vec

    @property
    def shifts(self) -> int:
        return self.l.bit_length() - 1


def make_load_kv(p: DecodePlan, rope: bool):
    """``load_kv(Kr, Vr, pages, page_values, pbase, ps, h, key0, k1, tx)``: the K and V rows of keys
    ``key0 + kk`` (clamped to the split's last key ``k1 - 1``: valid memory, masked in ``softmax``).

    Plain lanes hold dims ``tx*VEC + e`` (16-byte loads). With inline RoPE a lane holds K dims ``tx*VEC/2 + e``
    and ``D/2 + tx*VEC/2 + e`` (``e < VEC/2``: both elements of each of its rotation pairs, so rotating needs
    no shuffle); V keeps the plain layout (P @ V does not care which dims a lane owns)."""
    VEC, L0, KPT, H2, HALF, dtype = p.vec, p.l0, p.kpt, p.vec // 2, p.d // 2, p.dtype
    V16 = min(VEC, vec16(dtype))
    V16H = min(H2, vec16(dtype))

    @T.macro
    def load_chunk(dst, pages, pg, c, h, off, d0, kk):
        for u in T.unroll(VEC // V16):
            for e in T.vectorized(V16):
                dst[kk, u * V16 + e] = pages[pg, c, h, off, d0 + u * V16 + e]

    @T.macro
    def load_halves(dst, pages, pg, c, h, off, d0h, kk):
        for u in T.unroll(H2 // V16H):
            for e in T.vectorized(V16H):
                dst[kk, u * V16H + e] = pages[pg, c, h, off, d0h + u * V16H + e]
        for u in T.unroll(H2 // V16H):
            for e in T.vectorized(V16H):
                dst[kk, H2 + u * V16H + e] = pages[pg, c, h, off, HALF + d0h + u * V16H + e]

    @T.macro
    def load_kv(Kr, Vr, pages, page_values, pbase, ps, h, key0, k1, tx):
        for kk in T.unroll(KPT):
            jc: T.let[T.int32] = T.min(key0 + kk, k1 - 1)
            pg: T.let[T.int32] = page_values[pbase + T.truncdiv(jc, ps)]
            if tx < L0:
                if rope:
                    load_halves(Kr, pages, pg, 0, h, T.truncmod(jc, ps), tx * H2, kk)
                else:
                    load_chunk(Kr, pages, pg, 0, h, T.truncmod(jc, ps), tx * VEC, kk)
                load_chunk(Vr, pages, pg, 1, h, T.truncmod(jc, ps), tx * VEC, kk)
            else:
                for e in T.unroll(VEC):
                    Kr[kk, e] = T.Cast(dtype, 0)
                for e in T.unroll(VEC):
                    Vr[kk, e] = T.Cast(dtype, 0)

    return load_kv


def make_score(p: DecodePlan, rope: bool):
    """``score(S_, Qr, Kr, Oc, Os)``: ``S_[kk, g]`` = q row ``g`` . key ``kk`` (log2 units: q is scaled),
    summed over the ``L`` lanes (every lane ends with the full score).

    Inline RoPE: q comes rotated to the key's position minus its offset ``ty*KPT + kk`` in the step
    (``load_q_table``), and the key is rotated by that offset with the per-thread constants ``Oc``, ``Os``
    (cos / sin, ``rope_setup``): 4 float ops per pair and key, no sin / cos in the key loop."""
    VEC, GC, KPT, H2, L, SHIFTS = p.vec, p.gc, p.kpt, p.vec // 2, p.l, p.shifts

    @T.macro
    def score(S_, Qr, Kr, Oc, Os):
        if rope:
            for kk in T.unroll(KPT):
                for g in T.unroll(GC):
                    S_[kk, g] = T.float32(0)
                for e in T.unroll(H2):
                    kx: T.let[T.float32] = T.Cast("float32", Kr[kk, e])
                    ky: T.let[T.float32] = T.Cast("float32", Kr[kk, H2 + e])
                    xr: T.let[T.float32] = kx * Oc[kk * H2 + e] - ky * Os[kk * H2 + e]
                    yr: T.let[T.float32] = ky * Oc[kk * H2 + e] + kx * Os[kk * H2 + e]
                    for g in T.unroll(GC):
                        S_[kk, g] = S_[kk, g] + Qr[g, e] * xr + Qr[g, H2 + e] * yr
        else:
            for kk in T.unroll(KPT):
                for g in T.unroll(GC):
                    S_[kk, g] = T.float32(0)
                    for e in T.unroll(VEC):
                        S_[kk, g] = S_[kk, g] + Qr[g, e] * T.Cast("float32", Kr[kk, e])
        for sh in T.unroll(SHIFTS):
            for kk in T.unroll(KPT):
                for g in T.unroll(GC):
                    S_[kk, g] = S_[kk, g] + shfl_xor(S_[kk, g], T.shift_right(L, sh + 1))

    return score


def make_softmax(p: DecodePlan, var):
    """``softmax(S_, m, lsum, Orr, st, key0, k1)``: the online softmax step of the lane group: keys at or past
    ``k1`` masked (the soft cap, when on, first, as in the reference), running max ``m`` and sum ``lsum``
    updated, ``Orr`` rescaled, ``S_`` replaced by the probabilities ``2^(s - m)``."""
    VEC, GC, KPT = p.vec, p.gc, p.kpt

    @T.macro
    def softmax(S_, m, lsum, Orr, st, key0, k1):
        for g in T.unroll(GC):
            st[0] = m[g]
            for kk in T.unroll(KPT):
                S_[kk, g] = var.logits(S_[kk, g], key0 + kk < k1)
                st[0] = T.max(st[0], S_[kk, g])
            st[1] = T.exp2(m[g] - st[0])
            m[g] = st[0]
            lsum[g] = lsum[g] * st[1]
            for e in T.unroll(VEC):
                Orr[g, e] = Orr[g, e] * st[1]
            for kk in T.unroll(KPT):
                S_[kk, g] = T.exp2(S_[kk, g] - st[0])
                lsum[g] = lsum[g] + S_[kk, g]

    return softmax


def make_accumulate(p: DecodePlan):
    """``accumulate(Orr, S_, Vr)``: ``Orr[g] += sum_kk S_[kk, g] * v[kk]`` (the lane's VEC value dims)."""
    VEC, GC, KPT = p.vec, p.gc, p.kpt

    @T.macro
    def accumulate(Orr, S_, Vr):
        for g in T.unroll(GC):
            for kk in T.unroll(KPT):
                for e in T.unroll(VEC):
                    Orr[g, e] = Orr[g, e] + S_[kk, g] * T.Cast("float32", Vr[kk, e])

    return accumulate


def make_load_q(p: DecodePlan):
    """``load_q(Qr, Orr, m, lsum, q, b, row0, sm_scale, tx)`` (plain kernel): the lane's dims of the block's
    ``GC`` q rows, scaled by ``sm_scale * log2(e)``, and the empty softmax state."""
    VEC, GC, L0 = p.vec, p.gc, p.l0

    @T.macro
    def load_q(Qr, Orr, m, lsum, q, b, row0, sm_scale, tx):
        for g in T.unroll(GC):
            for e in T.unroll(VEC):
                Qr[g, e] = T.float32(0)
                Orr[g, e] = T.float32(0)
            if tx < L0:
                for e in T.unroll(VEC):
                    Qr[g, e] = T.Cast("float32", q[b, row0 + g, tx * VEC + e])
                for e in T.unroll(VEC):
                    Qr[g, e] = Qr[g, e] * (sm_scale * T.float32(LOG2E))
            m[g] = T.float32(EMPTY_LSE)
            lsum[g] = T.float32(0)

    return load_q


def make_store(p: DecodePlan):
    """``store(o, lse, ws_o, ws_l, red_ml, red_o, m, lsum, Orr, b, h, gz, sp, S, tx, ty)``: merge the ``NW``
    lane-group states (``red_ml``, ``red_o`` in shared memory; one barrier) and write row ``h*G + gz*GC + g``:
    ``o``, ``lse`` when the kernel is not split (``S == 1``), else split ``sp``'s normalized partial state
    into the float32 workspace. A row that saw no key writes ``o = 0``, ``lse = -1e30`` (as a split's partial
    state only the lse: ``make_merge_splits`` reads no ``o`` of it)."""
    VEC, GC, L, L0, NW, D, HQ, G = p.vec, p.gc, p.l, p.l0, p.nw, p.d, p.hq, p.g
    NT = L * NW
    merged_store = make_merged_store(NW, p.dtype, lambda red, w, gg: red[w, gg, 0], lambda red, w, gg: red[w, gg, 1],
                                     lambda red, w, gg, dd: red[w, gg, dd])

    @T.macro
    def store(o, lse, ws_o, ws_l, red_ml, red_o, m, lsum, Orr, b, h, gz, sp, S, tx, ty):
        st = T.alloc_buffer((4,), "float32", scope="local")
        for g in T.unroll(GC):
            if tx == 0:
                red_ml[ty, g, 0] = m[g]
                red_ml[ty, g, 1] = lsum[g]
            if tx < L0:
                for u in T.unroll(VEC // 4):
                    for e in T.vectorized(4):
                        red_o[ty, g, tx * VEC + u * 4 + e] = Orr[g, u * 4 + e]
        T.tvm_storage_sync("shared")
        for idx in T.serial((GC * D + NT - 1) // NT):
            if idx * NT + ty * L + tx < GC * D:
                gg: T.let[T.int32] = T.truncdiv(idx * NT + ty * L + tx, D)
                dd: T.let[T.int32] = T.truncmod(idx * NT + ty * L + tx, D)
                hq: T.let[T.int32] = h * G + gz * GC + gg
                # The partial state of split sp (S > 1) is row (b * HQ + hq) * S + sp of the float32 workspace.
                merged_store(o, lse, ws_o, ws_l, red_ml, red_o, st, b, hq, (b * HQ + hq) * S + sp, gg, dd, S)

    return store


__all__ = ["DecodePlan", "make_accumulate", "make_load_kv", "make_load_q", "make_score", "make_softmax",
           "make_store"]
