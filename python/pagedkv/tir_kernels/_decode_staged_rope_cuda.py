"""Inline RoPE (``apply_rope == 1``) in the staged CUDA paged decode kernel (``_decode_staged_cuda``): the cache
holds unrotated keys, the kernel rotates q and k on the fly; its key loop scores with the plain kernel's
``score_tile``, unchanged.

The score of tile key ``o`` (position ``P + o``: ``P = k_pos_offset + t0`` the position of the tile's first key
``t0``, ``0 <= o < TK``) is ``<R(q_pos) q, R(P + o) k> = <R(q_pos - P) q, R(o) k>`` (``R(a)`` rotates each pair
``(x_j, x_{j + D/2})`` by ``a * w_j``; rotations compose and are orthogonal; ``_decode_rope_cuda`` uses the
same identity). So

* ``R(o) k``: ``cos / sin(o * w_j)`` depend on the key's offset in the tile and the pair only, so a table of
  them (``TK x D/2`` each, float32) is computed once per block (``rope_setup``: each entry once,
  cooperatively); each key is rotated **once per block, when its tile is staged** into shared memory
  (``stage_tile_rope``: the pairs in float32, 16-byte reads of the table, the rotated key rounded once to the
  storage dtype), so the ``G / R`` row threads that score a key read it rotated and the score, softmax and
  ``O += P V`` are the plain kernel's (run 9 rotated in the score, per key and row thread: 1.21x / 1.29x of
  plain at B = 1 x 32K / B = 64 x 4K). Rounding the rotated key to fp16 / bf16 costs one storage rounding,
  like the cache's own; float32 stays float32;
* ``R(q_pos - P) q``: the same for every key of a tile, so once per tile for the whole block: ``q_table``
  computes one ``rope_sincos`` per pair (not per thread, not per GQA row) and writes the group's ``G`` rows,
  rotated and scaled by ``sm_scale * log2(e)``, to a shared table, from which each thread loads its ``R`` rows
  (``load_q_table``). It runs between the two barriers the key loop already has per tile (the previous tile's
  readers are done after the first, the table is complete at the second).

Why the layout fits: with ``VEC == 2 * V16`` (``LANE_VECTORS = 2`` 16-byte vectors per lane) element
``u*V16 + e`` of lane ``tx`` is dim ``u*LW + tx*V16 + e`` with ``LW == D/2``, so the score's lane holds both dims
``j = tx*V16 + e`` and ``j + D/2`` of its pairs. The tile loads (``load_tile_pairs``) take the same layout per
chunk (the plain kernel's chunk is ``VEC`` contiguous dims), so the thread that stages a chunk holds both halves
of its pairs: rotating needs no shuffle, and the ``L0`` chunks of a key still read its whole row in 16-byte
vectors. Where that does not hold (``staged_rope_limits``) RoPE runs the lane-group kernel.

Shared memory: the key table lives in a float32 pool that the end-of-loop merge (``store_rows``' ``red_o``)
reuses (one extra barrier per block); the rotated-q table (``qtab``), the pair frequencies (``w_hi, w_lo``) and
the block's unrotated q rows (storage dtype, ``q_raw``) have their own buffers: TVM's barrier planner sees one
buffer per allocation, and a pool read (the key table, in the stage) and written (the q table) between the same
two barriers makes it ask for a barrier inside the stage's condition, which it cannot insert (a compile error).
Tables are lane-major (``lane_slot``): the 16-byte reads of consecutive lanes are consecutive (no bank
conflicts). The separate ``qtab`` costs ``G x D`` floats: float32 at group 8 x D 256 and 16 x 128 no longer fit
and run the lane-group kernel (float32 decode has no speed target).

Per thread and tile (fp16, 32 / 8 heads, D = 128: ``TK = 32``, 128 threads, two chunks each) the RoPE work is
two chunks of 8 pairs (4 float ops each, 4 16-byte table reads per chunk), the q table's load (``R x VEC``
floats) and, on the threads of one pair each, its ``rope_sincos``; ptxas: 128 registers, no spills (run 9's
kernel: 168).

Sin / cos are ``_sincos_cuda.rope_sincos`` (exact angle, ~2e-7 from float64 up to |angle| 2^21 rad): on key
offsets below ``TK`` and on ``q_pos - P``, a relative position.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._common import EMPTY_LSE, LOG2E
from ._common_cuda import itemsize, opaque_i32, paged_kv_len, split_chunk, vec16
from ._decode_staged_cuda import (
    STAGED_MAX_SMEM,
    StagedPlan,
    _layout,
    make_accumulate_tile,
    make_score_tile,
    make_softmax_tile,
    make_store_rows,
    staged_limits,
)
from ._sincos_cuda import rope_freq64_exp2, rope_freq_split, rope_sincos


def pool_floats(p: StagedPlan) -> int:
    """Floats of the shared pool: the merge's ``red_o`` (``NZ x G x D``) at the end, before that the key table
    (cos and sin, ``TK x D/2`` each)."""
    return max(p.nz * p.g * p.d, p.tk * p.d)


def rope_smem_bytes(p: StagedPlan) -> int:
    """Static shared memory of the RoPE kernel: K / V tile, ``red_ml``, the pool, the rotated-q table
    ``qtab`` (``G x D``), the frequencies ``w_s`` (``2 x D/2``) and ``q_raw`` (storage dtype)."""
    isz = itemsize(p.dtype)
    return 2 * p.tk * p.d * isz + p.nz * p.g * 2 * 4 + (pool_floats(p) + p.g * p.d + p.d) * 4 + p.g * p.d * isz


def staged_rope_limits(g: int, d: int, dtype: str) -> list[str]:
    """Why the staged kernel does not take this shape with inline RoPE (empty: it does): the plain limits,
    the pair layout (module docstring) and the shared memory with the RoPE tables."""
    why = staged_limits(g, d, dtype)
    if why:
        return why
    p = _layout(g, 1, d, dtype)
    if p.vec != 2 * vec16(dtype):
        why.append(f"head_dim {d} ({dtype}): {p.vec} elements per lane, not two 16-byte vectors, so a lane "
                   "does not hold both halves of its RoPE pairs")
    if rope_smem_bytes(p) > STAGED_MAX_SMEM:
        why.append(f"GQA group {g} at head_dim {d} needs {rope_smem_bytes(p)} bytes of shared memory with the "
                   f"RoPE tables (at most {STAGED_MAX_SMEM})")
    return why


def lane_slot(p: StagedPlan, dim):
    """Index of ``dim`` in a lane-major row: dim ``u*LW + tx*V16 + q*4 + e`` (``e < 4``) at
    ``((u*V16/4 + q) * L0 + tx) * 4 + e``, so lane ``tx`` reads its elements ``u*V16 + q*4 ..`` as one float4
    next to lane ``tx + 1``'s. A half row (``dim < D/2``) uses the ``u = 0`` slots only."""
    V16, L0, LW = vec16(p.dtype), p.l0, p.lw
    u, rem = T.truncdiv(dim, LW), T.truncmod(dim, LW)
    e = T.truncmod(rem, V16)
    return ((u * (V16 // 4) + T.truncdiv(e, 4)) * L0 + T.truncdiv(rem, V16)) * 4 + T.truncmod(e, 4)


def make_rope_setup(p: StagedPlan):
    """``rope_setup(cs, sn, w_s, q_raw, q, b, h, rope_theta, rope_scale, t)`` (once per block): the pair
    frequencies ``w_s`` and the block's unrotated q rows ``q_raw``, a barrier, then the key table
    ``cs / sn[o, lane_slot(j)] = cos / sin(o * w_j)``, each entry computed once by one thread. The key loop's
    first barrier orders the table before its first reader."""
    D, G, NT, TK, HALF = p.d, p.g, p.nt, p.tk, p.d // 2

    @T.macro
    def rope_setup(cs, sn, w_s, q_raw, q, b, h, rope_theta, rope_scale, t):
        wh = T.alloc_buffer((1,), "float32", scope="local")
        wl = T.alloc_buffer((1,), "float32", scope="local")
        for i in T.unroll((HALF + NT - 1) // NT):
            if i * NT + t < HALF:
                w64: T.let[T.float64] = rope_freq64_exp2(i * NT + t, rope_theta, rope_scale, D)
                w_s[0, i * NT + t] = rope_freq_split(w64)[0]
                w_s[1, i * NT + t] = rope_freq_split(w64)[1]
        for i in T.unroll((G * D + NT - 1) // NT):
            if i * NT + t < G * D:
                q_raw[T.truncdiv(i * NT + t, D), T.truncmod(i * NT + t, D)] = q[
                    b, h * G + T.truncdiv(i * NT + t, D), T.truncmod(i * NT + t, D)]
        T.tvm_storage_sync("shared")
        for i in T.serial((TK * HALF + NT - 1) // NT):
            if i * NT + t < TK * HALF:
                o: T.let[T.int32] = T.truncdiv(i * NT + t, HALF)
                j: T.let[T.int32] = T.truncmod(i * NT + t, HALF)
                rope_sincos(wh, wl, 0, o, w_s[0, j], w_s[1, j])
                cs[o, lane_slot(p, j)] = wh[0]
                sn[o, lane_slot(p, j)] = wl[0]

    return rope_setup


def make_q_table(p: StagedPlan):
    """``q_table(qtab, q_raw, w_s, rel, sm_scale, t)``: ``qtab[g] = R(rel) q[g] * sm_scale * log2(e)``
    (lane-major rows) for the tile whose first key is at ``q_pos - rel``: one ``rope_sincos`` per pair for the
    whole block, each rotating the pair in all ``G`` rows."""
    G, NT, HALF = p.g, p.nt, p.d // 2

    @T.macro
    def q_table(qtab, q_raw, w_s, rel, sm_scale, t):
        cs = T.alloc_buffer((1,), "float32", scope="local")
        sn = T.alloc_buffer((1,), "float32", scope="local")
        for i in T.unroll((HALF + NT - 1) // NT):
            if i * NT + t < HALF:
                j: T.let[T.int32] = i * NT + t
                rope_sincos(cs, sn, 0, rel, w_s[0, j], w_s[1, j])
                for g in T.unroll(G):
                    x: T.let[T.float32] = T.Cast("float32", q_raw[g, j]) * (sm_scale * T.float32(LOG2E))
                    y: T.let[T.float32] = T.Cast("float32", q_raw[g, HALF + j]) * (sm_scale * T.float32(LOG2E))
                    qtab[g, lane_slot(p, j)] = x * cs[0] - y * sn[0]
                    qtab[g, lane_slot(p, HALF + j)] = y * cs[0] + x * sn[0]

    return q_table


def make_load_q_table(p: StagedPlan):
    """``load_q_table(Qr, qtab, row0, tx)``: the lane's ``VEC`` elements of rows ``row0 + r`` of the rotated-q
    table (float4 shared loads; 0 on padding lanes)."""
    VEC, L0, R = p.vec, p.l0, p.r

    @T.macro
    def load_q_table(Qr, qtab, row0, tx):
        for r in T.unroll(R):
            if tx < L0:
                for u in T.unroll(VEC // 4):
                    for e in T.vectorized(4):
                        Qr[r, u * 4 + e] = qtab[row0 + r, (u * L0 + tx) * 4 + e]
            else:
                for e in T.unroll(VEC):
                    Qr[r, e] = T.float32(0)

    return load_q_table


def make_load_tile_pairs(p: StagedPlan):
    """``load_tile_pairs(Kst, Vst, pages, page_values, pbase, ps, h, t0, k1, t)``: ``load_tile`` of the plain
    kernel with each chunk in the lane layout: chunk ``c`` of a key holds dims ``u*LW + c*V16 + e`` (``u < 2``),
    both halves of the pairs ``j = c*V16 + e``, so that ``stage_tile_rope`` rotates them without a shuffle.
    Lanes ``c .. c + L0`` of a key still read its whole row (two 16-byte reads each)."""
    L0, NT, TK, C, LW = p.l0, p.nt, p.tk, p.loads, p.lw
    V16 = vec16(p.dtype)

    @T.macro
    def load_tile_pairs(Kst, Vst, pages, page_values, pbase, ps, h, t0, k1, t):
        for i in T.unroll(C):
            if i * NT + t < TK * L0:
                jc: T.let[T.int32] = T.min(t0 + T.truncdiv(i * NT + t, L0), k1 - 1)
                c0: T.let[T.int32] = T.truncmod(i * NT + t, L0) * V16
                pg: T.let[T.int32] = page_values[pbase + T.truncdiv(jc, ps)]
                for u in T.unroll(2):
                    for e in T.vectorized(V16):
                        Kst[i, u * V16 + e] = pages[pg, 0, h, T.truncmod(jc, ps), u * LW + c0 + e]
                for u in T.unroll(2):
                    for e in T.vectorized(V16):
                        Vst[i, u * V16 + e] = pages[pg, 1, h, T.truncmod(jc, ps), u * LW + c0 + e]

    return load_tile_pairs


def make_stage_tile_rope(p: StagedPlan):
    """``stage_tile_rope(Ks, Vs, Kst, Vst, cs, sn, kr, rc, rs, t)``: the registers of ``load_tile_pairs`` into
    the shared tile, each key rotated first by ``R(o)``, ``o`` its offset in the tile: pairs in float32 with the
    key table's cos / sin (16-byte reads), the rotated key rounded once to the storage dtype (``kr``); values
    as loaded. Each key of the tile is rotated once per block."""
    L0, NT, TK, C, LW = p.l0, p.nt, p.tk, p.loads, p.lw
    V16 = vec16(p.dtype)
    dtype = p.dtype

    @T.macro
    def stage_tile_rope(Ks, Vs, Kst, Vst, cs, sn, kr, rc, rs, t):
        for i in T.unroll(C):
            if i * NT + t < TK * L0:
                o: T.let[T.int32] = T.truncdiv(i * NT + t, L0)
                c: T.let[T.int32] = T.truncmod(i * NT + t, L0)
                for u in T.unroll(V16 // 4):
                    for e in T.vectorized(4):
                        rc[u * 4 + e] = cs[o, (u * L0 + c) * 4 + e]
                    for e in T.vectorized(4):
                        rs[u * 4 + e] = sn[o, (u * L0 + c) * 4 + e]
                for e in T.unroll(V16):
                    kx: T.let[T.float32] = T.Cast("float32", Kst[i, e])
                    ky: T.let[T.float32] = T.Cast("float32", Kst[i, V16 + e])
                    kr[e] = T.Cast(dtype, kx * rc[e] - ky * rs[e])
                    kr[V16 + e] = T.Cast(dtype, ky * rc[e] + kx * rs[e])
                for u in T.unroll(2):
                    for e in T.vectorized(V16):
                        Ks[o, u * LW + c * V16 + e] = kr[u * V16 + e]
                for u in T.unroll(2):
                    for e in T.vectorized(V16):
                        Vs[o, u * LW + c * V16 + e] = Vst[i, u * V16 + e]

    return stage_tile_rope


def make_rope_key_loop(p: StagedPlan, var):
    """``key_loop(regs, smem, pages, page_values, pbase, ps, h, k0, k1, rel0, sm_scale, t, tx, ty, tz)``: the
    plain key loop (``_decode_staged_cuda.make_key_loop``) with keys loaded in pairs and rotated as they are
    staged (``stage_tile_rope``) and the tile's rotated-q table written between the two barriers
    (``rel0 - it*TK``: ``q_pos`` minus the tile's first key position); the scores are the plain kernel's
    ``score_tile``. A last barrier before the store reuses the key table's shared memory."""
    TK, KZ, R = p.tk, p.kz, p.r
    load_tile, stage_tile, score_tile = make_load_tile_pairs(p), make_stage_tile_rope(p), make_score_tile(p)
    softmax_tile, accumulate_tile = make_softmax_tile(p, var), make_accumulate_tile(p)
    q_table, load_q_table = make_q_table(p), make_load_q_table(p)

    @T.macro
    def key_loop(regs, smem, pages, page_values, pbase, ps, h, k0, k1, rel0, sm_scale, t, tx, ty, tz):
        Qr, Or, ml, S_, st, Kst, Vst, kv, kf, rc, rs = regs
        Ks, Vs, cs, sn, qtab, w_s, q_raw = smem
        tiles: T.let[T.int32] = T.truncdiv(k1 - k0 + TK - 1, TK)
        if k0 < k1:
            load_tile(Kst, Vst, pages, page_values, pbase, ps, h, k0, k1, t)
        for it in T.serial(tiles):
            # Barriers: the previous tile's readers (K / V, q table) are done; this tile and its q table are in.
            T.tvm_storage_sync("shared")
            stage_tile(Ks, Vs, Kst, Vst, cs, sn, kv, rc, rs, t)
            q_table(qtab, q_raw, w_s, rel0 - it * TK, sm_scale, t)
            T.tvm_storage_sync("shared")
            if it + 1 < tiles:
                load_tile(Kst, Vst, pages, page_values, pbase, ps, h, k0 + (it + 1) * TK, k1, t)
            load_q_table(Qr, qtab, ty * R, tx)
            score_tile(S_, Qr, Ks, kv, kf, tx, tz)
            softmax_tile(S_, ml, Or, st, k0 + it * TK + tz * KZ, k1)
            accumulate_tile(Or, S_, Vs, kv, kf, tx, tz)
        T.tvm_storage_sync("shared")  # the store's red_o reuses the key table's pool

    return key_loop


def make_staged_rope_kernel(p: StagedPlan, var):
    """The staged decode kernel with inline RoPE as a macro (same arguments as the plain one): grid, registers,
    shared memory (the pool's views), the split's key range, setup, key loop and store. Key ``j`` of entry
    ``b`` is at position ``k_pos_offset[b] + j`` and the query at ``q_pos[b]``, as in the lane-group kernel."""
    L, G, NZ, TK, D, R, GT, VEC = p.l, p.g, p.nz, p.tk, p.d, p.r, p.gt, p.vec
    V16, HALF, POOL = vec16(p.dtype), p.d // 2, pool_floats(p)
    key_loop, store_rows, rope_setup = make_rope_key_loop(p, var), make_store_rows(p), make_rope_setup(p)

    @T.macro
    def kernel(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
               rope_scale, rope_theta, sm_scale, S, C, ws_o, ws_l):
        for bx in T.thread_binding(T.max(B, 1), thread="blockIdx.x"):
            for h in T.thread_binding(p.hkv, thread="blockIdx.y"):
                for sp in T.thread_binding(S, thread="blockIdx.z"):
                    for tz in T.thread_binding(NZ, thread="threadIdx.z"):
                        for ty in T.thread_binding(GT, thread="threadIdx.y"):
                            for tx in T.thread_binding(L, thread="threadIdx.x"):
                                Qr = T.alloc_buffer((R, VEC), "float32", scope="local")
                                Or = T.alloc_buffer((R, VEC), "float32", scope="local")
                                ml = T.alloc_buffer((R, 2), "float32", scope="local")
                                S_ = T.alloc_buffer((p.kz, R), "float32", scope="local")
                                st = T.alloc_buffer((2,), "float32", scope="local")
                                Kst = T.alloc_buffer((p.loads, VEC), p.dtype, scope="local")
                                Vst = T.alloc_buffer((p.loads, VEC), p.dtype, scope="local")
                                kv = T.alloc_buffer((VEC,), p.dtype, scope="local")
                                kf = T.alloc_buffer((VEC,), "float32", scope="local")
                                rc = T.alloc_buffer((V16,), "float32", scope="local")
                                rs = T.alloc_buffer((V16,), "float32", scope="local")
                                Ks = T.alloc_buffer((TK, D), p.dtype, scope="shared")
                                Vs = T.alloc_buffer((TK, D), p.dtype, scope="shared")
                                q_raw = T.alloc_buffer((G, D), p.dtype, scope="shared")
                                w_s = T.alloc_buffer((2, HALF), "float32", scope="shared")
                                red_ml = T.alloc_buffer((NZ, G, 2), "float32", scope="shared")
                                qtab = T.alloc_buffer((G, D), "float32", scope="shared")
                                pool = T.alloc_buffer((POOL,), "float32", scope="shared")
                                red_o = T.decl_buffer((NZ, G, D), "float32", data=pool.data, scope="shared")
                                cs = T.decl_buffer((TK, HALF), "float32", data=pool.data, scope="shared")
                                sn = T.decl_buffer((TK, HALF), "float32", data=pool.data, elem_offset=TK * HALF,
                                                   scope="shared")
                                if bx < B:
                                    t: T.let[T.int32] = (tz * GT + ty) * L + tx
                                    kvlen: T.let[T.int32] = paged_kv_len(page_indptr, last_page_len, bx, ps)
                                    Sk: T.let[T.int32] = opaque_i32(S)  # the split count, opaque in the kernel
                                    chunk: T.let[T.int32] = split_chunk(var, kvlen, Sk, opaque_i32(C), TK)
                                    k0: T.let[T.int32] = T.min(var.decode_key(kvlen, sp * chunk), kvlen)
                                    k1: T.let[T.int32] = T.min(k0 + chunk, kvlen)
                                    for r in T.unroll(R):
                                        for e in T.unroll(VEC):
                                            Or[r, e] = T.float32(0)
                                        ml[r, 0] = T.float32(EMPTY_LSE)
                                        ml[r, 1] = T.float32(0)
                                    rope_setup(cs, sn, w_s, q_raw, q, bx, h, rope_theta, rope_scale, t)
                                    key_loop((Qr, Or, ml, S_, st, Kst, Vst, kv, kf, rc, rs),
                                             (Ks, Vs, cs, sn, qtab, w_s, q_raw), pages, page_values,
                                             page_indptr[bx], ps, h, k0, k1,
                                             q_pos[bx] - k_pos_offset[bx] - k0, sm_scale, t, tx, ty, tz)
                                    store_rows(o, lse, ws_o, ws_l, red_ml, red_o, ml, Or, bx, h, sp, Sk, tx, ty,
                                               tz)

    return kernel


__all__ = ["lane_slot", "make_load_q_table", "make_load_tile_pairs", "make_q_table", "make_rope_key_loop",
           "make_rope_setup", "make_stage_tile_rope", "make_staged_rope_kernel", "pool_floats", "rope_smem_bytes",
           "staged_rope_limits"]
