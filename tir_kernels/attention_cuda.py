"""CUDA attention kernels: paged decode, paged prefill and ragged prefill.

Same ABI and semantics as ``attention_cpu.py`` (``docs/ARCHITECTURE.md``, "Kernel ABI"): base-2 LSE,
bottom-right causal, an empty row writes ``o = 0`` and ``lse = -1e30``, inline RoPE rotates q at its
position and key ``j`` of entry ``b`` at ``k_pos_offset[b] + j``, float32 accumulation. Scores are kept in
log2 units: ``sm_scale * log2(e)`` is folded into q when it is loaded.

Decode (``attn_decode_paged``), one block per (entry, kv head[, row chunk])
--------------------------------------------------------------------------
* A *lane group* of ``L`` threads splits the head dim: lane ``tx`` owns dims ``tx*VEC .. tx*VEC+VEC``
  (``VEC`` = 8 fp16 / 4 fp32, i.e. 16-byte page loads). The block has ``NW`` lane groups (128 threads).
* Every thread keeps the ``GC`` query rows of its kv head (the whole GQA group, ``GC = G`` for ``G <= 8``)
  in registers, so each K/V row is loaded from global memory exactly once per block and used for all
  rows. Lane group ``w`` walks keys ``it*NW*KPT + w*KPT + kk`` (``KPT`` consecutive keys per step, all
  loads issued before use); a score is a per-lane partial dot product folded with ``__shfl_xor_sync``
  over the ``L`` lanes.
* Each lane group runs its own online softmax (``m``, ``l``, ``O`` in registers, no barrier in the key
  loop); at the end the ``NW`` partial states are merged through shared memory and written coalesced.

Prefill (``attn_prefill_ragged`` / ``attn_prefill_paged``), one block per (query tile, kv head)
----------------------------------------------------------------------------------------------
* 256 threads as 16 x 16 (``ty``, ``tx``). A query tile is ``TQ = 64 // G`` tokens x ``G`` heads =
  up to 64 *rows* (row ``r`` = token ``r // G``, head ``h*G + r % G``); K/V tiles of ``TK`` keys (64;
  32 when ``D > 128``) go through shared memory once per tile for all rows.
* Shared memory (float32, dynamic): ``Qt[D, 64]`` (q transposed, rotated, scaled), ``Kt[D, TK]`` (keys
  transposed, rotated), ``Vs[TK, Dv]``, ``Ps[64, TK + 4]`` (probabilities).
* Scores: thread (ty, tx) computes rows ``4ty .. 4ty+3`` x keys ``KJ*tx .. KJ*tx+KJ-1`` (float4 reads of
  ``Qt`` and ``Kt``); row max / sum over the 16 ``tx`` lanes with shuffles; online softmax per row in
  registers; ``P`` goes to shared memory; PV: the thread owns rows ``4ty..`` x dims ``tx, tx+16, ...``.
* Tiles with keys past the tile's causal limit are skipped; partial tiles load zeros past the entry's
  keys and masks hide them (``T.if_then_else`` on ``key < limit(row)``).
* Grid: ``blockIdx.x`` = virtual tile ``v`` in ``[0, n // TQ + B)``; entry ``b`` owns virtual tiles
  ``[q_indptr[b] // TQ + b, q_indptr[b+1] // TQ + b + 1)`` (always at least ``ceil(qlen / TQ)`` of
  them); a block finds its entry by binary search and returns if its tile is past the entry's queries.
  Within an entry the last query tile (the most keys under causal) runs first.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from ._common import EMPTY_LSE, LOG2E, MASKED
from ._common_cuda import (WARP, ceildiv, check_head_dim, cos_approx, next_pow2, rope_angle,
                           rope_divisor, shfl_xor, sin_approx, vec16)


# ---------------------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------------------
def _kv_len(page_indptr, last_page_len, b, ps):
    """Keys of entry ``b`` in a paged layout (0 when it has no pages)."""
    npg = page_indptr[b + 1] - page_indptr[b]
    return T.if_then_else(npg > 0, (npg - 1) * ps + last_page_len[b], 0)


def _pick_vec(d: int, dtype: str, max_lanes: int = WARP) -> int:
    """Elements per lane along the head dim: 16 bytes when possible, a divisor of ``d / 2`` (so a RoPE
    partner chunk is a whole chunk), and at most ``max_lanes`` lanes."""
    vec = vec16(dtype)
    while (d // 2) % vec:
        vec //= 2
    while d // vec > max_lanes:
        vec *= 2
    if (d // 2) % vec:
        raise NotImplementedError(f"pagedkv.tir_kernels: no CUDA lane split for head_dim={d}")
    return vec


# ---------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------
#: Threads per decode block.
DECODE_THREADS = 128


def _decode_plan(g: int, d: int, dtype: str):
    vec = _pick_vec(d, dtype)
    lanes0 = d // vec
    lanes = next_pow2(lanes0)
    nw = max(1, DECODE_THREADS // lanes)
    # Row chunk: the whole group up to 8 rows (registers); larger groups split over blockIdx.z.
    gc = g if g <= 8 else max(c for c in range(1, 9) if g % c == 0)
    # Keys per lane group and step: as many independent loads as the registers allow.
    per_key = 2 * vec * (2 if dtype == "float16" else 4) // 4 + gc
    kpt = 4
    while kpt > 1 and 2 * gc * vec + kpt * per_key > 160:
        kpt //= 2
    return vec, lanes0, lanes, nw, gc, kpt


def attn_decode_paged_cuda(num_qo_heads, num_kv_heads, head_dim, dtype):
    """``pagedkv_attn_decode_paged`` for CUDA.

    Signature::

        (q[B,Hq,D], pages[P,2,Hkv,ps,D], page_indptr[B+1], page_values[nnz], last_page_len[B],
         k_pos_offset[B], q_pos[B], o[B,Hq,D], lse[B,Hq],
         apply_rope:i32, rope_scale:f32, rope_theta:f32, sm_scale:f32)
    """
    HQ, HKV, D = num_qo_heads, num_kv_heads, head_dim
    check_head_dim("attn_decode_paged", D)
    G = HQ // HKV
    VEC, L0, L, NW, GC, KPT = _decode_plan(G, D, dtype)
    NZ = G // GC
    HALF = D // 2
    PARTNER = HALF // VEC  # lane distance of the RoPE partner chunk
    V16 = min(VEC, vec16(dtype))
    NT = L * NW
    TKB = NW * KPT  # keys per block step
    PADDED = L0 < L
    SHIFTS = [L >> (s + 1) for s in range(int(math.log2(L)))]
    qk_scale = LOG2E

    @T.macro
    def load_chunk(dst, pages, pg, c, h, off, d0, kk, base):
        """``dst[kk, base + e] = pages[pg, c, h, off, d0 + e]`` for ``e < VEC`` (16-byte loads)."""
        for u in T.unroll(VEC // V16):
            for e in T.vectorized(V16):
                dst[kk, base + u * V16 + e] = pages[pg, c, h, off, d0 + u * V16 + e]

    def make_kernel(ROPE: bool):
        @T.macro
        def kernel(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                   rope_scale, rope_theta, sm_scale):
            for bx in T.thread_binding(T.max(B, 1), thread="blockIdx.x"):
                for h in T.thread_binding(HKV, thread="blockIdx.y"):
                    for gz in T.thread_binding(NZ, thread="blockIdx.z"):
                        for ty in T.thread_binding(NW, thread="threadIdx.y"):
                            for tx in T.thread_binding(L, thread="threadIdx.x"):
                                Qr = T.alloc_buffer((GC, VEC), "float32", scope="local")
                                Orr = T.alloc_buffer((GC, VEC), "float32", scope="local")
                                m = T.alloc_buffer((GC,), "float32", scope="local")
                                lsum = T.alloc_buffer((GC,), "float32", scope="local")
                                Kr = T.alloc_buffer((KPT, 2 * VEC) if ROPE else (KPT, VEC), dtype, scope="local")
                                Vr = T.alloc_buffer((KPT, VEC), dtype, scope="local")
                                Kf = T.alloc_buffer((KPT, VEC) if ROPE else (1,), "float32", scope="local")
                                S = T.alloc_buffer((KPT, GC), "float32", scope="local")
                                invf = T.alloc_buffer((VEC,), "float32", scope="local")
                                st = T.alloc_buffer((4,), "float32", scope="local")
                                red_ml = T.alloc_buffer((NW, GC, 2), "float32", scope="shared")
                                red_o = T.alloc_buffer((NW, GC, D), "float32", scope="shared.dyn")
                                if bx < B:
                                    b: T.let[T.int32] = bx
                                    kvlen: T.let[T.int32] = _kv_len(page_indptr, last_page_len, b, ps)
                                    pbase: T.let[T.int32] = page_indptr[b]
                                    d0: T.let[T.int32] = tx * VEC
                                    # The lane's dims and their RoPE divisors (dims d0 + e, pair index mod D/2).
                                    if ROPE:
                                        for e in T.unroll(VEC):
                                            invf[e] = rope_divisor(T.truncmod(d0 + e, HALF), rope_theta, D)
                                    # q rows of this kv head, rotated and scaled by sm_scale * log2(e).
                                    for g in T.unroll(GC):
                                        for e in T.unroll(VEC):
                                            Qr[g, e] = T.float32(0)
                                            if tx < L0:
                                                if ROPE:
                                                    # x' = x cos - x[d + D/2] sin (d < D/2); x cos + x[d - D/2] sin
                                                    Qr[g, e] = T.Cast("float32", q[b, h * G + gz * GC + g, d0 + e]) * cos_approx(
                                                        rope_angle(q_pos[b], rope_scale, invf[e])) + T.if_then_else(
                                                        d0 < HALF, T.float32(-1), T.float32(1)) * T.Cast(
                                                        "float32", q[b, h * G + gz * GC + g, T.truncmod(d0 + e + HALF, D)]
                                                    ) * sin_approx(rope_angle(q_pos[b], rope_scale, invf[e]))
                                                else:
                                                    Qr[g, e] = T.Cast("float32", q[b, h * G + gz * GC + g, d0 + e])
                                                Qr[g, e] = Qr[g, e] * (sm_scale * T.float32(qk_scale))
                                            Orr[g, e] = T.float32(0)
                                        m[g] = T.float32(EMPTY_LSE)
                                        lsum[g] = T.float32(0)
                                    for it in T.serial(ceildiv(kvlen, TKB)):
                                        # Issue every load of the step first (KPT keys, K and V).
                                        for kk in T.unroll(KPT):
                                            jc: T.let[T.int32] = T.min(it * TKB + ty * KPT + kk, kvlen - 1)
                                            pg: T.let[T.int32] = page_values[pbase + T.truncdiv(jc, ps)]
                                            if tx < L0:
                                                load_chunk(Kr, pages, pg, 0, h, T.truncmod(jc, ps), d0, kk, 0)
                                                load_chunk(Vr, pages, pg, 1, h, T.truncmod(jc, ps), d0, kk, 0)
                                                if ROPE:
                                                    load_chunk(Kr, pages, pg, 0, h, T.truncmod(jc, ps),
                                                               T.truncmod(d0 + HALF, D), kk, VEC)
                                            else:
                                                for e in T.unroll(2 * VEC):
                                                    Kr[kk, e] = T.Cast(dtype, 0)
                                                for e in T.unroll(VEC):
                                                    Vr[kk, e] = T.Cast(dtype, 0)
                                        # Partial dot products (keys rotated at position k_pos_offset + j
                                        # when inline RoPE), folded over the L lanes of the group.
                                        if ROPE:
                                            for kk in T.unroll(KPT):
                                                for e in T.unroll(VEC):
                                                    Kf[kk, e] = T.Cast("float32", Kr[kk, e]) * cos_approx(rope_angle(
                                                        k_pos_offset[b] + it * TKB + ty * KPT + kk, rope_scale, invf[e])) + \
                                                        T.if_then_else(d0 < HALF, -T.Cast("float32", Kr[kk, VEC + e]),
                                                                       T.Cast("float32", Kr[kk, VEC + e])) * sin_approx(rope_angle(
                                                            k_pos_offset[b] + it * TKB + ty * KPT + kk, rope_scale, invf[e]))
                                            for kk in T.unroll(KPT):
                                                for g in T.unroll(GC):
                                                    S[kk, g] = T.float32(0)
                                                    for e in T.unroll(VEC):
                                                        S[kk, g] = S[kk, g] + Qr[g, e] * Kf[kk, e]
                                        else:
                                            for kk in T.unroll(KPT):
                                                for g in T.unroll(GC):
                                                    S[kk, g] = T.float32(0)
                                                    for e in T.unroll(VEC):
                                                        S[kk, g] = S[kk, g] + Qr[g, e] * T.Cast("float32", Kr[kk, e])
                                        for sh in T.unroll(len(SHIFTS)):
                                            for kk in T.unroll(KPT):
                                                for g in T.unroll(GC):
                                                    S[kk, g] = S[kk, g] + shfl_xor(S[kk, g], T.shift_right(L, sh + 1))
                                        # Online softmax of this lane group (keys past kvlen are masked).
                                        for g in T.unroll(GC):
                                            st[0] = m[g]
                                            for kk in T.unroll(KPT):
                                                S[kk, g] = T.if_then_else(it * TKB + ty * KPT + kk < kvlen, S[kk, g],
                                                                          T.float32(MASKED))
                                                st[0] = T.max(st[0], S[kk, g])
                                            st[1] = T.exp2(m[g] - st[0])
                                            m[g] = st[0]
                                            lsum[g] = lsum[g] * st[1]
                                            for e in T.unroll(VEC):
                                                Orr[g, e] = Orr[g, e] * st[1]
                                            for kk in T.unroll(KPT):
                                                st[2] = T.exp2(S[kk, g] - st[0])
                                                lsum[g] = lsum[g] + st[2]
                                                for e in T.unroll(VEC):
                                                    Orr[g, e] = Orr[g, e] + st[2] * T.Cast("float32", Vr[kk, e])
                                    # Merge the NW lane-group states through shared memory.
                                    for g in T.unroll(GC):
                                        if tx == 0:
                                            red_ml[ty, g, 0] = m[g]
                                            red_ml[ty, g, 1] = lsum[g]
                                        if tx < L0:
                                            for u in T.unroll(VEC // 4 if VEC >= 4 else 1):
                                                for e in T.vectorized(4 if VEC >= 4 else VEC):
                                                    red_o[ty, g, d0 + u * 4 + e] = Orr[g, u * 4 + e]
                                    T.tvm_storage_sync("shared.dyn")
                                    for idx in T.serial(ceildiv(GC * D, NT)):
                                        if idx * NT + ty * L + tx < GC * D:
                                            gg: T.let[T.int32] = T.truncdiv(idx * NT + ty * L + tx, D)
                                            dd: T.let[T.int32] = T.truncmod(idx * NT + ty * L + tx, D)
                                            st[0] = T.float32(EMPTY_LSE)
                                            for w in T.unroll(NW):
                                                st[0] = T.max(st[0], red_ml[w, gg, 0])
                                            st[1] = T.float32(0)
                                            st[2] = T.float32(0)
                                            for w in T.unroll(NW):
                                                st[3] = T.exp2(red_ml[w, gg, 0] - st[0])
                                                st[1] = st[1] + red_ml[w, gg, 1] * st[3]
                                                st[2] = st[2] + red_o[w, gg, dd] * st[3]
                                            # l >= 1 once any key was seen (its max contributes 2^0); else 0.
                                            if st[1] > T.float32(0):
                                                o[b, h * G + gz * GC + gg, dd] = T.Cast(dtype, st[2] / st[1])
                                                if dd == 0:
                                                    lse[b, h * G + gz * GC + gg] = st[0] + T.log2(st[1])
                                            else:
                                                o[b, h * G + gz * GC + gg, dd] = T.Cast(dtype, T.float32(0))
                                                if dd == 0:
                                                    lse[b, h * G + gz * GC + gg] = T.float32(EMPTY_LSE)

        return kernel

    kernel_rope, kernel_plain = make_kernel(True), make_kernel(False)

    @T.prim_func
    def attn_decode_paged(q_h: T.handle, pages_h: T.handle, page_indptr_h: T.handle, page_values_h: T.handle,
                          last_page_len_h: T.handle, k_pos_offset_h: T.handle, q_pos_h: T.handle,
                          o_h: T.handle, lse_h: T.handle, apply_rope: T.int32, rope_scale: T.float32,
                          rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"global_symbol": "pagedkv_attn_decode_paged", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        B, P, ps, nnz = T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (B, HQ, D), dtype, elem_offset=T.int32())
        pages = T.match_buffer(pages_h, (P, 2, HKV, ps, D), dtype)
        page_indptr = T.match_buffer(page_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        page_values = T.match_buffer(page_values_h, (nnz,), "int32", elem_offset=T.int32())
        last_page_len = T.match_buffer(last_page_len_h, (B,), "int32", elem_offset=T.int32())
        k_pos_offset = T.match_buffer(k_pos_offset_h, (B,), "int32", elem_offset=T.int32())
        q_pos = T.match_buffer(q_pos_h, (B,), "int32", elem_offset=T.int32())
        o = T.match_buffer(o_h, (B, HQ, D), dtype, elem_offset=T.int32())
        lse = T.match_buffer(lse_h, (B, HQ), "float32", elem_offset=T.int32())
        # Two kernels: inline RoPE costs registers that the plain kernel does not pay for.
        if apply_rope == 1:
            kernel_rope(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                        rope_scale, rope_theta, sm_scale)
        else:
            kernel_plain(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                         rope_scale, rope_theta, sm_scale)

    return attn_decode_paged


# ---------------------------------------------------------------------------------------------------
# prefill (ragged and paged)
# ---------------------------------------------------------------------------------------------------
#: Prefill block: 16 x 16 threads; 4 rows per thread (64 rows per query tile).
PF_TY, PF_TX, PF_RI = 16, 16, 4
PF_NT = PF_TY * PF_TX
PF_ROWS = PF_TY * PF_RI


def _chunk_vec(d: int, dtype: str, rope_partner: bool) -> int:
    """Elements per global-memory chunk (16 bytes when possible; a divisor of ``d`` and, for the RoPE
    partner chunk, of ``d / 2``)."""
    vec = vec16(dtype)
    while d % vec or (rope_partner and (d // 2) % vec):
        vec //= 2
    return vec


def _prefill_plan(op: str, g: int, d: int, dv: int, dtype: str):
    check_head_dim(op, d)
    check_head_dim(op, dv, "v_head_dim")
    if g > PF_ROWS:
        raise NotImplementedError(f"pagedkv.tir_kernels: the CUDA {op!r} kernel supports GQA groups up to "
                                  f"{PF_ROWS}, got {g}")
    kj = 4 if max(d, dv) <= 128 else 2
    return {"TQ": PF_ROWS // g, "KJ": kj, "TK": PF_TX * kj, "VEC": _chunk_vec(d, dtype, True),
            "VECV": _chunk_vec(dv, dtype, False)}


def _make_prefill(op: str, num_qo_heads, num_kv_heads, head_dim, v_head_dim, dtype, paged: bool):
    """The prefill PrimFunc: ``paged`` selects the K/V source (pages or ragged k/v rows)."""
    HQ, HKV, D, DV = num_qo_heads, num_kv_heads, head_dim, v_head_dim
    G = HQ // HKV
    plan = _prefill_plan(op, G, D, DV, dtype)
    TQ, KJ, TK, VEC, VECV = plan["TQ"], plan["KJ"], plan["TK"], plan["VEC"], plan["VECV"]
    NT, TX, RI, R = PF_NT, PF_TX, PF_RI, PF_ROWS
    HALF = D // 2
    CQ = D // VEC  # chunks of a q / k row
    CV = DV // VECV  # chunks of a v row
    CD = DV // TX  # output dims per thread
    PSTR = TK + 4  # row stride of Ps (rows 4 apart land 16 banks apart)
    V16 = min(VEC, vec16(dtype))
    V16V = min(VECV, vec16(dtype))

    @T.macro
    def load_row_chunk(dst, base, kvb, c01, b, key, d0, h, nvec, v16):
        """``dst[base + e]`` (registers, storage dtype) = element ``d0 + e`` (``e < nvec``) of K (c01 = 0) or
        V (c01 = 1) of key ``key`` of entry ``b``, kv head ``h``."""
        if paged:
            pages, page_values, page_indptr, ps, _last_page_len = kvb
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

    def make_kernel(ROPE: bool):
        @T.macro
        def kernel(q, q_indptr, q_pos, k_pos_offset, o, lse, kvb, B, n, causal, rope_scale, rope_theta,
                   sm_scale):
            for vt in T.thread_binding(T.max(n // TQ + B, 1), thread="blockIdx.x"):
                for h in T.thread_binding(HKV, thread="blockIdx.y"):
                    for tid in T.thread_binding(NT, thread="threadIdx.x"):
                        Qt = T.alloc_buffer((D, R), "float32", scope="shared.dyn")
                        Kt = T.alloc_buffer((D, TK), "float32", scope="shared.dyn")
                        Vs = T.alloc_buffer((TK, DV), "float32", scope="shared.dyn")
                        Ps = T.alloc_buffer((R, PSTR), "float32", scope="shared.dyn")
                        invf = T.alloc_buffer((HALF if ROPE else 1,), "float32", scope="shared")
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
                        lim = T.alloc_buffer((RI,), "int32", scope="local")
                        st = T.alloc_buffer((3,), "float32", scope="local")
                        tx: T.let[T.int32] = T.truncmod(tid, TX)
                        ty: T.let[T.int32] = T.truncdiv(tid, TX)
                        # No branch around the barriers: an idle block (past its entry's queries, or B == 0)
                        # runs the same code with zero-trip loops and masked memory accesses.
                        # Entry b: the last one whose first virtual tile q_indptr[b] // TQ + b <= vt.
                        srch[0] = 0
                        srch[1] = B
                        while srch[1] - srch[0] > 1:
                            if T.truncdiv(q_indptr[T.truncdiv(srch[0] + srch[1], 2)], TQ) + T.truncdiv(
                                    srch[0] + srch[1], 2) <= vt:
                                srch[0] = T.truncdiv(srch[0] + srch[1], 2)
                            else:
                                srch[1] = T.truncdiv(srch[0] + srch[1], 2)
                        b: T.let[T.int32] = srch[0]
                        qlen: T.let[T.int32] = T.if_then_else(B > 0, q_indptr[T.min(b + 1, B)] - q_indptr[b], 0)
                        tin: T.let[T.int32] = vt - (T.truncdiv(q_indptr[b], TQ) + b)
                        active: T.let[T.bool] = tin >= 0 and tin < T.truncdiv(qlen + TQ - 1, TQ)
                        # Last query tile first (it sees the most keys under causal).
                        qt0: T.let[T.int32] = (T.truncdiv(qlen + TQ - 1, TQ) - 1 - tin) * TQ
                        ntok: T.let[T.int32] = T.if_then_else(active, T.min(TQ, qlen - qt0), 0)
                        tok0: T.let[T.int32] = q_indptr[b] + qt0
                        kvlen: T.let[T.int32] = T.if_then_else(active, kv_len_of(kvb, b), 0)
                        kv_end: T.let[T.int32] = T.if_then_else(
                            causal > 0, T.max(T.min(kvlen, kvlen - qlen + qt0 + ntok), 0), kvlen)
                        if ROPE:
                            for it in T.serial(ceildiv(HALF, NT)):
                                if it * NT + tid < HALF:
                                    invf[it * NT + tid] = rope_divisor(it * NT + tid, rope_theta, D)
                            T.tvm_storage_sync("shared")
                        # Q tile: Qt[d, r] = rope(q[token, head])[d] * sm_scale * log2(e); 0 past the rows.
                        for it in T.serial(ceildiv(R * CQ, NT)):
                            if it * NT + tid < R * CQ:
                                r: T.let[T.int32] = T.truncmod(it * NT + tid, R)
                                c: T.let[T.int32] = T.truncdiv(it * NT + tid, R)
                                if r < TQ * G and T.truncdiv(r, G) < ntok:
                                    for e in T.unroll(VEC):
                                        xr[e] = q[tok0 + T.truncdiv(r, G), h * G + T.truncmod(r, G), c * VEC + e]
                                    if ROPE:
                                        for e in T.unroll(VEC):
                                            xr[VEC + e] = q[tok0 + T.truncdiv(r, G), h * G + T.truncmod(r, G),
                                                            T.truncmod(c * VEC + HALF + e, D)]
                                        for e in T.unroll(VEC):
                                            Qt[c * VEC + e, r] = rope_elem(
                                                xr[e], xr[VEC + e], c * VEC + e,
                                                q_pos[tok0 + T.truncdiv(r, G)], rope_scale, invf) * (
                                                sm_scale * T.float32(LOG2E))
                                    else:
                                        for e in T.unroll(VEC):
                                            Qt[c * VEC + e, r] = T.Cast("float32", xr[e]) * (sm_scale * T.float32(LOG2E))
                                else:
                                    for e in T.unroll(VEC):
                                        Qt[c * VEC + e, r] = T.float32(0)
                        # Row state; lim = keys the row sees (bottom-right causal), 0 for padding rows.
                        for i in T.unroll(RI):
                            lim[i] = T.if_then_else(
                                ty * RI + i < TQ * G and T.truncdiv(ty * RI + i, G) < ntok,
                                T.if_then_else(causal > 0,
                                               T.min(kvlen, kvlen - qlen + qt0 + T.truncdiv(ty * RI + i, G) + 1),
                                               kvlen), 0)
                            m[i] = T.float32(EMPTY_LSE)
                            lsum[i] = T.float32(0)
                            for c in T.unroll(CD):
                                Ol[i, c] = T.float32(0)
                        for kt in T.serial(T.truncdiv(kv_end + TK - 1, TK)):
                            # The previous tile's readers of Kt / Vs / Ps are done.
                            T.tvm_storage_sync("shared.dyn")
                            # K tile, transposed: Kt[d, j] (thread per key: conflict-free stores).
                            for it in T.serial(ceildiv(TK * CQ, NT)):
                                if it * NT + tid < TK * CQ:
                                    j: T.let[T.int32] = T.truncmod(it * NT + tid, TK)
                                    c: T.let[T.int32] = T.truncdiv(it * NT + tid, TK)
                                    if kt * TK + j < kv_end:
                                        load_row_chunk(xr, 0, kvb, 0, b, kt * TK + j, c * VEC, h, VEC, V16)
                                        if ROPE:
                                            load_row_chunk(xr, VEC, kvb, 0, b, kt * TK + j,
                                                           T.truncmod(c * VEC + HALF, D), h, VEC, V16)
                                            for e in T.unroll(VEC):
                                                Kt[c * VEC + e, j] = rope_elem(
                                                    xr[e], xr[VEC + e], c * VEC + e,
                                                    k_pos_offset[b] + kt * TK + j, rope_scale, invf)
                                        else:
                                            for e in T.unroll(VEC):
                                                Kt[c * VEC + e, j] = T.Cast("float32", xr[e])
                                    else:
                                        for e in T.unroll(VEC):
                                            Kt[c * VEC + e, j] = T.float32(0)
                            # V tile, row-major: Vs[j, d].
                            for it in T.serial(ceildiv(TK * CV, NT)):
                                if it * NT + tid < TK * CV:
                                    j: T.let[T.int32] = T.truncdiv(it * NT + tid, CV)
                                    c: T.let[T.int32] = T.truncmod(it * NT + tid, CV)
                                    if kt * TK + j < kv_end:
                                        load_row_chunk(vr, 0, kvb, 1, b, kt * TK + j, c * VECV, h, VECV, V16V)
                                        for e in T.unroll(VECV):
                                            Vs[j, c * VECV + e] = T.Cast("float32", vr[e])
                                    else:
                                        for e in T.unroll(VECV):
                                            Vs[j, c * VECV + e] = T.float32(0)
                            T.tvm_storage_sync("shared.dyn")
                            # Scores of rows 4ty.. x keys KJ tx.. (log2 units: q is pre-scaled).
                            for i in T.unroll(RI):
                                for kk in T.unroll(KJ):
                                    acc[i, kk] = T.float32(0)
                            for d4 in T.serial(D // 4):
                                for dd in T.unroll(4):
                                    for i in T.vectorized(RI):
                                        qv[i] = Qt[d4 * 4 + dd, ty * RI + i]
                                    for kk in T.vectorized(KJ):
                                        kv[kk] = Kt[d4 * 4 + dd, tx * KJ + kk]
                                    for i in T.unroll(RI):
                                        for kk in T.unroll(KJ):
                                            acc[i, kk] = acc[i, kk] + qv[i] * kv[kk]
                            # Online softmax per row: max over the 16 tx lanes of the row, P to Ps.
                            for i in T.unroll(RI):
                                st[0] = m[i]
                                for kk in T.unroll(KJ):
                                    acc[i, kk] = T.if_then_else(kt * TK + tx * KJ + kk < lim[i], acc[i, kk],
                                                                T.float32(MASKED))
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
                                for kk in T.vectorized(KJ):
                                    Ps[ty * RI + i, tx * KJ + kk] = acc[i, kk]
                            T.tvm_storage_sync("shared.dyn")
                            # O[rows, tx + 16 c] += P @ V.
                            for j in T.serial(TK):
                                for i in T.unroll(RI):
                                    pv[i] = Ps[ty * RI + i, j]
                                for c in T.unroll(CD):
                                    vv[c] = Vs[j, c * TX + tx]
                                for i in T.unroll(RI):
                                    for c in T.unroll(CD):
                                        Ol[i, c] = Ol[i, c] + pv[i] * vv[c]
                        # Row sums: each lane summed its own keys (same running max in every lane).
                        for i in T.unroll(RI):
                            for sh in T.unroll(4):
                                lsum[i] = lsum[i] + shfl_xor(lsum[i], T.shift_right(8, sh))
                        for i in T.unroll(RI):
                            if ty * RI + i < TQ * G and T.truncdiv(ty * RI + i, G) < ntok:
                                if lsum[i] > T.float32(0):
                                    for c in T.unroll(CD):
                                        o[tok0 + T.truncdiv(ty * RI + i, G), h * G + T.truncmod(ty * RI + i, G),
                                          c * TX + tx] = T.Cast(dtype, Ol[i, c] / lsum[i])
                                    if tx == 0:
                                        lse[tok0 + T.truncdiv(ty * RI + i, G), h * G + T.truncmod(ty * RI + i, G)] = \
                                            m[i] + T.log2(lsum[i])
                                else:
                                    for c in T.unroll(CD):
                                        o[tok0 + T.truncdiv(ty * RI + i, G), h * G + T.truncmod(ty * RI + i, G),
                                          c * TX + tx] = T.Cast(dtype, T.float32(0))
                                    if tx == 0:
                                        lse[tok0 + T.truncdiv(ty * RI + i, G), h * G + T.truncmod(ty * RI + i, G)] = \
                                            T.float32(EMPTY_LSE)

        return kernel

    def rope_elem(x, partner, d, pos, rope_scale, invf):
        """Rotated element ``d`` (float32) from storage-dtype ``x`` and its partner (dim ``d +- D/2``)."""
        angle = rope_angle(pos, rope_scale, invf[T.truncmod(d, HALF)])
        sign = T.if_then_else(d < HALF, T.float32(-1), T.float32(1))
        return T.Cast("float32", x) * cos_approx(angle) + sign * T.Cast("float32", partner) * sin_approx(angle)

    if paged:
        def kv_len_of(kvb, b):
            _pages, _page_values, page_indptr, ps, last_page_len = kvb[0], kvb[1], kvb[2], kvb[3], kvb[4]
            return _kv_len(page_indptr, last_page_len, b, ps)
    else:
        def kv_len_of(kvb, b):
            kv_indptr = kvb[2]
            return kv_indptr[b + 1] - kv_indptr[b]

    return make_kernel(True), make_kernel(False)


def attn_prefill_ragged_cuda(num_qo_heads, num_kv_heads, head_dim, v_head_dim, dtype):
    """``pagedkv_attn_prefill_ragged`` for CUDA.

    Signature::

        (q[n,Hq,D], k[m,Hkv,D], v[m,Hkv,Dv], q_indptr[B+1], kv_indptr[B+1], q_pos[n],
         k_pos_offset[B], o[n,Hq,Dv], lse[n,Hq],
         causal:i32, apply_rope:i32, rope_scale:f32, rope_theta:f32, sm_scale:f32)
    """
    HQ, HKV, D, DV = num_qo_heads, num_kv_heads, head_dim, v_head_dim
    kernel_rope, kernel_plain = _make_prefill("attn_prefill_ragged", HQ, HKV, D, DV, dtype, paged=False)

    @T.prim_func
    def attn_prefill_ragged(q_h: T.handle, k_h: T.handle, v_h: T.handle, q_indptr_h: T.handle,
                            kv_indptr_h: T.handle, q_pos_h: T.handle, k_pos_offset_h: T.handle,
                            o_h: T.handle, lse_h: T.handle, causal: T.int32, apply_rope: T.int32,
                            rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"global_symbol": "pagedkv_attn_prefill_ragged", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        n, m, B = T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (n, HQ, D), dtype, elem_offset=T.int32())
        k = T.match_buffer(k_h, (m, HKV, D), dtype, elem_offset=T.int32())
        v = T.match_buffer(v_h, (m, HKV, DV), dtype, elem_offset=T.int32())
        q_indptr = T.match_buffer(q_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        kv_indptr = T.match_buffer(kv_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        q_pos = T.match_buffer(q_pos_h, (n,), "int32", elem_offset=T.int32())
        k_pos_offset = T.match_buffer(k_pos_offset_h, (B,), "int32", elem_offset=T.int32())
        o = T.match_buffer(o_h, (n, HQ, DV), dtype, elem_offset=T.int32())
        lse = T.match_buffer(lse_h, (n, HQ), "float32", elem_offset=T.int32())
        if apply_rope == 1:
            kernel_rope(q, q_indptr, q_pos, k_pos_offset, o, lse, (k, v, kv_indptr), B, n, causal,
                        rope_scale, rope_theta, sm_scale)
        else:
            kernel_plain(q, q_indptr, q_pos, k_pos_offset, o, lse, (k, v, kv_indptr), B, n, causal,
                         rope_scale, rope_theta, sm_scale)

    return attn_prefill_ragged


def attn_prefill_paged_cuda(num_qo_heads, num_kv_heads, head_dim, dtype):
    """``pagedkv_attn_prefill_paged`` for CUDA.

    Signature::

        (q[n,Hq,D], q_indptr[B+1], pages[P,2,Hkv,ps,D], page_indptr[B+1], page_values[nnz],
         last_page_len[B], k_pos_offset[B], q_pos[n], o[n,Hq,D], lse[n,Hq],
         causal:i32, apply_rope:i32, rope_scale:f32, rope_theta:f32, sm_scale:f32)
    """
    HQ, HKV, D = num_qo_heads, num_kv_heads, head_dim
    kernel_rope, kernel_plain = _make_prefill("attn_prefill_paged", HQ, HKV, D, D, dtype, paged=True)

    @T.prim_func
    def attn_prefill_paged(q_h: T.handle, q_indptr_h: T.handle, pages_h: T.handle, page_indptr_h: T.handle,
                           page_values_h: T.handle, last_page_len_h: T.handle, k_pos_offset_h: T.handle,
                           q_pos_h: T.handle, o_h: T.handle, lse_h: T.handle, causal: T.int32,
                           apply_rope: T.int32, rope_scale: T.float32, rope_theta: T.float32,
                           sm_scale: T.float32):
        T.func_attr({"global_symbol": "pagedkv_attn_prefill_paged", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        n, B, P, ps, nnz = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (n, HQ, D), dtype, elem_offset=T.int32())
        q_indptr = T.match_buffer(q_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        pages = T.match_buffer(pages_h, (P, 2, HKV, ps, D), dtype)
        page_indptr = T.match_buffer(page_indptr_h, (B + 1,), "int32", elem_offset=T.int32())
        page_values = T.match_buffer(page_values_h, (nnz,), "int32", elem_offset=T.int32())
        last_page_len = T.match_buffer(last_page_len_h, (B,), "int32", elem_offset=T.int32())
        k_pos_offset = T.match_buffer(k_pos_offset_h, (B,), "int32", elem_offset=T.int32())
        q_pos = T.match_buffer(q_pos_h, (n,), "int32", elem_offset=T.int32())
        o = T.match_buffer(o_h, (n, HQ, D), dtype, elem_offset=T.int32())
        lse = T.match_buffer(lse_h, (n, HQ), "float32", elem_offset=T.int32())
        if apply_rope == 1:
            kernel_rope(q, q_indptr, q_pos, k_pos_offset, o, lse,
                        (pages, page_values, page_indptr, ps, last_page_len), B, n, causal,
                        rope_scale, rope_theta, sm_scale)
        else:
            kernel_plain(q, q_indptr, q_pos, k_pos_offset, o, lse,
                         (pages, page_values, page_indptr, ps, last_page_len), B, n, causal,
                         rope_scale, rope_theta, sm_scale)

    return attn_prefill_paged
