"""CUDA prefill, ragged and paged (``attn_prefill_ragged`` / ``attn_prefill_paged``).

Design and ABI: the docstring of ``attention_cuda.py``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel_table import auto_order, choose, unserved
from ..ops import ATTN_PREFILL_PAGED, ATTN_PREFILL_RAGGED, shape_values
from ._abi import abi_prim_func
from ._tma_cuda import host_aligned16
from ._common import EMPTY_LSE, LOG2E
from ._common_cuda import (
    ceildiv,
    check_head_dim,
    cos_approx,
    paged_kv_len,
    rope_angle,
    rope_divisor,
    shfl_xor,
    sin_approx,
    vec16,
)
from ._variant_cuda import CudaVariant
from .attention_cuda_prefill_tc import TC_TILES, make_prefill_tc

#: Path switch choosing the plain (apply_rope == 0) prefill kernel: "simt" (FP32 FMA) or a tensor-core tile of
#: ``attention_cuda_prefill_tc.TC_TILES``; which one auto takes is the selection table's (``pagedkv.kernel_table``).
PREFILL_SWITCH = "cuda_prefill_kernel"

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


def _make_prefill(op: str, spec, paged: bool):
    """The (rope, plain) kernel macros of a prefill PrimFunc: ``paged`` selects the K/V source; the mask and
    logits rules are ``CudaVariant`` s (compile-time; an option off leaves the code as without it)."""
    HQ, HKV, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    DV = D if paged else shape_values(spec)["Dv"]  # the paged op has no Dv (o is [n, Hq, D])
    var = CudaVariant.from_spec(spec)
    WIN = var.has_window  # a bool: TVMScript evaluates ``if WIN:`` at parse time
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

    def rope_elem(x, partner, d, pos, rope_scale, invf):
        """Rotated element ``d`` (float32) from storage-dtype ``x`` and its partner (dim ``d +- D/2``)."""
        angle = rope_angle(pos, rope_scale, invf[T.truncmod(d, HALF)])
        sign = T.if_then_else(d < HALF, T.float32(-1), T.float32(1))
        return T.Cast("float32", x) * cos_approx(angle) + sign * T.Cast("float32", partner) * sin_approx(angle)

    if paged:
        def kv_len_of(kvb, b):
            return paged_kv_len(kvb[2], kvb[4], b, kvb[3])
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
                        # Row bounds (``CudaVariant.row_bound``); with a window lim[RI] is the first key tile.
                        lim = T.alloc_buffer((RI + 1 if WIN else RI,), "int32", scope="local")
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
                        for kt in T.serial(lim[RI] if WIN else 0, T.truncdiv(kv_end + TK - 1, TK)):
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
                            # The soft cap, when on, applies before the mask (as in the reference).
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


def use_tensor_cores(op: str, spec) -> str | None:
    """The tensor-core tile (``TC_TILES`` key) of the plain prefill kernel of ``spec``, or None for the SIMT one:
    the selection table's choice (``pagedkv.kernel_table.choose``: forced through ``cuda_prefill_kernel``, raising
    where the forced tile does not serve, else the op's first serving variant)."""
    name = choose(op, spec).name
    return None if name == "simt" else name


def tma_fallback(op: str, spec) -> str:
    """The tile a TMA tile's PrimFunc runs where TMA cannot read the operands (k / v, or the pages, not 16-byte
    aligned; pages of a size not a multiple of 8): the first non-TMA tile of the op's auto order that serves."""
    return next(v.name for v in auto_order(op)
                if v.name in TC_TILES and not TC_TILES[v.name].tma and not unserved(v, spec, op))


def attn_prefill_ragged_cuda(spec):
    """``pagedkv_attn_prefill_ragged`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``.

    The mask and logits rules (causal, sliding window, soft cap) are ``CudaVariant.from_spec(spec)``'s; a
    window also skips the key tiles below the query tile's first window start.
    """
    tile = use_tensor_cores(ATTN_PREFILL_RAGGED, spec)
    TC = tile is not None  # a bool: parse-time ``if``
    # A TMA tile needs 16-byte aligned k / v (a tensor map's address): other views take its fallback tile.
    TMA = TC and TC_TILES[tile].tma
    kernel_rope, kernel_plain = _make_prefill(ATTN_PREFILL_RAGGED, spec, paged=False)
    kernel_tc = make_prefill_tc(ATTN_PREFILL_RAGGED, spec, paged=False, tile=tile) if TC else None
    kernel_fb = make_prefill_tc(ATTN_PREFILL_RAGGED, spec, paged=False, tile=tma_fallback(ATTN_PREFILL_RAGGED, spec)) if TMA else None

    @T.macro
    def body(q, k, v, q_indptr, kv_indptr, q_pos, k_pos_offset, o, lse, causal, apply_rope, rope_scale,
             rope_theta, sm_scale, dims):
        n, _m, B = dims
        # Two kernels: inline RoPE costs registers that the plain kernel does not pay for. The tensor-core
        # kernel has no inline RoPE: with it, apply_rope == 1 still runs the SIMT RoPE kernel.
        if apply_rope == 1:
            kernel_rope(q, q_indptr, q_pos, k_pos_offset, o, lse, (k, v, kv_indptr), B, n, causal,
                        rope_scale, rope_theta, sm_scale)
        else:
            if TMA:
                if T.And(host_aligned16(T.address_of(k[0, 0, 0])), host_aligned16(T.address_of(v[0, 0, 0]))):
                    kernel_tc(q, q_indptr, o, lse, (k, v, kv_indptr), B, n, causal, sm_scale)
                else:
                    kernel_fb(q, q_indptr, o, lse, (k, v, kv_indptr), B, n, causal, sm_scale)
            elif TC:
                kernel_tc(q, q_indptr, o, lse, (k, v, kv_indptr), B, n, causal, sm_scale)
            else:
                kernel_plain(q, q_indptr, q_pos, k_pos_offset, o, lse, (k, v, kv_indptr), B, n, causal,
                             rope_scale, rope_theta, sm_scale)

    return abi_prim_func(ATTN_PREFILL_RAGGED, shape_values(spec), spec.dtype, body, scheduled=True,
                         any_align=("k", "v") if TMA else ())


def attn_prefill_paged_cuda(spec):
    """``pagedkv_attn_prefill_paged`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``;
    mask and logits rules as ``attn_prefill_ragged_cuda``."""
    tile = use_tensor_cores(ATTN_PREFILL_PAGED, spec)
    TC = tile is not None
    TMA = TC and TC_TILES[tile].tma  # boxes of 8 keys of a page: pages 16-byte aligned, ps a multiple of 8
    kernel_rope, kernel_plain = _make_prefill(ATTN_PREFILL_PAGED, spec, paged=True)
    kernel_tc = make_prefill_tc(ATTN_PREFILL_PAGED, spec, paged=True, tile=tile) if TC else None
    kernel_fb = make_prefill_tc(ATTN_PREFILL_PAGED, spec, paged=True,
                                tile=tma_fallback(ATTN_PREFILL_PAGED, spec)) if TMA else None

    @T.macro
    def body(q, q_indptr, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, causal,
             apply_rope, rope_scale, rope_theta, sm_scale, dims):
        n, B, _p, ps, _nnz = dims
        if apply_rope == 1:
            kernel_rope(q, q_indptr, q_pos, k_pos_offset, o, lse,
                        (pages, page_values, page_indptr, ps, last_page_len), B, n, causal,
                        rope_scale, rope_theta, sm_scale)
        else:
            if TMA:
                if T.And(T.truncmod(ps, 8) == 0, host_aligned16(T.address_of(pages[0, 0, 0, 0, 0]))):
                    kernel_tc(q, q_indptr, o, lse, (pages, page_values, page_indptr, ps, last_page_len), B, n,
                              causal, sm_scale)
                else:
                    kernel_fb(q, q_indptr, o, lse, (pages, page_values, page_indptr, ps, last_page_len), B, n,
                              causal, sm_scale)
            elif TC:
                kernel_tc(q, q_indptr, o, lse, (pages, page_values, page_indptr, ps, last_page_len), B, n,
                          causal, sm_scale)
            else:
                kernel_plain(q, q_indptr, q_pos, k_pos_offset, o, lse,
                             (pages, page_values, page_indptr, ps, last_page_len), B, n, causal,
                             rope_scale, rope_theta, sm_scale)

    return abi_prim_func(ATTN_PREFILL_PAGED, shape_values(spec), spec.dtype, body, scheduled=True,
                         any_align=("pages",) if TMA else ())
