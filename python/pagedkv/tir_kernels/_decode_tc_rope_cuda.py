"""Inline RoPE (``apply_rope == 1``) in the tensor-core CUDA decode kernel (``_decode_tc_cuda``): the cache holds
unrotated keys; the kernel rotates q once per block and each key once per block, in shared memory, right after
its tile lands, so the scores, softmax and ``P V`` are the plain kernel's.

Positions are taken relative to the split's first key ``k0`` (``<R(a) q, R(b) k> = <R(a - c) q, R(b - c) k>``,
as in ``_decode_staged_rope_cuda``): q by ``R(q_pos - k_pos_offset - k0)`` when its A fragments are loaded
(``load_q_rope``: lane ``l`` holds dims ``j`` and ``j + D/2`` of its rows in k steps ``ks`` and ``ks + D/32``,
so a pair never leaves its lane), key ``k0 + t`` by ``R(t)``.

Per tile (``rotate_keys``), warp ``w`` rotates the 16 keys it scores (``t = it*TK + 16 w + r``, ``r < 16``: no
other warp reads them, so a warp barrier orders it). The work is fixed per lane: lane ``l`` owns the pairs
``8 c .. 8 c + 7`` (``c = l % C``, ``C = D/16`` 8-pair chunks a half row) of keys ``r = l // C + u * 32/C``,
``u < C/2``, so its cos / sin live in registers, never in shared memory:

* ``base`` = cos / sin of ``(it*TK + 16 w + l // C) * w_j`` for its 8 pairs: exact (``rope_sincos``) every
  ``ANCHOR_TILES`` tiles, else the previous tile's rotated by the tile step ``TK * w_j`` (one float32 rotation
  a pair: the drift between anchors stays below 1e-5 rad, far under a storage-dtype rounding);
* the key ``u`` of its chunks: ``base`` rotated ``u`` times by the row step ``32/C * w_j``;
* the rotation helper (``pagedkv_rope_rotl_*``, generated per dtype and layout, every loop unrolled) loads the
  lane's ``C/2`` chunk pairs (16-byte reads of each half row) first, then rotates them, then stores them:
  bf16 in float32 with one rounding to the storage dtype, like the cache's own rotation; fp16 in packed
  half2 arithmetic (``PACKED_F16``: the angles in float32, ``x c - y s`` by ``__hmul2`` + ``__hfma2``).

The tile and row steps are ``rope_sincos`` of the lane's 8 pairs once per block (``rope_setup``), after the
pair frequencies (float64 formula kept as a float32 pair ``w_hi, w_lo``, the only RoPE table in shared memory:
``2 x D/2`` words after the ring, 512 bytes at D 128).

Why this layout (H200): the first tc RoPE kernel (run 11) read per-pair cos / sin tables from shared memory
(four float32 words a pair, 16 KB a warp and tile against the tile's own 8 KB) and took 1.38x the plain
kernel's time at B = 64, latency-bound with 8 warps an SM. This one takes 1.05-1.06x there (1.12-1.15x with
the float32 fp16 rotation, 1.6-2x while a rolled loop left the chunks in local memory) and 1.03-1.04x at
B = 1 L = 32K (BENCHMARKS.md, run 12).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._mma_cuda import a_frag
from ._sincos_cuda import rope_freq64_exp2, rope_freq_split, rope_sincos

#: Keys a warp scores per tile.
WARP_KEYS = 16
#: Tiles between a lane's exact base angles (module docstring); tests set it small to reach both paths.
ANCHOR_TILES = 32
#: fp16 keys rotated in packed half2 arithmetic (``__hfma2``: a third of the float32 path's instructions, about
#: three fp16 roundings a rotated element instead of one); False: float32 and one rounding, as bf16 always is.
#: H200, 32/8/128 fp16, three A/B pairs in one run: RoPE / plain decode 1.04 (B=1 L=32K) and 1.07-1.10 (B=64
#: L=4K) against float32's 1.04-1.05 and 1.12-1.15; relative error 4.7e-4 against 4.1e-4.
PACKED_F16 = True
#: Slots of a lane's angle registers (``angc`` / ``angs``): the base, the tile step, the row step (8 pairs each).
ANG_WORDS = 24
_CTYPE = {"float16": ("half", "__half2float", "__float2half_rn"),
          "bfloat16": ("nv_bfloat16", "__bfloat162float", "__float2bfloat16_rn")}


def _rotate_chunk(dtype: str, packed: bool) -> str:
    """CUDA statements rotating the chunk pair ``x[8], y[8]`` (storage dtype) by ``c[8], s[8]`` (float32)."""
    ctype, to_f, from_f = _CTYPE[dtype]
    scalar = ("    #pragma unroll\n    for (int e = 0; e < 8; ++e) {\n"
              f"      float xf = {to_f}(x[e]), yf = {to_f}(y[e]);\n"
              f"      x[e] = {from_f}(xf * c[e] - yf * s[e]);\n      y[e] = {from_f}(yf * c[e] + xf * s[e]);\n    }}\n")
    if not packed:
        return scalar
    # x c - y s and y c + x s on half2 pairs (HMUL2 then HFMA2, each rounded to fp16); the emulator (no
    # __CUDA_ARCH__) takes the same roundings element by element.
    return ("#ifdef __CUDA_ARCH__\n"
            "    #pragma unroll\n    for (int e = 0; e < 8; e += 2) {\n"
            "      __half2 C = __floats2half2_rn(c[e], c[e + 1]), S = __floats2half2_rn(s[e], s[e + 1]);\n"
            "      __half2 X = __halves2half2(x[e], x[e + 1]), Y = __halves2half2(y[e], y[e + 1]);\n"
            "      __half2 XN = __hfma2(X, C, __hneg2(__hmul2(Y, S))), YN = __hfma2(Y, C, __hmul2(X, S));\n"
            "      x[e] = __low2half(XN); x[e + 1] = __high2half(XN); y[e] = __low2half(YN); y[e + 1] = __high2half(YN);\n"
            "    }\n#else\n"
            "    #pragma unroll\n    for (int e = 0; e < 8; ++e) {\n"
            "      float ch = __half2float(__float2half_rn(c[e])), sh = __half2float(__float2half_rn(s[e]));\n"
            "      float ys = __half2float(__float2half_rn(__half2float(y[e]) * sh));\n"
            "      float xs = __half2float(__float2half_rn(__half2float(x[e]) * sh));\n"
            "      float xf = __half2float(x[e]), yf = __half2float(y[e]);\n"
            "      x[e] = __float2half_rn(fmaf(xf, ch, -ys));\n      y[e] = __float2half_rn(fmaf(yf, ch, xs));\n"
            "    }\n#endif  // __CUDA_ARCH__ (labelled: a helper block ends at the first bare #endif)\n")


def rot_helper(dtype: str, jobs: int, step_words: int, hi_words: int, *, packed: bool = False) -> tuple[str, str]:
    """(name, CUDA source) of the lane rotation helper: ``name(row, bc, bs, uc, us)`` rotates ``jobs`` chunk
    pairs (8 pairs of halves: ``row + u * step_words`` and ``+ hi_words`` 4-byte words), chunk ``u`` by the
    angles ``(bc, bs)`` rotated ``u`` times by ``(uc, us)``; ``packed`` (fp16 only): in half2 arithmetic."""
    ctype = _CTYPE[dtype][0]
    packed = packed and dtype == "float16"
    name = (f"pagedkv_rope_rotl_{'f16' if dtype == 'float16' else 'bf16'}_j{jobs}_r{step_words}_h{hi_words}"
            + ("_p" if packed else ""))
    guard = name.upper()
    src = (f"#ifndef {guard}\n#define {guard}\n"
           f"__device__ __forceinline__ void {name}(void* row, const float* bc, const float* bs, const float* uc, "
           "const float* us) {\n"
           f"  float* w = static_cast<float*>(row);\n  uint4 lo[{jobs}], hi[{jobs}];\n"
           # Every load first (independent), then the arithmetic, then the stores; every loop unrolled (a
           # rolled one keeps lo / hi in local memory: 128 bytes of stack, 1.6-2x the kernel's time on the H200).
           f"  #pragma unroll\n  for (int u = 0; u < {jobs}; ++u) {{\n"
           f"    lo[u] = *reinterpret_cast<const uint4*>(w + u * {step_words});\n"
           f"    hi[u] = *reinterpret_cast<const uint4*>(w + u * {step_words} + {hi_words});\n  }}\n"
           "  float c[8], s[8];\n  #pragma unroll\n  for (int e = 0; e < 8; ++e) { c[e] = bc[e]; s[e] = bs[e]; }\n"
           f"  #pragma unroll\n  for (int u = 0; u < {jobs}; ++u) {{\n"
           "    if (u > 0) {\n      #pragma unroll\n      for (int e = 0; e < 8; ++e) {\n"
           "        float t = c[e] * uc[e] - s[e] * us[e];\n        s[e] = s[e] * uc[e] + c[e] * us[e];\n"
           "        c[e] = t;\n      }\n    }\n"
           f"    {ctype} x[8], y[8];\n    memcpy(x, &lo[u], 16);\n    memcpy(y, &hi[u], 16);\n"
           + _rotate_chunk(dtype, packed) +
           "    memcpy(&lo[u], x, 16);\n    memcpy(&hi[u], y, 16);\n  }\n"
           f"  #pragma unroll\n  for (int u = 0; u < {jobs}; ++u) {{\n"
           f"    *reinterpret_cast<uint4*>(w + u * {step_words}) = lo[u];\n"
           f"    *reinterpret_cast<uint4*>(w + u * {step_words} + {hi_words}) = hi[u];\n  }}\n}}\n#endif\n")
    return name, src


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


def rope_words(d: int) -> int:
    """float32 words of the RoPE table after the ring: the pair frequencies ``w_hi, w_lo``."""
    return d


def make_tc_rope_parts(d: int, g: int, dtype: str, *, table0: int, nt: int, tk: int, k_row, row_words: int):
    """``(rope_setup, load_q_rope, rotate_keys)`` of a tc decode kernel with ``nt`` threads, head dim ``d``
    (64 or 128), group ``g``: the frequencies start at word ``table0`` of the kernel's dynamic buffer;
    ``k_row(slot, row)`` is the word offset of K row ``row`` of ring slot ``slot``, rows ``row_words`` apart."""
    HALF, NKS = d // 2, d // 16
    W_HI, W_LO = table0, table0 + HALF
    CHUNKS = HALF // 8  # 8-pair chunks of a half row
    if 32 % CHUNKS:
        raise NotImplementedError(f"pagedkv.tir_kernels: tc RoPE lanes need D/16 to divide 32 (head dim {d})")
    JOBS, ROWSTEP = WARP_KEYS * CHUNKS // 32, 32 // CHUNKS  # a lane's chunks, the key rows between them
    rot, rot_src = rot_helper(dtype, JOBS, ROWSTEP * row_words, HALF // 2, packed=PACKED_F16)

    @T.macro
    def rope_setup(smem, angc, angs, rope_theta, rope_scale, tid, lane):
        """Pair frequencies (float64 formula, kept as a float32 pair), a barrier, the lane's tile and row steps
        (``angc / angs[8 ..]``, ``[16 ..]``) for its 8 pairs."""
        for i in T.unroll((HALF + nt - 1) // nt):
            if i * nt + tid < HALF:
                w64: T.let[T.float64] = rope_freq64_exp2(i * nt + tid, rope_theta, rope_scale, d)
                T.evaluate(st_f32(T.address_of(smem[W_HI + i * nt + tid]), rope_freq_split(w64)[0]))
                T.evaluate(st_f32(T.address_of(smem[W_LO + i * nt + tid]), rope_freq_split(w64)[1]))
        T.tvm_storage_sync("shared")
        for e in T.unroll(8):
            rope_sincos(angc, angs, 8 + e, tk, smem[W_HI + T.truncmod(lane, CHUNKS) * 8 + e],
                        smem[W_LO + T.truncmod(lane, CHUNKS) * 8 + e])
            rope_sincos(angc, angs, 16 + e, ROWSTEP, smem[W_HI + T.truncmod(lane, CHUNKS) * 8 + e],
                        smem[W_LO + T.truncmod(lane, CHUNKS) * 8 + e])

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
    def rotate_keys(smem, slot, it, w, lane, angc, angs, rc):
        """Warp ``w``'s 16 keys of tile ``it`` (in ``slot``, rows ``16 w ..``) rotated in place: the lane's base
        angles (exact at an anchor tile, else stepped), its chunks, a warp barrier (the rotated rows visible to
        the warp's ``ldmatrix``)."""
        if T.truncmod(it, ANCHOR_TILES) == 0:
            for e in T.unroll(8):
                rope_sincos(angc, angs, e, it * tk + w * WARP_KEYS + T.truncdiv(lane, CHUNKS),
                            smem[W_HI + T.truncmod(lane, CHUNKS) * 8 + e], smem[W_LO + T.truncmod(lane, CHUNKS) * 8 + e])
        else:
            for e in T.unroll(8):
                rc[0] = angc[e] * angc[8 + e] - angs[e] * angs[8 + e]
                angs[e] = angs[e] * angc[8 + e] + angc[e] * angs[8 + e]
                angc[e] = rc[0]
        T.evaluate(T.cuda.func_call(
            rot, T.address_of(smem[k_row(slot, w * WARP_KEYS + T.truncdiv(lane, CHUNKS)) + T.truncmod(lane, CHUNKS) * 4]),
            T.address_of(angc[0]), T.address_of(angs[0]), T.address_of(angc[16]), T.address_of(angs[16]),
            source_code=rot_src))
        T.evaluate(syncwarp())

    return rope_setup, load_q_rope, rotate_keys


__all__ = ["ANCHOR_TILES", "ANG_WORDS", "PACKED_F16", "WARP_KEYS", "make_tc_rope_parts", "rope_words", "rot_helper", "st_f32",
           "syncwarp"]
