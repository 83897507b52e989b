"""CUDA attention kernels: paged decode, paged prefill and ragged prefill.

Same ABI and semantics as ``attention_cpu.py`` (``docs/ARCHITECTURE.md``, "Kernel ABI"): base-2 LSE,
bottom-right causal, an empty row writes ``o = 0`` and ``lse = -1e30``, inline RoPE rotates q at its
position and key ``j`` of entry ``b`` at ``k_pos_offset[b] + j``, float32 accumulation. Scores are kept in
log2 units: ``sm_scale * log2(e)`` is folded into q when it is loaded. Each PrimFunc holds two kernels,
launched by a host-side branch on ``apply_rope``: the inline-RoPE one and a plain one that does not pay
the RoPE registers. All shared memory is static (< 48 KB; TVM 0.27 fails to merge our ``shared.dyn``
buffers), and no ``if`` around a barrier depends on the thread.

Decode (``attn_decode_paged``): one block per (entry, kv head, row chunk, key split), 128 threads
-------------------------------------------------------------------------------------------------
* A *lane group* of ``L`` threads splits the head dim: lane ``tx`` owns ``VEC`` dims (8 fp16 / 4 fp32:
  one 16-byte page load per K or V row); ``L = next_pow2(D / VEC)``, padding lanes hold zeros. Inline
  RoPE uses another lane layout: dims ``tx*VEC/2 + e`` and ``D/2 + tx*VEC/2 + e``, so a lane holds both
  elements of its rotation pairs and computes each angle once (dot products and P@V do not depend on
  the order of the dims). The block has ``NW = 128 / L`` lane groups.
* Every thread keeps ``GC`` query rows of its kv head in registers (``GC`` = the GQA group, or a divisor
  of it up to ``DECODE_MAX_ROWS``, the rest over ``blockIdx.z``), so a K/V row is loaded once per block
  and used for all its rows. Lane group ``w`` walks keys ``k0 + it*NW*KPT + w*KPT + kk`` (``KPT``
  consecutive keys, all loads issued before use); a score is a per-lane partial dot product folded
  with ``__shfl_xor_sync`` over the ``L`` lanes; keys past the range are clamped (valid memory) and
  masked.
* Each lane group runs its own online softmax (``m``, ``l``, ``O`` in registers, no barrier in the key
  loop); at the end the ``NW`` states are merged through shared memory (``red_o[NW, GC, D]``) and
  written coalesced.
* Split-KV: ``S`` key ranges per (entry, kv head) when ``B * Hkv`` blocks cannot fill the GPU and the
  entries are long (``_split_count``, on the host from the shapes). With ``S > 1`` the blocks write
  normalized partial (o, lse) to a float32 workspace and a second kernel merges them.

Prefill (``attn_prefill_ragged`` / ``attn_prefill_paged``): one block per (query tile, kv head)
----------------------------------------------------------------------------------------------
* 128 threads as 8 x 16 (``ty``, ``tx``). A query tile is ``TQ = R // G`` tokens x ``G`` heads = up to
  ``R`` *rows* (row ``r`` = token ``r // G``, head ``h*G + r % G``; ``R`` = 32, 16 for ``D > 128``), so
  a K/V tile is loaded once for the whole GQA group. Key tiles of ``TK`` = 32 (16 for ``D > 128``).
* Shared memory (float32): ``Qt[D, R]`` (q transposed, rotated, scaled) and one ``KV`` tile that holds
  the keys transposed (``Kt[d, j]``, rotated) for the scores, then the values (``Vs[j, d]``) for P@V.
* Scores: thread (ty, tx) computes rows ``RI*ty ..`` x keys ``KJ*tx ..`` (vector reads of ``Qt`` and
  ``Kt``); row max / sum over the 16 ``tx`` lanes of a half warp with shuffles; online softmax per row
  in registers; P@V: the thread owns rows ``RI*ty ..`` x dims ``tx, tx+16, ...`` and takes
  ``P[row, key]`` from the lane that computed it (``__shfl_sync``), so P never goes to memory.
* Per key tile: barrier, K tile, barrier, scores + softmax, barrier, V tile, barrier, P@V.
* Tiles past the tile's causal limit are skipped; partial tiles load zeros past the entry's keys and
  masks hide them (``T.if_then_else`` on ``key < limit(row)``).
* Grid: ``blockIdx.x`` = virtual tile ``v`` in ``[0, n // TQ + B)``; entry ``b`` owns virtual tiles
  ``[q_indptr[b] // TQ + b, q_indptr[b+1] // TQ + b + 1)`` (always at least ``ceil(qlen / TQ)`` of
  them); a block finds its entry by binary search and idles (zero-trip loops, masked accesses) when its
  tile is past the entry's queries. Within an entry the last query tile (most keys when causal) runs
  first.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from ._common import EMPTY_LSE, LOG2E, MASKED
from ._common_cuda import (
    WARP,
    ceildiv,
    check_head_dim,
    cos_approx,
    frcp_rn,
    next_pow2,
    rope_angle,
    rope_angle_rcp,
    rope_divisor,
    rotate,
    shfl_xor,
    sin_approx,
    vec16,
)


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
#: Query rows (of one kv head's GQA group) per decode block; a larger group is split over blockIdx.z
#: (H200, 64 q / 8 kv heads, D 128, B 64 x 4096 keys: 4 rows 0.62 ms, 8 rows 0.72 ms; B 16 x 2048:
#: 0.085 vs 0.140 ms). Each row chunk reads the kv head's K/V once (mostly from L2 for the second).
DECODE_MAX_ROWS = 4


def _decode_plan(g: int, d: int, dtype: str):
    vec = _pick_vec(d, dtype)
    lanes0 = d // vec
    lanes = next_pow2(lanes0)
    nw = max(1, DECODE_THREADS // lanes)
    # Row chunk (blockIdx.z splits the group): the largest divisor of G up to DECODE_MAX_ROWS, or the whole
    # group when that divisor would be tiny (G = 5, 7: rereading K/V G times costs more than the registers).
    gc = max(c for c in range(1, DECODE_MAX_ROWS + 1) if g % c == 0)
    if 2 * gc < g <= 8:
        gc = g
    # Keys per lane group and step: as many independent loads as the registers allow.
    per_key = 2 * vec * (2 if dtype == "float16" else 4) // 4 + gc
    kpt = 4
    while kpt > 1 and 2 * gc * vec + kpt * per_key > 160:
        kpt //= 2
    return vec, lanes0, lanes, nw, gc, kpt


def _split_count(B, nnz, ps, blocks_per_split):
    """Key splits per (entry, kv head) of the decode kernel, from shapes only (host side): enough blocks to
    fill the GPU (``DECODE_TARGET_BLOCKS``), each split at least ``DECODE_MIN_SPLIT_KEYS`` keys of an
    average entry, at most ``DECODE_MAX_SPLITS``."""
    want = T.truncdiv(DECODE_TARGET_BLOCKS + B * blocks_per_split - 1, T.max(B * blocks_per_split, 1))
    avg_keys = T.truncdiv(nnz * ps, T.max(B, 1))
    return T.max(1, T.min(T.min(want, T.truncdiv(avg_keys, DECODE_MIN_SPLIT_KEYS)), DECODE_MAX_SPLITS))


#: Split-KV policy of the decode kernel (see ``_split_count``): about two blocks per SM of an H100/H200.
DECODE_TARGET_BLOCKS = 264
DECODE_MIN_SPLIT_KEYS = 256
DECODE_MAX_SPLITS = 32


def attn_decode_paged_cuda(num_qo_heads, num_kv_heads, head_dim, dtype):
    """``pagedkv_attn_decode_paged`` for CUDA.

    Signature::

        (q[B,Hq,D], pages[P,2,Hkv,ps,D], page_indptr[B+1], page_values[nnz], last_page_len[B],
         k_pos_offset[B], q_pos[B], o[B,Hq,D], lse[B,Hq],
         apply_rope:i32, rope_scale:f32, rope_theta:f32, sm_scale:f32)

    Split-KV: when ``B * Hkv`` blocks cannot fill the GPU and the entries are long, each (entry, kv head)
    is split into ``S`` key ranges (``_split_count``, computed on the host from the shapes); the blocks
    write normalized partial states (o, lse) to a workspace and a second kernel merges them.
    """
    HQ, HKV, D = num_qo_heads, num_kv_heads, head_dim
    check_head_dim("attn_decode_paged", D)
    G = HQ // HKV
    VEC, L0, L, NW, GC, KPT_PLAIN = _decode_plan(G, D, dtype)
    NZ = G // GC
    HALF = D // 2
    V16 = min(VEC, vec16(dtype))
    NT = L * NW
    SHIFTS = len([L >> (s + 1) for s in range(int(math.log2(L)))])
    MT = 128  # threads of the merge kernel

    H2 = VEC // 2
    V16H = min(H2, vec16(dtype))

    @T.macro
    def load_chunk(dst, pages, pg, c, h, off, d0, kk, base):
        """``dst[kk, base + e] = pages[pg, c, h, off, d0 + e]`` for ``e < VEC`` (16-byte loads)."""
        for u in T.unroll(VEC // V16):
            for e in T.vectorized(V16):
                dst[kk, base + u * V16 + e] = pages[pg, c, h, off, d0 + u * V16 + e]

    @T.macro
    def load_halves(dst, pages, pg, c, h, off, d0h, kk):
        """RoPE lane layout: ``dst[kk, e] = row[d0h + e]``, ``dst[kk, H2 + e] = row[D/2 + d0h + e]``
        (``e < VEC/2``): a lane holds both elements of each of its rotation pairs."""
        for u in T.unroll(H2 // V16H):
            for e in T.vectorized(V16H):
                dst[kk, u * V16H + e] = pages[pg, c, h, off, d0h + u * V16H + e]
        for u in T.unroll(H2 // V16H):
            for e in T.vectorized(V16H):
                dst[kk, H2 + u * V16H + e] = pages[pg, c, h, off, HALF + d0h + u * V16H + e]

    def make_kernel(ROPE: bool):
        # Inline RoPE is compute-bound: fewer keys in flight, fewer registers.
        KPT = KPT_PLAIN if not ROPE else max(1, KPT_PLAIN // 2)
        TKB = NW * KPT  # keys per block step

        @T.macro
        def kernel(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                   rope_scale, rope_theta, sm_scale, S, ws_o, ws_l):
            for bx in T.thread_binding(T.max(B, 1), thread="blockIdx.x"):
                for h in T.thread_binding(HKV, thread="blockIdx.y"):
                    for zs in T.thread_binding(NZ * S, thread="blockIdx.z"):
                        for ty in T.thread_binding(NW, thread="threadIdx.y"):
                            for tx in T.thread_binding(L, thread="threadIdx.x"):
                                Qr = T.alloc_buffer((GC, VEC), "float32", scope="local")
                                Orr = T.alloc_buffer((GC, VEC), "float32", scope="local")
                                m = T.alloc_buffer((GC,), "float32", scope="local")
                                lsum = T.alloc_buffer((GC,), "float32", scope="local")
                                Kr = T.alloc_buffer((KPT, VEC), dtype, scope="local")
                                Vr = T.alloc_buffer((KPT, VEC), dtype, scope="local")
                                Kf = T.alloc_buffer((KPT, VEC) if ROPE else (1,), "float32", scope="local")
                                S_ = T.alloc_buffer((KPT, GC), "float32", scope="local")
                                invf = T.alloc_buffer((H2,), "float32", scope="local")
                                rcpf = T.alloc_buffer((H2,), "float32", scope="local")
                                st = T.alloc_buffer((4,), "float32", scope="local")
                                red_ml = T.alloc_buffer((NW, GC, 2), "float32", scope="shared")
                                red_o = T.alloc_buffer((NW, GC, D), "float32", scope="shared")
                                if bx < B:
                                    b: T.let[T.int32] = bx
                                    gz: T.let[T.int32] = T.truncdiv(zs, S)
                                    sp: T.let[T.int32] = T.truncmod(zs, S)
                                    kvlen: T.let[T.int32] = _kv_len(page_indptr, last_page_len, b, ps)
                                    # This split's keys: [k0, k1), chunks a multiple of the block step.
                                    chunk: T.let[T.int32] = T.truncdiv(T.truncdiv(kvlen + S - 1, S) + TKB - 1, TKB) * TKB
                                    k0: T.let[T.int32] = T.min(sp * chunk, kvlen)
                                    k1: T.let[T.int32] = T.min(k0 + chunk, kvlen)
                                    pbase: T.let[T.int32] = page_indptr[b]
                                    # Lane dims: plain, d0 + e (one 16-byte chunk); inline RoPE, d0h + e and
                                    # D/2 + d0h + e for e < VEC/2 (both elements of its rotation pairs, so
                                    # each angle is computed once). q.k and P@V do not depend on the order.
                                    d0: T.let[T.int32] = tx * VEC
                                    d0h: T.let[T.int32] = tx * H2
                                    if ROPE:
                                        for e in T.unroll(H2):
                                            invf[e] = rope_divisor(d0h + e, rope_theta, D)
                                            rcpf[e] = frcp_rn(invf[e])
                                    # q rows of this kv head, rotated and scaled by sm_scale * log2(e).
                                    for g in T.unroll(GC):
                                        for e in T.unroll(VEC):
                                            Qr[g, e] = T.float32(0)
                                            Orr[g, e] = T.float32(0)
                                        if tx < L0:
                                            if ROPE:
                                                for e in T.unroll(H2):
                                                    xlo: T.let[T.float32] = T.Cast("float32", q[b, h * G + gz * GC + g, d0h + e])
                                                    xhi: T.let[T.float32] = T.Cast("float32", q[b, h * G + gz * GC + g, HALF + d0h + e])
                                                    ang: T.let[T.float32] = rope_angle_rcp(q_pos[b], rope_scale, invf[e], rcpf[e])
                                                    Qr[g, e] = rotate(xlo, xhi, True, ang)
                                                    Qr[g, H2 + e] = rotate(xhi, xlo, False, ang)
                                            else:
                                                for e in T.unroll(VEC):
                                                    Qr[g, e] = T.Cast("float32", q[b, h * G + gz * GC + g, d0 + e])
                                            for e in T.unroll(VEC):
                                                Qr[g, e] = Qr[g, e] * (sm_scale * T.float32(LOG2E))
                                        m[g] = T.float32(EMPTY_LSE)
                                        lsum[g] = T.float32(0)
                                    for it in T.serial(T.truncdiv(k1 - k0 + TKB - 1, TKB)):
                                        # Issue every load of the step first (KPT keys, K and V); keys past the
                                        # split are clamped to its last key (valid memory) and masked below.
                                        for kk in T.unroll(KPT):
                                            jc: T.let[T.int32] = T.min(k0 + it * TKB + ty * KPT + kk, k1 - 1)
                                            pg: T.let[T.int32] = page_values[pbase + T.truncdiv(jc, ps)]
                                            if tx < L0:
                                                if ROPE:
                                                    load_halves(Kr, pages, pg, 0, h, T.truncmod(jc, ps), d0h, kk)
                                                    load_halves(Vr, pages, pg, 1, h, T.truncmod(jc, ps), d0h, kk)
                                                else:
                                                    load_chunk(Kr, pages, pg, 0, h, T.truncmod(jc, ps), d0, kk, 0)
                                                    load_chunk(Vr, pages, pg, 1, h, T.truncmod(jc, ps), d0, kk, 0)
                                            else:
                                                for e in T.unroll(VEC):
                                                    Kr[kk, e] = T.Cast(dtype, 0)
                                                for e in T.unroll(VEC):
                                                    Vr[kk, e] = T.Cast(dtype, 0)
                                        # Partial dot products (keys rotated at position k_pos_offset + j
                                        # when inline RoPE), folded over the L lanes of the group.
                                        if ROPE:
                                            for kk in T.unroll(KPT):
                                                for e in T.unroll(H2):
                                                    Kf[kk, e] = rotate(
                                                        Kr[kk, e], Kr[kk, H2 + e], True,
                                                        rope_angle_rcp(k_pos_offset[b] + k0 + it * TKB + ty * KPT + kk,
                                                                       rope_scale, invf[e], rcpf[e]))
                                                    Kf[kk, H2 + e] = rotate(
                                                        Kr[kk, H2 + e], Kr[kk, e], False,
                                                        rope_angle_rcp(k_pos_offset[b] + k0 + it * TKB + ty * KPT + kk,
                                                                       rope_scale, invf[e], rcpf[e]))
                                            for kk in T.unroll(KPT):
                                                for g in T.unroll(GC):
                                                    S_[kk, g] = T.float32(0)
                                                    for e in T.unroll(VEC):
                                                        S_[kk, g] = S_[kk, g] + Qr[g, e] * Kf[kk, e]
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
                                        # Online softmax of this lane group (keys past the split are masked).
                                        for g in T.unroll(GC):
                                            st[0] = m[g]
                                            for kk in T.unroll(KPT):
                                                S_[kk, g] = T.if_then_else(k0 + it * TKB + ty * KPT + kk < k1, S_[kk, g],
                                                                           T.float32(MASKED))
                                                st[0] = T.max(st[0], S_[kk, g])
                                            st[1] = T.exp2(m[g] - st[0])
                                            m[g] = st[0]
                                            lsum[g] = lsum[g] * st[1]
                                            for e in T.unroll(VEC):
                                                Orr[g, e] = Orr[g, e] * st[1]
                                            for kk in T.unroll(KPT):
                                                st[2] = T.exp2(S_[kk, g] - st[0])
                                                lsum[g] = lsum[g] + st[2]
                                                for e in T.unroll(VEC):
                                                    Orr[g, e] = Orr[g, e] + st[2] * T.Cast("float32", Vr[kk, e])
                                    # Merge the NW lane-group states through shared memory.
                                    for g in T.unroll(GC):
                                        if tx == 0:
                                            red_ml[ty, g, 0] = m[g]
                                            red_ml[ty, g, 1] = lsum[g]
                                        if tx < L0:
                                            if ROPE:
                                                for e in T.unroll(H2):
                                                    red_o[ty, g, d0h + e] = Orr[g, e]
                                                    red_o[ty, g, HALF + d0h + e] = Orr[g, H2 + e]
                                            else:
                                                for u in T.unroll(VEC // 4):
                                                    for e in T.vectorized(4):
                                                        red_o[ty, g, d0 + u * 4 + e] = Orr[g, u * 4 + e]
                                    T.tvm_storage_sync("shared")
                                    for idx in T.serial(ceildiv(GC * D, NT)):
                                        if idx * NT + ty * L + tx < GC * D:
                                            gg: T.let[T.int32] = T.truncdiv(idx * NT + ty * L + tx, D)
                                            dd: T.let[T.int32] = T.truncmod(idx * NT + ty * L + tx, D)
                                            hq: T.let[T.int32] = h * G + gz * GC + gg
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
                                            if S == 1:
                                                if st[1] > T.float32(0):
                                                    o[b, hq, dd] = T.Cast(dtype, st[2] / st[1])
                                                    if dd == 0:
                                                        lse[b, hq] = st[0] + T.log2(st[1])
                                                else:
                                                    o[b, hq, dd] = T.Cast(dtype, T.float32(0))
                                                    if dd == 0:
                                                        lse[b, hq] = T.float32(EMPTY_LSE)
                                            else:
                                                # Partial state of split sp (float32 workspace).
                                                if st[1] > T.float32(0):
                                                    ws_o[(b * HQ + hq) * S + sp, dd] = st[2] / st[1]
                                                    if dd == 0:
                                                        ws_l[(b * HQ + hq) * S + sp] = st[0] + T.log2(st[1])
                                                else:
                                                    ws_o[(b * HQ + hq) * S + sp, dd] = T.float32(0)
                                                    if dd == 0:
                                                        ws_l[(b * HQ + hq) * S + sp] = T.float32(EMPTY_LSE)

        return kernel

    @T.macro
    def merge_splits(o, lse, B, S, ws_o, ws_l):
        """o, lse of every (entry, q head) row from its S partial states (base-2 lse merge)."""
        for row in T.thread_binding(T.max(B, 1) * HQ, thread="blockIdx.x"):
            for t in T.thread_binding(MT, thread="threadIdx.x"):
                ms = T.alloc_buffer((3,), "float32", scope="local")
                if row < B * HQ:
                    ms[0] = T.float32(EMPTY_LSE)
                    for sp in T.serial(S):
                        ms[0] = T.max(ms[0], ws_l[row * S + sp])
                    ms[1] = T.float32(0)
                    for sp in T.serial(S):
                        ms[1] = ms[1] + T.exp2(ws_l[row * S + sp] - ms[0])
                    for c in T.serial(ceildiv(D, MT)):
                        if c * MT + t < D:
                            ms[2] = T.float32(0)
                            for sp in T.serial(S):
                                ms[2] = ms[2] + ws_o[row * S + sp, c * MT + t] * T.exp2(ws_l[row * S + sp] - ms[0])
                            o[T.truncdiv(row, HQ), T.truncmod(row, HQ), c * MT + t] = T.Cast(dtype, ms[2] / ms[1])
                    if t == 0:
                        # All splits empty: lse = -1e30 + log2(S) == -1e30 in float32, o = 0.
                        lse[T.truncdiv(row, HQ), T.truncmod(row, HQ)] = ms[0] + T.log2(ms[1])

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
        S: T.let[T.int32] = _split_count(B, nnz, ps, HKV * NZ)
        # Split partial states (float32); only touched when S > 1.
        ws_o = T.alloc_buffer((T.max(B, 1) * HQ * S, D), "float32")
        ws_l = T.alloc_buffer((T.max(B, 1) * HQ * S,), "float32")
        # Two kernels: inline RoPE costs registers that the plain kernel does not pay for.
        if apply_rope == 1:
            kernel_rope(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                        rope_scale, rope_theta, sm_scale, S, ws_o, ws_l)
        else:
            kernel_plain(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
                         rope_scale, rope_theta, sm_scale, S, ws_o, ws_l)
        if S > 1:
            merge_splits(o, lse, B, S, ws_o, ws_l)

    return attn_decode_paged


# ---------------------------------------------------------------------------------------------------
# prefill (ragged and paged)
# ---------------------------------------------------------------------------------------------------
#: Prefill block: 8 row groups x 16 lanes (128 threads).
PF_TY, PF_TX = 8, 16
PF_NT = PF_TY * PF_TX


def _chunk_vec(d: int, dtype: str, rope_partner: bool) -> int:
    """Elements per global-memory chunk (16 bytes when possible; a divisor of ``d`` and, for the RoPE
    partner chunk, of ``d / 2``)."""
    vec = vec16(dtype)
    while d % vec or (rope_partner and (d // 2) % vec):
        vec //= 2
    return vec


def _prefill_plan(op: str, g: int, d: int, dv: int, dtype: str):
    """Tile sizes: ``RI`` rows and ``KJ`` keys per thread; 48 KB of static shared memory at most."""
    check_head_dim(op, d)
    check_head_dim(op, dv, "v_head_dim")
    if max(d, dv) > 256:
        raise NotImplementedError(f"pagedkv.tir_kernels: the CUDA {op!r} kernel supports head dims up to 256, "
                                  f"got head_dim={d}, v_head_dim={dv}")
    ri, kj = (4, 2) if max(d, dv) <= 128 else (2, 1)
    rows = PF_TY * ri
    if g > rows:
        raise NotImplementedError(f"pagedkv.tir_kernels: the CUDA {op!r} kernel supports GQA groups up to "
                                  f"{rows} for head_dim={d}, got {g}")
    return {"RI": ri, "KJ": kj, "R": rows, "TK": PF_TX * kj, "TQ": rows // g,
            "VEC": _chunk_vec(d, dtype, True), "VECV": _chunk_vec(dv, dtype, False)}


def _shfl_idx(value, lane):
    """``__shfl_sync(full, value, lane, 16)``: lane ``lane`` of the caller's 16-lane half warp."""
    return T.call_extern("float32", "__shfl_sync", T.uint32(0xFFFFFFFF), value, lane, PF_TX)


def _make_prefill(op: str, num_qo_heads, num_kv_heads, head_dim, v_head_dim, dtype, paged: bool):
    """The (rope, plain) kernel macros of a prefill PrimFunc: ``paged`` selects the K/V source."""
    HQ, HKV, D, DV = num_qo_heads, num_kv_heads, head_dim, v_head_dim
    G = HQ // HKV
    plan = _prefill_plan(op, G, D, DV, dtype)
    RI, KJ, R, TK, TQ, VEC, VECV = (plan[k] for k in ("RI", "KJ", "R", "TK", "TQ", "VEC", "VECV"))
    NT, TX = PF_NT, PF_TX
    HALF = D // 2
    CQ = D // VEC  # chunks of a q / k row
    CV = DV // VECV  # chunks of a v row
    CD = DV // TX  # output dims per thread
    KVSZ = max(D * TK, TK * DV)
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

    def rope_elem(x, partner, d, pos, rope_scale, invf):
        """Rotated element ``d`` (float32) from storage-dtype ``x`` and its partner (dim ``d +- D/2``)."""
        angle = rope_angle(pos, rope_scale, invf[T.truncmod(d, HALF)])
        sign = T.if_then_else(d < HALF, T.float32(-1), T.float32(1))
        return T.Cast("float32", x) * cos_approx(angle) + sign * T.Cast("float32", partner) * sin_approx(angle)

    if paged:
        def kv_len_of(kvb, b):
            return _kv_len(kvb[2], kvb[4], b, kvb[3])
    else:
        def kv_len_of(kvb, b):
            return kvb[2][b + 1] - kvb[2][b]

    def make_kernel(ROPE: bool):
        @T.macro
        def kernel(q, q_indptr, q_pos, k_pos_offset, o, lse, kvb, B, n, causal, rope_scale, rope_theta,
                   sm_scale):
            for vt in T.thread_binding(T.max(n // TQ + B, 1), thread="blockIdx.x"):
                for h in T.thread_binding(HKV, thread="blockIdx.y"):
                    for tid in T.thread_binding(NT, thread="threadIdx.x"):
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
                        lim = T.alloc_buffer((RI,), "int32", scope="local")
                        st = T.alloc_buffer((2,), "float32", scope="local")
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
                        # Keys any row of the tile sees (causal: the last token's limit).
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
                            # The previous tile's PV is done with KV (and, first time, Qt is written).
                            T.tvm_storage_sync("shared")
                            # K tile, transposed into KV: Kt[d, j] = KV[d * TK + j] (thread per key).
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
                                                KV[(c * VEC + e) * TK + j] = rope_elem(
                                                    xr[e], xr[VEC + e], c * VEC + e,
                                                    k_pos_offset[b] + kt * TK + j, rope_scale, invf)
                                        else:
                                            for e in T.unroll(VEC):
                                                KV[(c * VEC + e) * TK + j] = T.Cast("float32", xr[e])
                                    else:
                                        for e in T.unroll(VEC):
                                            KV[(c * VEC + e) * TK + j] = T.float32(0)
                            T.tvm_storage_sync("shared")
                            # Scores of rows RI*ty.. x keys KJ*tx.. (log2 units: q is pre-scaled).
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
                            # Online softmax per row (max over the 16 lanes of the row); acc becomes P.
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
                            # Everyone is done reading Kt: V tile into KV, row-major Vs[j, d] = KV[j * DV + d].
                            T.tvm_storage_sync("shared")
                            for it in T.serial(ceildiv(TK * CV, NT)):
                                if it * NT + tid < TK * CV:
                                    j: T.let[T.int32] = T.truncdiv(it * NT + tid, CV)
                                    c: T.let[T.int32] = T.truncmod(it * NT + tid, CV)
                                    if kt * TK + j < kv_end:
                                        load_row_chunk(vr, 0, kvb, 1, b, kt * TK + j, c * VECV, h, VECV, V16V)
                                        for e in T.unroll(VECV):
                                            KV[j * DV + c * VECV + e] = T.Cast("float32", vr[e])
                                    else:
                                        for e in T.unroll(VECV):
                                            KV[j * DV + c * VECV + e] = T.float32(0)
                            T.tvm_storage_sync("shared")
                            # O[rows, tx + 16 c] += P @ V; P[row, key] comes from the lane that owns the key.
                            for sl in T.unroll(TX):
                                for kk in T.unroll(KJ):
                                    for i in T.unroll(RI):
                                        pv[i] = _shfl_idx(acc[i, kk], sl)
                                    for c in T.unroll(CD):
                                        vv[c] = KV[(sl * KJ + kk) * DV + c * TX + tx]
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
        # Two kernels: inline RoPE costs registers that the plain kernel does not pay for.
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
