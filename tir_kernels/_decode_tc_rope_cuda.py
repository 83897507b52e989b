"""Inline RoPE (``apply_rope == 1``) in the tensor-core CUDA decode kernel (``_decode_tc_cuda``): the cache holds
unrotated keys; the kernel rotates q once per block and each key once per block, in shared memory, right after
its tile lands, so the scores, softmax and ``P V`` are the plain kernel's.

Positions are taken relative to the split's first key ``k0`` (``<R(a) q, R(b) k> = <R(a - c) q, R(b - c) k>``,
as in ``_decode_staged_rope_cuda``): q by ``R(q_pos - k_pos_offset - k0)`` when its A fragments are loaded
(``load_q_rope``: lane ``l`` holds dims ``j`` and ``j + D/2`` of its rows in k steps ``ks`` and ``ks + D/32``,
so a pair never leaves its lane), key ``k0 + t`` by ``R(t)``.

Per tile (``rotate_keys``), warp ``w`` rotates the 16 keys it scores (``t = it*TK + 16 w + r``, ``r < 16``:
no other warp reads them, so a warp barrier orders it): ``cos / sin`` of ``t * w_j`` by angle addition of the
warp's base ``(it*TK + 16 w) * w_j`` (``D/2`` ``rope_sincos`` a warp and tile, two a lane at D 128) and a table
of ``r * w_j`` (``16 x D/2``, computed once per block by ``rope_setup``); each lane then rotates chunks of 8
pairs (a 16-byte read of each half row, float32 arithmetic, one rounding to the storage dtype, like the
cache's own) with ``pagedkv_rope_rot8_*``. Table writes go through an opaque store (``st_f32``) so TVM's
barrier planner sees none: every ordering here is an explicit block or warp barrier.

Shared memory (float32 words after the ring, ``rope_words``): the pair frequencies ``w_hi, w_lo`` (``2 x D/2``),
the offset table (``2 x 16 x D/2``) and each warp's base angles (``4 x 2 x D/2``): 10,752 bytes at D 128
(115,200 in all with the ring: still two blocks an SM on an H200), 5,376 at D 64.

Sin / cos are ``_sincos_cuda.rope_sincos`` (float64-reference accuracy) on the base and the offsets; the angle
sum adds about 2 float32 roundings.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._mma_cuda import a_frag
from ._sincos_cuda import rope_freq64_exp2, rope_freq_split, rope_sincos

#: Keys a warp scores per tile (its rows of the offset table).
WARP_KEYS = 16
_CTYPE = {"float16": ("half", "__half2float", "__float2half_rn"),
          "bfloat16": ("nv_bfloat16", "__bfloat162float", "__float2bfloat16_rn")}


def _rot8_source(dtype: str) -> str:
    ctype, to_f, from_f = _CTYPE[dtype]
    name = "f16" if dtype == "float16" else "bf16"
    return (f"#ifndef PAGEDKV_ROPE_ROT8_{name.upper()}\n#define PAGEDKV_ROPE_ROT8_{name.upper()}\n"
            # Rotate pairs (lo[e], hi[e]), e < 8 (two 16-byte half rows in shared memory), by the angle
            # base_e + off_e given the (cos, sin) of each: angle addition, then the rotation, in float32.
            f"__device__ __forceinline__ void pagedkv_rope_rot8_{name}(void* lo, void* hi, const float* bc, "
            "const float* bs, const float* oc, const float* os) {\n"
            f"  {ctype} x[8], y[8];\n"
            "  uint4 ul = *reinterpret_cast<const uint4*>(lo), uh = *reinterpret_cast<const uint4*>(hi);\n"
            "  memcpy(x, &ul, 16);\n  memcpy(y, &uh, 16);\n"
            "  float c[8], s[8], d[8], t[8];\n"
            "  for (int i = 0; i < 2; ++i) {\n"
            "    float4 a = reinterpret_cast<const float4*>(bc)[i], b = reinterpret_cast<const float4*>(bs)[i];\n"
            "    float4 e = reinterpret_cast<const float4*>(oc)[i], f = reinterpret_cast<const float4*>(os)[i];\n"
            "    c[4 * i] = a.x; c[4 * i + 1] = a.y; c[4 * i + 2] = a.z; c[4 * i + 3] = a.w;\n"
            "    s[4 * i] = b.x; s[4 * i + 1] = b.y; s[4 * i + 2] = b.z; s[4 * i + 3] = b.w;\n"
            "    d[4 * i] = e.x; d[4 * i + 1] = e.y; d[4 * i + 2] = e.z; d[4 * i + 3] = e.w;\n"
            "    t[4 * i] = f.x; t[4 * i + 1] = f.y; t[4 * i + 2] = f.z; t[4 * i + 3] = f.w;\n"
            "  }\n"
            "  for (int e = 0; e < 8; ++e) {\n"
            "    float cs = c[e] * d[e] - s[e] * t[e], sn = s[e] * d[e] + c[e] * t[e];\n"
            f"    float xf = {to_f}(x[e]), yf = {to_f}(y[e]);\n"
            f"    x[e] = {from_f}(xf * cs - yf * sn);\n"
            f"    y[e] = {from_f}(yf * cs + xf * sn);\n"
            "  }\n"
            "  memcpy(&ul, x, 16);\n  memcpy(&uh, y, 16);\n"
            "  *reinterpret_cast<uint4*>(lo) = ul;\n  *reinterpret_cast<uint4*>(hi) = uh;\n}\n#endif\n")


_SYNC_SOURCE = r"""
#ifndef PAGEDKV_WARP_HELPERS
#define PAGEDKV_WARP_HELPERS
// A warp barrier that also orders the warp's shared-memory accesses.
__device__ __forceinline__ void pagedkv_syncwarp() { __syncwarp(); }
// A float32 store TVM's barrier planner does not see (the callers order it with explicit barriers).
__device__ __forceinline__ void pagedkv_st_f32(float* p, float v) { *p = v; }
#endif
"""


def syncwarp():
    """``__syncwarp()``: the warp's lanes meet, their shared-memory writes visible to each other."""
    return T.cuda.func_call("pagedkv_syncwarp", source_code=_SYNC_SOURCE)


def st_f32(addr, value):
    """``*addr = value`` (float32) through an opaque call (module docstring)."""
    return T.cuda.func_call("pagedkv_st_f32", addr, value, source_code=_SYNC_SOURCE)


def rope_words(d: int, warps: int) -> int:
    """float32 words of the RoPE tables after the ring (module docstring)."""
    half = d // 2
    return 2 * half + 2 * WARP_KEYS * half + warps * 2 * half


def make_tc_rope_parts(d: int, g: int, dtype: str, *, table0: int, nt: int, k_row):
    """``(rope_setup, load_q_rope, rotate_keys)`` of a tc decode kernel with ``nt`` threads, head dim ``d``,
    group ``g``: the tables start at word ``table0`` of the kernel's dynamic buffer; ``k_row(slot, row)`` is
    the word offset of K row ``row`` of ring slot ``slot``."""
    HALF, NKS = d // 2, d // 16
    W_HI, W_LO = table0, table0 + HALF
    OFF_C, OFF_S = table0 + 2 * HALF, table0 + 2 * HALF + WARP_KEYS * HALF
    BASE = table0 + 2 * HALF + 2 * WARP_KEYS * HALF
    CHUNKS = HALF // 8  # 8-pair chunks of a key
    JOBS = WARP_KEYS * CHUNKS // 32  # chunks a lane rotates per tile
    rot8 = "pagedkv_rope_rot8_" + ("f16" if dtype == "float16" else "bf16")
    rot8_src = _rot8_source(dtype)

    @T.macro
    def rope_setup(smem, rc, rs, rope_theta, rope_scale, tid):
        """Pair frequencies (float64 formula, kept as a float32 pair), a barrier, the offset table
        ``cos / sin(r * w_j)`` (each entry once); the key loop's first barrier publishes the table."""
        for i in T.unroll((HALF + nt - 1) // nt):
            if i * nt + tid < HALF:
                w64: T.let[T.float64] = rope_freq64_exp2(i * nt + tid, rope_theta, rope_scale, d)
                T.evaluate(st_f32(T.address_of(smem[W_HI + i * nt + tid]), rope_freq_split(w64)[0]))
                T.evaluate(st_f32(T.address_of(smem[W_LO + i * nt + tid]), rope_freq_split(w64)[1]))
        T.tvm_storage_sync("shared")
        for i in T.serial((WARP_KEYS * HALF + nt - 1) // nt):
            if i * nt + tid < WARP_KEYS * HALF:
                rope_sincos(rc, rs, 0, T.truncdiv(i * nt + tid, HALF), smem[W_HI + T.truncmod(i * nt + tid, HALF)],
                            smem[W_LO + T.truncmod(i * nt + tid, HALF)])
                T.evaluate(st_f32(T.address_of(smem[OFF_C + i * nt + tid]), rc[0]))
                T.evaluate(st_f32(T.address_of(smem[OFF_S + i * nt + tid]), rs[0]))

    @T.macro
    def load_q_rope(qf, q, b, h, lane, rel, smem, rc, rs):
        """``load_q`` with the group's rows rotated by ``R(rel)`` (float32, rounded once to the storage dtype)."""
        for ks in T.unroll(NKS // 2):
            for i in T.unroll(8):
                if a_frag(lane, i)[0] < g:
                    rope_sincos(rc, rs, 0, rel, smem[W_HI + ks * 16 + a_frag(lane, i)[1]],
                                smem[W_LO + ks * 16 + a_frag(lane, i)[1]])
                    x: T.let[T.float32] = T.Cast("float32", q[b, h * g + a_frag(lane, i)[0], ks * 16 + a_frag(lane, i)[1]])
                    y: T.let[T.float32] = T.Cast("float32", q[b, h * g + a_frag(lane, i)[0],
                                                              HALF + ks * 16 + a_frag(lane, i)[1]])
                    qf[ks * 8 + i] = T.Cast(dtype, x * rc[0] - y * rs[0])
                    qf[(ks + NKS // 2) * 8 + i] = T.Cast(dtype, y * rc[0] + x * rs[0])
                else:
                    qf[ks * 8 + i] = T.Cast(dtype, T.float32(0))
                    qf[(ks + NKS // 2) * 8 + i] = T.Cast(dtype, T.float32(0))

    @T.macro
    def rotate_keys(smem, slot, base, w, lane, rc, rs):
        """Warp ``w``'s 16 keys of the tile in ``slot`` (rows ``16 w ..``) rotated in place by ``R(base + r)``:
        the warp's base angles into its table, a warp barrier, ``JOBS`` 8-pair chunks a lane, a warp barrier
        (the rotated rows visible to the warp's ``ldmatrix``)."""
        for i in T.unroll((HALF + 31) // 32):
            if i * 32 + lane < HALF:
                rope_sincos(rc, rs, 0, base, smem[W_HI + i * 32 + lane], smem[W_LO + i * 32 + lane])
                T.evaluate(st_f32(T.address_of(smem[BASE + w * 2 * HALF + i * 32 + lane]), rc[0]))
                T.evaluate(st_f32(T.address_of(smem[BASE + w * 2 * HALF + HALF + i * 32 + lane]), rs[0]))
        T.evaluate(syncwarp())
        for u in T.unroll(JOBS):
            T.evaluate(T.cuda.func_call(
                rot8,
                T.address_of(smem[k_row(slot, w * WARP_KEYS + T.truncdiv(u * 32 + lane, CHUNKS))
                                  + T.truncmod(u * 32 + lane, CHUNKS) * 4]),
                T.address_of(smem[k_row(slot, w * WARP_KEYS + T.truncdiv(u * 32 + lane, CHUNKS))
                                  + HALF // 2 + T.truncmod(u * 32 + lane, CHUNKS) * 4]),
                T.address_of(smem[BASE + w * 2 * HALF + T.truncmod(u * 32 + lane, CHUNKS) * 8]),
                T.address_of(smem[BASE + w * 2 * HALF + HALF + T.truncmod(u * 32 + lane, CHUNKS) * 8]),
                T.address_of(smem[OFF_C + T.truncdiv(u * 32 + lane, CHUNKS) * HALF
                                  + T.truncmod(u * 32 + lane, CHUNKS) * 8]),
                T.address_of(smem[OFF_S + T.truncdiv(u * 32 + lane, CHUNKS) * HALF
                                  + T.truncmod(u * 32 + lane, CHUNKS) * 8]),
                source_code=rot8_src))
        T.evaluate(syncwarp())

    return rope_setup, load_q_rope, rotate_keys


__all__ = ["WARP_KEYS", "make_tc_rope_parts", "rope_words", "st_f32", "syncwarp"]
