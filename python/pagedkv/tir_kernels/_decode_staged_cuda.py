"""The staged CUDA paged decode kernel: K/V tiles through shared memory, read once per block and shared by every
q head of the kv head's GQA group (plain, ``apply_rope == 0``, here; inline RoPE reuses these stages in
``_decode_staged_rope_cuda``).

Why (H200, 4.25 TB/s copy roof): the lane-group kernel (``_decode_stages_cuda``) keeps ``GC`` q rows per
thread and splits a group of 8 over two blocks, so group 8 reads each K/V byte twice (0.41x FlashInfer);
its loads are issued per lane group and consumed at once, so a block has one step of keys in flight and
nothing while it computes. Here

* a block is one (entry, kv head, key split): ``L`` lanes (``threadIdx.x``, ``VEC`` dims each) x ``G / R``
  row threads (``threadIdx.y``, ``R`` of the group's rows each, ``_rows_per_thread``) x ``NZ`` key groups
  (``threadIdx.z``); each K/V byte of the split is read from DRAM once, with 16-byte loads (``LDG.E.128``),
  by all ``NT`` threads cooperatively;
* the block walks its keys in tiles of ``TK`` keys (16 KB of K + V): tile ``i + 1`` is loaded into registers
  while tile ``i`` is scored from shared memory (register double buffering), so each block keeps 16 KB of
  loads in flight through its compute; at 3-5 blocks per SM that is 48-80 KB per SM, above the ~30 KB that
  Little's law asks for at 32 B/ns per SM and ~1 us loaded latency;
* thread (x, y, z) scores its rows ``y*R + r`` against the tile's keys ``z*KZ + kk`` (``KZ = TK / NZ``): a
  partial dot of its ``VEC`` dims (each shared element read and converted once for the ``R`` rows), summed
  over the ``L`` lanes by shuffles; online softmax and ``O += P V`` per thread and row;
* the ``NZ`` key-group states are merged through shared memory at the end (``store``).

Limits (``staged_limits``): ``head_dim % 16 == 0`` with at most 32 lanes per row, ``G / R * L <= 512``
threads, 48 KB of static shared memory; dtypes float16 / bfloat16 / float32. Inline RoPE adds its own
(``_decode_staged_rope_cuda.staged_rope_limits``: two 16-byte vectors per lane, the RoPE tables' shared memory);
where they refuse, RoPE runs the lane-group kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from ._common import EMPTY_LSE, LOG2E
from ._common_cuda import WARP, itemsize, next_pow2, opaque_i32, paged_kv_len, shfl_xor, split_chunk, vec16
from ._epilogue_cuda import make_merged_rows

#: Bytes of K + V per block tile (the loads each block keeps in flight while it computes).
TILE_BYTES = 16384
#: Threads per block aimed at (more key groups when the group is small).
STAGED_THREADS = 128
#: Most threads of the group's rows (``G / R * L``), so that a block fits registers.
STAGED_MAX_ROW_THREADS = 512
#: 16-byte vectors per lane and K / V row (``_lane_vec``): 8 lanes per fp16 row of 128 dims.
LANE_VECTORS = 2
#: Most q rows per thread (``_rows_per_thread``).
STAGED_MAX_ROWS = 4
#: Most q elements per thread (``R * VEC``; ``_rows_per_thread``).
STAGED_ROW_FLOATS = 32
#: Static shared memory of a block (CUDA's limit without an opt-in; see ``_common_cuda``).
STAGED_MAX_SMEM = 48 * 1024


@dataclass(frozen=True)
class StagedPlan:
    """Compile-time layout of the staged decode kernel (``staged_plan`` picks it)."""

    hq: int
    hkv: int
    d: int
    dtype: str
    #: dims per lane, lanes holding dims, lanes per row (a power of 2), key groups, keys per tile, q rows
    #: per thread
    vec: int
    l0: int
    l: int
    nz: int
    tk: int
    r: int

    @property
    def g(self) -> int:
        return self.hq // self.hkv

    @property
    def gt(self) -> int:
        """Row threads (``threadIdx.y``): each holds ``R`` of the group's rows."""
        return self.g // self.r

    @property
    def nt(self) -> int:
        return self.l * self.gt * self.nz

    @property
    def kz(self) -> int:
        """Keys of a tile per key group."""
        return self.tk // self.nz

    @property
    def loads(self) -> int:
        """Cooperative ``VEC``-element loads per thread and tile (for K, and again for V)."""
        return -(-self.tk * self.l0 // self.nt)

    @property
    def shifts(self) -> int:
        return self.l.bit_length() - 1

    @property
    def lw(self) -> int:
        """Lane dim layout: element ``u*V16 + e`` of lane ``tx`` is dim ``u*LW + tx*V16 + e`` (``LW = L0*V16``,
        ``V16`` the elements of 16 bytes), so that the lanes' 16-byte shared reads of a row are contiguous."""
        return self.l0 * min(self.vec, vec16(self.dtype))

    @property
    def smem_bytes(self) -> int:
        """Static shared memory: the K and V tile, the key groups' states (``store_rows``)."""
        return 2 * self.tk * self.d * itemsize(self.dtype) + self.nz * self.g * (self.d + 2) * 4


def staged_limits(g: int, d: int, dtype: str) -> list[str]:
    """Why the staged kernel does not take this shape (empty: it does)."""
    if d % 16 or d <= 0:
        return [f"head_dim {d} is not a multiple of 16"]
    if _lane_vec(d, dtype) is None:
        return [f"no split of head_dim {d} over at most {WARP} lanes"]
    p = _layout(g, 1, d, dtype)
    out = []
    if p.gt * p.l > STAGED_MAX_ROW_THREADS:
        out.append(f"GQA group {g} ({p.r} rows per thread) x {p.l} lanes exceeds {STAGED_MAX_ROW_THREADS} "
                   "threads")
    if p.smem_bytes > STAGED_MAX_SMEM:
        out.append(f"GQA group {g} at head_dim {d} needs {p.smem_bytes} bytes of shared memory (at most "
                   f"{STAGED_MAX_SMEM})")
    return out


def _rows_per_thread(g: int, vec: int) -> int:
    """q rows per thread: the largest divisor of ``G`` up to ``max(2, G / 2)`` and ``STAGED_MAX_ROWS``
    (G = 4: 2, G = 8: 4, G = 3, 7: 1). A thread reads and converts each K / V element it takes from shared
    memory once for all its rows: at one row per thread, group 8's shared loads, conversions and shuffles
    alone exceed the issue slots that the memory roof leaves; more rows cost registers (fp16, D = 128:
    R = 2 fits 128 registers, 4 blocks per SM; R = 4 about 168, 3 blocks), so ``R * VEC`` stays within
    ``STAGED_ROW_FLOATS`` (q and o of the rows: twice that many registers)."""
    top = min(STAGED_MAX_ROWS, max(2, g // 2), max(1, STAGED_ROW_FLOATS // vec))
    return max(r for r in range(1, top + 1) if g % r == 0)


def _lane_vec(d: int, dtype: str):
    """Elements per lane: ``LANE_VECTORS`` 16-byte vectors where the head dim splits so, more past 32 lanes.
    Fewer lanes per row: fewer shuffle steps per score and fewer lanes repeating each row's softmax."""
    vec = vec16(dtype) * LANE_VECTORS if d % (vec16(dtype) * LANE_VECTORS) == 0 else vec16(dtype)
    while vec <= d and (d % vec or d // vec > WARP):
        vec *= 2
    return vec if vec <= d and not d % vec else None


def _layout(hq: int, hkv: int, d: int, dtype: str) -> StagedPlan:
    """The plan, unchecked (``staged_plan`` checks it)."""
    g = hq // hkv
    vec = _lane_vec(d, dtype)
    rows = _rows_per_thread(g, vec)
    l0 = d // vec
    lanes = next_pow2(l0)
    # Key groups: about STAGED_THREADS threads, and whole warps (the shuffles name all 32 lanes).
    nz = 1
    while lanes * (g // rows) * nz < STAGED_THREADS or (lanes * (g // rows) * nz) % WARP:
        nz *= 2
    tk = 1
    while 2 * tk * 2 * d * itemsize(dtype) <= TILE_BYTES:
        tk *= 2
    return StagedPlan(hq, hkv, d, dtype, vec, l0, lanes, nz, max(tk, nz), rows)


def staged_plan(hq: int, hkv: int, d: int, dtype: str) -> StagedPlan:
    """The plan for a shape; raises ``NotImplementedError`` naming the limit it breaks."""
    why = staged_limits(hq // hkv, d, dtype)
    if why:
        raise NotImplementedError("pagedkv.tir_kernels: the staged CUDA decode kernel: " + "; ".join(why))
    return _layout(hq, hkv, d, dtype)


def make_load_tile(p: StagedPlan):
    """``load_tile(Kst, Vst, pages, page_values, pbase, ps, h, t0, k1, t)``: thread ``t``'s share of the K and
    V rows of the tile's keys ``t0 ..`` (load ``i``: flat chunk ``i*NT + t`` = key ``/ L0``, chunk ``% L0``),
    keys clamped to the split's last key ``k1 - 1`` (valid memory, masked in ``softmax``)."""
    VEC, L0, NT, TK, C = p.vec, p.l0, p.nt, p.tk, p.loads
    V16 = min(VEC, vec16(p.dtype))

    @T.macro
    def load_tile(Kst, Vst, pages, page_values, pbase, ps, h, t0, k1, t):
        for i in T.unroll(C):
            if i * NT + t < TK * L0:
                jc: T.let[T.int32] = T.min(t0 + T.truncdiv(i * NT + t, L0), k1 - 1)
                d0: T.let[T.int32] = T.truncmod(i * NT + t, L0) * VEC
                pg: T.let[T.int32] = page_values[pbase + T.truncdiv(jc, ps)]
                for u in T.unroll(VEC // V16):
                    for e in T.vectorized(V16):
                        Kst[i, u * V16 + e] = pages[pg, 0, h, T.truncmod(jc, ps), d0 + u * V16 + e]
                for u in T.unroll(VEC // V16):
                    for e in T.vectorized(V16):
                        Vst[i, u * V16 + e] = pages[pg, 1, h, T.truncmod(jc, ps), d0 + u * V16 + e]

    return load_tile


def make_stage_tile(p: StagedPlan):
    """``stage_tile(Ks, Vs, Kst, Vst, t)``: the registers of ``load_tile`` into the shared tile (rows = keys)."""
    VEC, L0, NT, TK, C = p.vec, p.l0, p.nt, p.tk, p.loads
    V16 = min(VEC, vec16(p.dtype))

    @T.macro
    def stage_tile(Ks, Vs, Kst, Vst, t):
        for i in T.unroll(C):
            if i * NT + t < TK * L0:
                r: T.let[T.int32] = T.truncdiv(i * NT + t, L0)
                d0: T.let[T.int32] = T.truncmod(i * NT + t, L0) * VEC
                for u in T.unroll(VEC // V16):
                    for e in T.vectorized(V16):
                        Ks[r, d0 + u * V16 + e] = Kst[i, u * V16 + e]
                for u in T.unroll(VEC // V16):
                    for e in T.vectorized(V16):
                        Vs[r, d0 + u * V16 + e] = Vst[i, u * V16 + e]

    return stage_tile


def make_score_parts(p: StagedPlan):
    """``(dot_rows, lane_sum)``, the score's two steps shared by the plain and RoPE key tiles:
    ``dot_rows(S_, Qr, kf, kk)`` adds this lane's part of row ``r`` . key ``kk`` (``kf``, float32) to
    ``S_[kk, r]`` for the ``R`` rows; ``lane_sum(S_)`` sums every ``S_[kk, r]`` over the ``L`` lanes of its row
    (xor shuffles: every lane ends with the full score)."""
    VEC, KZ, L, SHIFTS, R = p.vec, p.kz, p.l, p.shifts, p.r

    @T.macro
    def dot_rows(S_, Qr, kf, kk):
        for r in T.unroll(R):
            for e in T.unroll(VEC):
                S_[kk, r] = S_[kk, r] + Qr[r, e] * kf[e]

    @T.macro
    def lane_sum(S_):
        for sh in T.unroll(SHIFTS):
            for kk in T.unroll(KZ):
                for r in T.unroll(R):
                    S_[kk, r] = S_[kk, r] + shfl_xor(S_[kk, r], T.shift_right(L, sh + 1))

    return dot_rows, lane_sum


def make_score_tile(p: StagedPlan):
    """``score_tile(S_, Qr, Ks, kv, kf, tx, tz)``: ``S_[kk, r]`` = this thread's row ``r`` . tile key
    ``tz*KZ + kk`` (log2 units), summed over the ``L`` lanes (every lane ends with the full score); padding
    lanes add 0. Each key element is read and converted once for the ``R`` rows."""
    VEC, KZ, L0, R, LW = p.vec, p.kz, p.l0, p.r, p.lw
    V16 = min(VEC, vec16(p.dtype))
    dot_rows, lane_sum = make_score_parts(p)

    @T.macro
    def score_tile(S_, Qr, Ks, kv, kf, tx, tz):
        for kk in T.unroll(KZ):
            for r in T.unroll(R):
                S_[kk, r] = T.float32(0)
            if tx < L0:
                for u in T.unroll(VEC // V16):
                    for e in T.vectorized(V16):
                        kv[u * V16 + e] = Ks[tz * KZ + kk, u * LW + tx * V16 + e]
                for e in T.unroll(VEC):
                    kf[e] = T.Cast("float32", kv[e])
                dot_rows(S_, Qr, kf, kk)
        lane_sum(S_)

    return score_tile


def make_softmax_tile(p: StagedPlan, var):
    """``softmax_tile(S_, ml, Or, st, key0, k1)``: online softmax of each of the thread's rows over its ``KZ``
    keys ``key0 + kk`` (keys at or past ``k1`` masked, the soft cap first as in the reference): running max
    ``ml[r, 0]`` and sum ``ml[r, 1]`` updated, ``Or[r]`` rescaled, ``S_`` replaced by ``2^(s - m)``."""
    VEC, KZ, R = p.vec, p.kz, p.r

    @T.macro
    def softmax_tile(S_, ml, Or, st, key0, k1):
        for r in T.unroll(R):
            st[0] = ml[r, 0]
            for kk in T.unroll(KZ):
                S_[kk, r] = var.logits(S_[kk, r], key0 + kk < k1)
                st[0] = T.max(st[0], S_[kk, r])
            st[1] = T.exp2(ml[r, 0] - st[0])
            ml[r, 0] = st[0]
            ml[r, 1] = ml[r, 1] * st[1]
            for e in T.unroll(VEC):
                Or[r, e] = Or[r, e] * st[1]
            for kk in T.unroll(KZ):
                S_[kk, r] = T.exp2(S_[kk, r] - st[0])
                ml[r, 1] = ml[r, 1] + S_[kk, r]

    return softmax_tile


def make_accumulate_tile(p: StagedPlan):
    """``accumulate_tile(Or, S_, Vs, vv, vf, tx, tz)``: ``Or[r] += sum_kk S_[kk, r] * v[tz*KZ + kk]`` (the
    lane's dims; each value element read and converted once for the ``R`` rows)."""
    VEC, KZ, L0, R, LW = p.vec, p.kz, p.l0, p.r, p.lw
    V16 = min(VEC, vec16(p.dtype))

    @T.macro
    def accumulate_tile(Or, S_, Vs, vv, vf, tx, tz):
        if tx < L0:
            for kk in T.unroll(KZ):
                for u in T.unroll(VEC // V16):
                    for e in T.vectorized(V16):
                        vv[u * V16 + e] = Vs[tz * KZ + kk, u * LW + tx * V16 + e]
                for e in T.unroll(VEC):
                    vf[e] = T.Cast("float32", vv[e])
                for r in T.unroll(R):
                    for e in T.unroll(VEC):
                        Or[r, e] = Or[r, e] + S_[kk, r] * vf[e]

    return accumulate_tile


def make_load_q_rows(p: StagedPlan):
    """``load_q_rows(Qr, Or, ml, q, b, row0, sm_scale, tx)``: the lane's dims of q rows ``row0 + r``
    (``r < R``) scaled by ``sm_scale * log2(e)`` (0 on padding lanes) and the empty softmax states."""
    VEC, L0, R, LW = p.vec, p.l0, p.r, p.lw
    V16 = min(VEC, vec16(p.dtype))

    @T.macro
    def load_q_rows(Qr, Or, ml, q, b, row0, sm_scale, tx):
        for r in T.unroll(R):
            for e in T.unroll(VEC):
                Qr[r, e] = T.float32(0)
                Or[r, e] = T.float32(0)
            if tx < L0:
                for u in T.unroll(VEC // V16):
                    for e in T.unroll(V16):
                        Qr[r, u * V16 + e] = T.Cast("float32", q[b, row0 + r, u * LW + tx * V16 + e]) * (
                            sm_scale * T.float32(LOG2E))
            ml[r, 0] = T.float32(EMPTY_LSE)
            ml[r, 1] = T.float32(0)

    return load_q_rows


def make_store_rows(p: StagedPlan):
    """``store_rows(o, lse, ws_o, ws_l, red_ml, red_o, ml, Or, b, h, sp, S, tx, ty, tz)``: merge the ``NZ``
    key-group states of each row (``red_ml``, ``red_o`` in shared memory; one barrier) and write row
    ``h*G + g``: ``o``, ``lse`` when the kernel is not split (``S == 1``), else split ``sp``'s normalized
    partial state into the float32 workspace. A row that saw no key writes ``o = 0``, ``lse = -1e30`` (as a
    split's partial state only the lse: ``make_merge_splits`` reads no ``o`` of it)."""
    VEC, L, L0, NZ, D, HQ, G, NT, R, GT, LW = p.vec, p.l, p.l0, p.nz, p.d, p.hq, p.g, p.nt, p.r, p.gt, p.lw
    V16 = min(VEC, vec16(p.dtype))
    merged_rows = make_merged_rows(states=NZ, group=G, d=D, nt=NT, heads=HQ, dtype=p.dtype,
                                   m_at=lambda red, w, gg: red[w, gg, 0], l_at=lambda red, w, gg: red[w, gg, 1],
                                   o_at=lambda red, w, gg, dd: red[w, gg, dd])

    @T.macro
    def store_rows(o, lse, ws_o, ws_l, red_ml, red_o, ml, Or, b, h, sp, S, tx, ty, tz):
        st = T.alloc_buffer((4,), "float32", scope="local")
        for r in T.unroll(R):
            if tx == 0:
                red_ml[tz, ty * R + r, 0] = ml[r, 0]
                red_ml[tz, ty * R + r, 1] = ml[r, 1]
            if tx < L0:
                for u in T.unroll(VEC // V16):
                    for e in T.unroll(V16):
                        red_o[tz, ty * R + r, u * LW + tx * V16 + e] = Or[r, u * V16 + e]
        T.tvm_storage_sync("shared")
        t: T.let[T.int32] = (tz * GT + ty) * L + tx
        merged_rows(o, lse, ws_o, ws_l, red_ml, red_o, st, b, h, sp, S, t)

    return store_rows


def make_key_loop(p: StagedPlan, var):
    """``key_loop(regs, smem, pages, page_values, pbase, ps, h, k0, k1, t, tx, tz)``: the thread's row state
    over the split's keys ``[k0, k1)`` in tiles of ``TK``: tile ``i + 1``'s loads are issued before tile
    ``i`` is scored (register double buffering; module docstring)."""
    TK, KZ = p.tk, p.kz
    load_tile, stage_tile, score_tile = make_load_tile(p), make_stage_tile(p), make_score_tile(p)
    softmax_tile, accumulate_tile = make_softmax_tile(p, var), make_accumulate_tile(p)

    @T.macro
    def key_loop(regs, smem, pages, page_values, pbase, ps, h, k0, k1, t, tx, tz):
        Qr, Or, ml, S_, st, Kst, Vst, kv, kf = regs
        Ks, Vs = smem
        tiles: T.let[T.int32] = T.truncdiv(k1 - k0 + TK - 1, TK)
        if k0 < k1:
            load_tile(Kst, Vst, pages, page_values, pbase, ps, h, k0, k1, t)
        for it in T.serial(tiles):
            # Barriers: the previous tile's readers are done; this tile is in shared memory.
            T.tvm_storage_sync("shared")
            stage_tile(Ks, Vs, Kst, Vst, t)
            T.tvm_storage_sync("shared")
            if it + 1 < tiles:
                load_tile(Kst, Vst, pages, page_values, pbase, ps, h, k0 + (it + 1) * TK, k1, t)
            score_tile(S_, Qr, Ks, kv, kf, tx, tz)
            softmax_tile(S_, ml, Or, st, k0 + it * TK + tz * KZ, k1)
            accumulate_tile(Or, S_, Vs, kv, kf, tx, tz)

    return key_loop


def make_staged_kernel(p: StagedPlan, var):
    """The staged decode kernel as a macro (same arguments as the lane-group kernel of
    ``attention_cuda_decode``): grid (entry, kv head, split), the split's key range, key loop and store."""
    L, G, NZ, TK, D, R, GT = p.l, p.g, p.nz, p.tk, p.d, p.r, p.gt
    key_loop, load_q_rows, store_rows = make_key_loop(p, var), make_load_q_rows(p), make_store_rows(p)

    @T.macro
    def kernel(q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, B, ps,
               rope_scale, rope_theta, sm_scale, S, C, ws_o, ws_l):
        for bx in T.thread_binding(T.max(B, 1), thread="blockIdx.x"):
            for h in T.thread_binding(p.hkv, thread="blockIdx.y"):
                for sp in T.thread_binding(S, thread="blockIdx.z"):
                    for tz in T.thread_binding(NZ, thread="threadIdx.z"):
                        for ty in T.thread_binding(GT, thread="threadIdx.y"):
                            for tx in T.thread_binding(L, thread="threadIdx.x"):
                                Qr = T.alloc_buffer((R, p.vec), "float32", scope="local")
                                Or = T.alloc_buffer((R, p.vec), "float32", scope="local")
                                ml = T.alloc_buffer((R, 2), "float32", scope="local")
                                S_ = T.alloc_buffer((p.kz, R), "float32", scope="local")
                                st = T.alloc_buffer((2,), "float32", scope="local")
                                Kst = T.alloc_buffer((p.loads, p.vec), p.dtype, scope="local")
                                Vst = T.alloc_buffer((p.loads, p.vec), p.dtype, scope="local")
                                kv = T.alloc_buffer((p.vec,), p.dtype, scope="local")
                                kf = T.alloc_buffer((p.vec,), "float32", scope="local")
                                Ks = T.alloc_buffer((TK, D), p.dtype, scope="shared")
                                Vs = T.alloc_buffer((TK, D), p.dtype, scope="shared")
                                red_ml = T.alloc_buffer((NZ, G, 2), "float32", scope="shared")
                                red_o = T.alloc_buffer((NZ, G, D), "float32", scope="shared")
                                if bx < B:
                                    kvlen: T.let[T.int32] = paged_kv_len(page_indptr, last_page_len, bx, ps)
                                    Sk: T.let[T.int32] = opaque_i32(S)  # the split count, opaque in the kernel
                                    # This split's keys: [k0, k1) (split_chunk: a chunked or an equal range).
                                    chunk: T.let[T.int32] = split_chunk(var, kvlen, Sk, opaque_i32(C), TK)
                                    k0: T.let[T.int32] = T.min(var.decode_key(kvlen, sp * chunk), kvlen)
                                    k1: T.let[T.int32] = T.min(k0 + chunk, kvlen)
                                    load_q_rows(Qr, Or, ml, q, bx, h * G + ty * R, sm_scale, tx)
                                    key_loop((Qr, Or, ml, S_, st, Kst, Vst, kv, kf), (Ks, Vs), pages,
                                             page_values, page_indptr[bx], ps, h, k0, k1,
                                             (tz * GT + ty) * L + tx, tx, tz)
                                    store_rows(o, lse, ws_o, ws_l, red_ml, red_o, ml, Or, bx, h, sp, Sk, tx,
                                               ty, tz)

    return kernel


__all__ = ["StagedPlan", "make_accumulate_tile", "make_key_loop", "make_load_q_rows", "make_load_tile", "make_score_parts", "make_score_tile",
           "make_softmax_tile", "make_stage_tile", "make_staged_kernel", "make_store_rows", "staged_limits", "staged_plan"]
