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


def _rope_chunk(dst, src, kpos, rope_scale, invf, d0, vec, half):
    """Rotate chunk ``src[0:vec]`` (dims ``d0 ..``; ``src[vec:2vec]`` holds the partner chunk, dims
    ``d0 +- half``) into ``dst[0:vec]`` (float32 registers); ``invf[e]`` = divisor of dim ``d0 + e``."""
    raise NotImplementedError  # replaced by the macro below (kept for the docstring)


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
        for bx in T.thread_binding(T.max(B, 1), thread="blockIdx.x"):
            for h in T.thread_binding(HKV, thread="blockIdx.y"):
                for gz in T.thread_binding(NZ, thread="blockIdx.z"):
                    for ty in T.thread_binding(NW, thread="threadIdx.y"):
                        for tx in T.thread_binding(L, thread="threadIdx.x"):
                            Qr = T.alloc_buffer((GC, VEC), "float32", scope="local")
                            Orr = T.alloc_buffer((GC, VEC), "float32", scope="local")
                            m = T.alloc_buffer((GC,), "float32", scope="local")
                            lsum = T.alloc_buffer((GC,), "float32", scope="local")
                            Kr = T.alloc_buffer((KPT, 2 * VEC), dtype, scope="local")
                            Vr = T.alloc_buffer((KPT, VEC), dtype, scope="local")
                            Kf = T.alloc_buffer((KPT, VEC), "float32", scope="local")
                            S = T.alloc_buffer((KPT, GC), "float32", scope="local")
                            invf = T.alloc_buffer((VEC,), "float32", scope="local")
                            st = T.alloc_buffer((4,), "float32", scope="local")
                            red_ml = T.alloc_buffer((NW, GC, 2), "float32", scope="shared")
                            red_o = T.alloc_buffer((NW, GC, D), "float32", scope="shared.dyn")
                            b: T.let[T.int32] = T.min(bx, B - 1)
                            kvlen: T.let[T.int32] = _kv_len(page_indptr, last_page_len, b, ps)
                            pbase: T.let[T.int32] = page_indptr[b]
                            d0: T.let[T.int32] = tx * VEC
                            # The lane's dims and their RoPE divisors (dims d0 + e, pair index mod D/2).
                            if apply_rope == 1:
                                for e in T.unroll(VEC):
                                    invf[e] = rope_divisor(T.truncmod(d0 + e, HALF), rope_theta, D)
                            # q rows of this kv head, rotated and scaled by sm_scale * log2(e).
                            for g in T.unroll(GC):
                                for e in T.unroll(VEC):
                                    Qr[g, e] = T.float32(0)
                                    if tx < L0:
                                        if apply_rope == 1:
                                            # x' = x cos - x[d + D/2] sin (d < D/2); x cos + x[d - D/2] sin
                                            Qr[g, e] = T.Cast("float32", q[b, h * G + gz * GC + g, d0 + e]) * cos_approx(
                                                rope_angle(q_pos[b], rope_scale, invf[e])) + T.if_then_else(
                                                d0 < HALF,
                                                -T.Cast("float32", q[b, h * G + gz * GC + g, d0 + e + HALF]),
                                                T.Cast("float32", q[b, h * G + gz * GC + g, T.truncmod(d0 + e + HALF, D)])
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
                                        if apply_rope == 1:
                                            load_chunk(Kr, pages, pg, 0, h, T.truncmod(jc, ps),
                                                       T.truncmod(d0 + HALF, D), kk, VEC)
                                    else:
                                        for e in T.unroll(2 * VEC):
                                            Kr[kk, e] = T.Cast(dtype, 0)
                                        for e in T.unroll(VEC):
                                            Vr[kk, e] = T.Cast(dtype, 0)
                                # Keys to float32 (rotated at position k_pos_offset + j when inline RoPE).
                                for kk in T.unroll(KPT):
                                    for e in T.unroll(VEC):
                                        if apply_rope == 1:
                                            Kf[kk, e] = T.Cast("float32", Kr[kk, e]) * cos_approx(rope_angle(
                                                k_pos_offset[b] + it * TKB + ty * KPT + kk, rope_scale, invf[e])) + \
                                                T.if_then_else(d0 < HALF, -T.Cast("float32", Kr[kk, VEC + e]),
                                                               T.Cast("float32", Kr[kk, VEC + e])) * sin_approx(rope_angle(
                                                    k_pos_offset[b] + it * TKB + ty * KPT + kk, rope_scale, invf[e]))
                                        else:
                                            Kf[kk, e] = T.Cast("float32", Kr[kk, e])
                                # Partial dot products, folded over the L lanes of the group.
                                for kk in T.unroll(KPT):
                                    for g in T.unroll(GC):
                                        S[kk, g] = T.float32(0)
                                        for e in T.unroll(VEC):
                                            S[kk, g] = S[kk, g] + Qr[g, e] * Kf[kk, e]
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
                            T.tvm_storage_sync("shared")
                            for idx in T.serial(ceildiv(GC * D, NT)):
                                if idx * NT + ty * L + tx < GC * D:
                                    if bx < B:
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

    return attn_decode_paged
