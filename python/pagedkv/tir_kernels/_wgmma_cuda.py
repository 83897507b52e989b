"""Warpgroup tensor-core pieces of the CUDA kernels (sm_90a): ``wgmma.mma_async`` m64nNk16 with A from
registers and B from shared memory (no swizzle), fp16 / bf16 in, fp32 accumulate, and the fences around it.

Layouts, as ``tools/wgmma_probe.cu`` checked them on the H200:

* A: warp ``w`` of the warpgroup gives rows ``16 w ..`` in exactly the ``mma.m16n8k16`` A fragment
  (``_mma_cuda.a_frag``: 4 registers of 2 halves).
* D (fp32): for each 8-column group ``j``, elements ``4 j .. 4 j + 3`` are the m16n8 C fragment
  (``_mma_cuda.c_frag``) of the warp's 16 rows: the m16 tile code of ``mma.sync`` carries over unchanged.
* B: 8 x 8 *core matrices* of 128 contiguous bytes (8 rows of 16 bytes). K-major (``trans`` 0: S = Q K^T,
  K stored per key): element (n, k) at byte ``(n%8)*16 + (k%8)*2 + (k/8)*LBO + (n/8)*SBO``; MN-major with
  imm-trans-b 1 (``trans`` 1: O = P V, V stored per key): element (k, n) at ``(k%8)*16 + (n%8)*2 +
  (n/8)*SBO + (k/8)*LBO``. LBO runs along K, SBO along N in both; ``CoreLayout`` is the element map of a
  ``[rows][dim]`` tile stored as such (rows in groups of 8, then the dims in 8-element chunks).
* Descriptor (64 bits): bits 0-13 start address >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, bits 62-63 the layout
  type: 0 = no swizzle (``CoreLayout``), 1 = 128-byte swizzle (``Sw128Layout``: the tiles TMA writes; checked
  on the H200 by the "wg2t" prefill tile, 2026-12-05). A layout gives each k step's offset, LBO and SBO
  (``k_major`` / ``mn_major``), so the GEMM macros take either.

Order (PTX ISA "asynchronous warpgroup level matrix multiply-accumulate"): shared-memory writes (cp.async,
its wait) -> ``fence.proxy.async.shared::cta`` by the writing threads -> barrier -> ``wgmma.fence`` -> the
wgmma's -> ``commit_group`` -> ``wait_group 0`` before the accumulators are read or the buffer is refilled;
``acc_fence`` then pins the accumulator registers behind the wait (nvcc does not know that wgmma writes them
late).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tvm.script import tirx as T

#: B widths (N) generated: key tiles of 32 / 64 / 128 (S) and value dims 64 / 128 / 256 (O; 256: half of MLA's 512).
WG_NS = (32, 64, 128, 256)
#: Registers an A-operand fence pins at once (``reg_fence``: a multiple of 8 registers as consecutive runs of 8).
WG_REG_RUN = 8
_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}


#: Elements after each core matrix in the kernels' K / V tiles (``CoreLayout.pad``): 8 (a 144-byte stride) makes
#: row-major 16-byte copies (8 threads on 128 contiguous bytes of a global row) free of shared-memory bank
#: conflicts; packed core matrices (0) need 8 threads on 8 keys' same dims instead, which reads half-used L2
#: sectors. The padded layout made the wgmma prefill 1-4% faster (BENCHMARKS.md run 18 probe, H100).
WG_CORE_PAD = 8


@dataclasses.dataclass(frozen=True)
class CoreLayout:
    """A ``[rows][d]`` tile (2-byte elements) stored as wgmma core matrices: 8-row groups, each ``d / 8`` core
    matrices of 64 elements (8 rows x 8 dims, a row's 8 dims contiguous), core matrices ``chunk = 64 + pad``
    elements apart along the dims. ``pad`` 8 (a 144-byte stride) puts the 8 dim chunks of one row in 8 different
    16-byte bank groups, so 8 threads copying 128 contiguous bytes of a global row write shared memory without
    a bank conflict; ``pad`` 0 packs the core matrices (then 8 threads should fill one core matrix: 8 rows)."""

    d: int
    pad: int = 0

    @property
    def chunk(self) -> int:
        """Elements between core matrices adjacent along the dims (wgmma's K-major LBO / MN-major SBO)."""
        return 64 + self.pad

    @property
    def group(self) -> int:
        """Elements between 8-row groups (K-major SBO / MN-major LBO)."""
        return self.d // 8 * self.chunk

    def index(self, row, dim):
        """Element of (``row``, ``dim``) (ints or TIR expressions)."""
        return (row // 8) * self.group + (dim // 8) * self.chunk + (row % 8) * 8 + dim % 8

    def elems(self, rows: int) -> int:
        """Elements of ``rows`` rows (a multiple of 8)."""
        return rows // 8 * self.group

    def k_major(self, ks: int) -> tuple[int, int, int]:
        """(offset, LBO, SBO) in bytes of k step ``ks`` (dims ``16 ks ..``) of a K-major B: 2 dim chunks a step."""
        return ks * 4 * self.chunk, 2 * self.chunk, 2 * self.group

    def mn_major(self, kk: int) -> tuple[int, int, int]:
        """(offset, LBO, SBO) in bytes of k step ``kk`` (rows ``16 kk ..``) of an MN-major B (rows = K)."""
        return kk * 4 * self.group, 2 * self.group, 2 * self.chunk

    swizzle = 0  # the descriptor's layout type: no swizzle


@dataclasses.dataclass(frozen=True)
class Sw128Layout:
    """A ``[rows][d]`` tile (2-byte elements) in the 128-byte swizzle that TMA writes and wgmma reads
    (``CU_TENSOR_MAP_SWIZZLE_128B``, descriptor layout type 1): ``d / 64`` column blocks of ``rows`` rows of 128
    bytes (64 elements), block after block; the 16-byte chunk ``c`` of row ``r`` is stored at chunk ``c ^ (r %
    8)`` of the row, i.e. shared address bits 4-6 XOR bits 7-9 (each block starts 1024-byte aligned).

    Descriptors (PTX ISA / CUTLASS's canonical GMMA layouts): K-major (S = Q K^T, rows = keys): SBO 1024 bytes
    between 8-row groups, LBO unused (1), k step ``ks`` = ``32 (ks % 4)`` bytes into its column block's rows
    (the swizzle is applied to the address the wgmma forms); MN-major (O = P V, rows = keys = K): SBO 1024
    bytes between 8-key groups, LBO = one column block (64 dims) to the next, k step ``kk`` 16 rows on."""

    d: int
    rows: int
    swizzle = 1

    def index(self, row, dim):
        """Element of (``row``, ``dim``) (ints or TIR expressions)."""
        return ((dim // 64) * self.rows + row) * 64 + (((dim % 64) // 8) ^ (row % 8)) * 8 + dim % 8

    def elems(self, rows: int) -> int:
        return rows * self.d

    def k_major(self, ks: int) -> tuple[int, int, int]:
        return (ks * 16 // 64) * self.rows * 128 + (ks * 16 % 64) * 2, 16, 1024

    def mn_major(self, kk: int) -> tuple[int, int, int]:
        return kk * 16 * 128, self.rows * 128, 1024


def _wgmma_fn(n: int, ptx: str, trans: int, *, ss: bool = False) -> str:
    """``pagedkv_wgmma_n{n}_{ptx}_t{trans}``: A from registers (4 of the thread's fragment); ``ss``:
    ``pagedkv_wgmma_ss_...``, A from shared memory through its own K-major descriptor (``imm-trans-a`` 0)."""
    regs = n // 2  # fp32 accumulators of a thread: 64 rows x n over 128 threads
    dl = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    desc = "pagedkv_wg_desc({0}, {1}off, {1}lbo, {1}sbo) | (static_cast<unsigned long long>({1}swz) << 62)"
    if ss:
        head = (f"pagedkv_wgmma_ss_n{n}_{ptx}_t{trans}(float* d, const void* a, unsigned a_off, unsigned a_lbo, "
                f"unsigned a_sbo, int a_swz, const void* b, unsigned off, unsigned lbo, unsigned sbo, int swz, "
                f"int scale_d)")
        setup = f"  unsigned long long da = {desc.format('a', 'a_')};\n  unsigned long long db = {desc.format('b', '')};\n"
        a_op, b_op, pred, trans_ops, ins = f"%{regs}", f"%{regs + 1}", regs + 2, f"0, {trans}", '"l"(da), "l"(db)'
    else:
        head = (f"pagedkv_wgmma_n{n}_{ptx}_t{trans}(float* d, const void* a, const void* b, unsigned off, unsigned lbo, "
                f"unsigned sbo, int scale_d, int swz)")
        setup = (f"  const unsigned* A = reinterpret_cast<const unsigned*>(a);\n"
                 f"  unsigned long long desc = {desc.format('b', '')};\n")
        a_op, b_op, pred, trans_ops = f"{{%{regs},%{regs + 1},%{regs + 2},%{regs + 3}}}", f"%{regs + 4}", regs + 5, trans
        ins = '"r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "l"(desc)'
    return (
        f"__device__ __forceinline__ void {head} {{\n{setup}"
        # scale-d is a predicate operand: p = 0 makes D = A B (the first k step), 1 D += A B.
        f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{pred}, 0;\\n"\n'
        f'               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} {{{dl}}}, '
        f'{a_op}, {b_op}, p, 1, 1, {trans_ops};\\n}}\\n"\n'
        f"               : {outs}\n"
        f'               : {ins}, "r"(scale_d));\n}}\n')


def _acc_fence_fn(n: int) -> str:
    regs = n // 2
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (f"__device__ __forceinline__ void pagedkv_wg_acc_fence_n{n}(float* d) {{\n"
            f'  asm volatile("" : {outs} :: "memory");\n}}\n')


# One empty asm pinning 8 registers; a fence of 8 k registers is k of them in a row (``runs`` is a constant at
# every call: the loop unrolls).
_REG_FENCE = """__device__ __forceinline__ void pagedkv_wg_reg_fence(void* p, int runs) {
  unsigned* r = reinterpret_cast<unsigned*>(p);
#pragma unroll
  for (int i = 0; i < runs; ++i, r += 8)
    asm volatile("" : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3]), "+r"(r[4]), "+r"(r[5]), "+r"(r[6]),
                 "+r"(r[7]) :: "memory");
}
"""

_SOURCE = r"""
#ifndef PAGEDKV_WGMMA_HELPERS
#define PAGEDKV_WGMMA_HELPERS
// Shared-memory matrix descriptor of B at byte ``off`` past ``base`` (16-byte aligned), no swizzle, base offset 0
// (addresses and strides in 16-byte units). Shared addresses stay below 2^18, so the start address fits its 14 bits
// and adding the offset's units never carries into LBO: the low word is one add a wgmma past the base's (which
// nvcc computes once for all the wgmma's of a tile).
__device__ __forceinline__ unsigned long long pagedkv_wg_desc(const void* base, unsigned off, unsigned lbo,
                                                              unsigned sbo) {
  unsigned lo = (static_cast<unsigned>(__cvta_generic_to_shared(base)) >> 4) + ((lbo >> 4) << 16) + (off >> 4);
  return static_cast<unsigned long long>(lo) | (static_cast<unsigned long long>((sbo >> 4) & 0x3FFFu) << 32);
}
__device__ __forceinline__ void pagedkv_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void pagedkv_wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void pagedkv_wg_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void pagedkv_wg_wait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
// A shared-memory store that ptxas keeps before the next wgmma wait (it does not move memory operations across
// one): the arithmetic that ``v`` depends on then runs before the wait too (ptxas otherwise schedules register-only
// work that no wgmma register depends on after it).
__device__ __forceinline__ void pagedkv_store_before_wait(void* p, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))), "f"(v) : "memory");
}
// Generic-proxy writes (cp.async, stores) to shared memory made visible to the async proxy (wgmma's B reads).
__device__ __forceinline__ void pagedkv_proxy_fence() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Named barriers 1..15 of the block (0 is __syncthreads): bar.sync waits for the phase that its arrival joins to
// complete (n threads, a multiple of 32, counting bar.arrive's); bar.arrive only counts.
__device__ __forceinline__ void pagedkv_bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void pagedkv_bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(n) : "memory");
}
""" + "".join(_wgmma_fn(n, p, t) + _wgmma_fn(n, p, t, ss=True) for n in WG_NS for p in _PTX_TYPE.values()
            for t in (0, 1)) + "".join(
    _acc_fence_fn(n) for n in WG_NS) + _REG_FENCE + "#endif\n"


_OPAQUE_SOURCE = r"""
#ifndef PAGEDKV_SHARED_OPAQUE
#define PAGEDKV_SHARED_OPAQUE
// Shared-memory accesses that TVM's barrier planner does not see (the kernels using them order them with their own
// barriers); volatile, so nvcc keeps their order among the barriers.
__device__ __forceinline__ void pagedkv_st_shared_f32(void* p, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))), "f"(v) : "memory");
}
__device__ __forceinline__ float pagedkv_ld_shared_f32(const void* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))) : "memory");
  return v;
}
__device__ __forceinline__ void pagedkv_st_shared_zero16(void* p) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))),
               "r"(0) : "memory");
}
// x as the compiler can see is the same in every lane (lane 0's): branches on it are warp-uniform, so ptxas does
// not serialize the wgmma's under them (C7518); the value must be the same in every lane.
__device__ __forceinline__ int pagedkv_warp_uniform(int x) { return __shfl_sync(0xFFFFFFFFu, x, 0); }
// The 4 bytes at src (two 16-bit elements of a register array) to shared memory at p.
__device__ __forceinline__ void pagedkv_st_shared_b32(void* p, const void* src) {
  asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))),
               "r"(*reinterpret_cast<const unsigned*>(src)) : "memory");
}
#endif
"""


def st_shared_f32(p, v):
    """Store float32 ``v`` at shared address ``p``, unseen by TVM's barrier planner (``_OPAQUE_SOURCE``)."""
    return T.cuda.func_call("pagedkv_st_shared_f32", p, v, source_code=_OPAQUE_SOURCE)


def ld_shared_f32(p):
    """Load the float32 at shared address ``p``, unseen by TVM's barrier planner."""
    return T.cuda.func_call("pagedkv_ld_shared_f32", p, source_code=_OPAQUE_SOURCE, return_type="float32")


def st_shared_zero16(p):
    """Zero the 16 bytes at shared address ``p``, unseen by TVM's barrier planner."""
    return T.cuda.func_call("pagedkv_st_shared_zero16", p, source_code=_OPAQUE_SOURCE)


def warp_uniform(x):
    """``x`` (int32, the same in every lane: a warpgroup index) through lane 0's shuffle, so that ptxas knows a
    branch on it is warp-uniform and keeps the wgmma's under it asynchronous (else C7518: serialized)."""
    return T.cuda.func_call("pagedkv_warp_uniform", x, source_code=_OPAQUE_SOURCE, return_type="int32")


def st_shared_b32(p, src):
    """Store the 4 bytes at ``src`` (two 16-bit elements of a local array) at shared address ``p``, unseen by
    TVM's barrier planner."""
    return T.cuda.func_call("pagedkv_st_shared_b32", p, src, source_code=_OPAQUE_SOURCE)


def wgmma(dtype: str, n: int, trans: int, d, a, b, off: int, lbo: int, sbo: int, accumulate: bool = True,
          swizzle: int = 0):
    """``d[0 .. n/2) += A B`` (``accumulate``; else ``= A B``) for the warpgroup's m64 x n tile, k16: ``d`` and
    ``a`` addresses of the thread's D (``n / 2`` floats) and A fragment (8 elements of ``dtype``); B's first core
    matrix ``off`` bytes (a multiple of 16) past shared address ``b`` (16-byte aligned: a tile's base, the same for
    all the wgmma's of the tile); ``trans`` 0 = K-major B, 1 = MN-major (module docstring); ``lbo`` / ``sbo`` in
    bytes; ``swizzle`` the descriptor's layout type (0 none: ``CoreLayout``, 1 128-byte: ``Sw128Layout``)."""
    if isinstance(off, int) and off % 16:
        raise ValueError(f"pagedkv.tir_kernels: wgmma B offset {off} is not a multiple of 16 bytes")
    if dtype not in _PTX_TYPE or n not in WG_NS:
        raise NotImplementedError(f"pagedkv.tir_kernels: wgmma takes float16 / bfloat16 and N in {WG_NS}, got "
                                  f"{dtype}, {n}")
    return T.cuda.func_call(f"pagedkv_wgmma_n{n}_{_PTX_TYPE[dtype]}_t{trans}", d, a, b, T.Cast("uint32", off), T.uint32(lbo),
                            T.uint32(sbo), T.int32(int(accumulate)) if isinstance(accumulate, bool) else T.Cast("int32", accumulate),
                            T.int32(swizzle), source_code=_SOURCE)


def wgmma_ss(dtype: str, n: int, trans: int, d, a, a_desc: tuple, b, b_desc: tuple, accumulate: bool = True):
    """``wgmma`` with A (64 rows x k16) from shared memory as well: ``a`` / ``b`` shared base addresses (16-byte
    aligned), ``a_desc`` / ``b_desc`` = (offset, LBO, SBO, swizzle) in bytes as a layout's ``k_major`` /
    ``mn_major`` give them plus its ``swizzle``; A is K-major (rows = M, as ``CoreLayout`` / ``Sw128Layout``
    store ``[rows][k]``)."""
    for off in (a_desc[0], b_desc[0]):
        if isinstance(off, int) and off % 16:
            raise ValueError(f"pagedkv.tir_kernels: wgmma operand offset {off} is not a multiple of 16 bytes")
    if dtype not in _PTX_TYPE or n not in WG_NS:
        raise NotImplementedError(f"pagedkv.tir_kernels: wgmma takes float16 / bfloat16 and N in {WG_NS}, got "
                                  f"{dtype}, {n}")
    (ao, al, asb, asw), (bo, bl, bsb, bsw) = a_desc, b_desc
    return T.cuda.func_call(f"pagedkv_wgmma_ss_n{n}_{_PTX_TYPE[dtype]}_t{trans}", d, a, T.Cast("uint32", ao),
                            T.uint32(al), T.uint32(asb), T.int32(asw), b, T.Cast("uint32", bo), T.uint32(bl),
                            T.uint32(bsb), T.int32(bsw),
                            T.int32(int(accumulate)) if isinstance(accumulate, bool) else T.Cast("int32", accumulate),
                            source_code=_SOURCE)


def wg_fence():
    """``wgmma.fence``: register (accumulator, A) writes before it are seen by the wgmma's after it."""
    return T.cuda.func_call("pagedkv_wg_fence", source_code=_SOURCE)


def wg_commit():
    """``wgmma.commit_group``: the wgmma's issued since the last commit form one group."""
    return T.cuda.func_call("pagedkv_wg_commit", source_code=_SOURCE)


def wg_wait0():
    """``wgmma.wait_group 0``: every committed wgmma of the warpgroup is complete."""
    return T.cuda.func_call("pagedkv_wg_wait0", source_code=_SOURCE)


def wg_wait1():
    """``wgmma.wait_group 1``: every committed wgmma group but the newest is complete (groups complete in
    commit order)."""
    return T.cuda.func_call("pagedkv_wg_wait1", source_code=_SOURCE)


def store_before_wait(p, v):
    """Store float32 ``v`` to the shared scratch word at address ``p`` (never read) so that the work ``v`` depends
    on runs before the next ``wg_wait0`` / ``wg_wait1`` in the SASS: the overlap of a softmax with a wgmma group
    in flight (``tests/cpu/test_prefill_wg_compile.py`` checks the MUFU.EX2 between the waits)."""
    return T.cuda.func_call("pagedkv_store_before_wait", p, v, source_code=_SOURCE)


def proxy_fence():
    """``fence.proxy.async.shared::cta``: this thread's shared-memory writes visible to wgmma (then a barrier)."""
    return T.cuda.func_call("pagedkv_proxy_fence", source_code=_SOURCE)


def bar_sync(bar_id, n: int):
    """``bar.sync bar_id, n``: wait until ``n`` threads (this one included; ``bar_arrive`` s count) reached
    named barrier ``bar_id`` (1..15, a run-time value allowed) in the current phase."""
    return T.cuda.func_call("pagedkv_bar_sync", T.Cast("int32", bar_id), T.int32(n), source_code=_SOURCE)


def bar_arrive(bar_id, n: int):
    """``bar.arrive bar_id, n``: count this thread in the phase of named barrier ``bar_id`` without waiting."""
    return T.cuda.func_call("pagedkv_bar_arrive", T.Cast("int32", bar_id), T.int32(n), source_code=_SOURCE)


def acc_fence(n: int, d):
    """Pin the ``n / 2`` accumulators at address ``d`` between the wgmma asm's (an empty volatile asm that
    reads and writes them): after a wait, their reads cannot move above it; before a ``wg_fence``, their
    writes (a rescale) cannot sink below it (nvcc does not know that wgmma reads and writes them late)."""
    return T.cuda.func_call(f"pagedkv_wg_acc_fence_n{n}", d, source_code=_SOURCE)


def reg_fence(regs: int, p):
    """As ``acc_fence`` for ``regs`` 32-bit registers at address ``p`` (an A operand: P written by the softmax
    must be in its registers before the ``wg_fence``), a multiple of ``WG_REG_RUN``."""
    if regs % WG_REG_RUN:
        raise NotImplementedError(f"pagedkv.tir_kernels: reg_fence of {regs} registers (a multiple of {WG_REG_RUN})")
    return T.cuda.func_call("pagedkv_wg_reg_fence", p, T.int32(regs // WG_REG_RUN), source_code=_SOURCE)


class WgGemms(NamedTuple):
    """The two GEMMs of attention on a warpgroup's m64 tile, as macros (``wg_attention_gemms``): ``*_issue``
    starts one wgmma group, ``*_done`` pins its registers after the wait that completes it, the plain ones
    issue, wait (``wait_group 0``) and pin."""

    score_issue: object
    score_done: object
    score: object
    pv_issue: object
    pv_done: object
    accumulate: object


def wg_attention_gemms(dtype: str, *, s_steps: int, tk: int, k_lay, dv: int, v_lay) -> WgGemms:
    """S (64 rows x ``tk`` keys) = Q K^T over ``s_steps`` k16 steps and O (64 rows x ``dv``) += P V over ``tk / 16``.

    ``score*(sacc, qf, smem, kb)``: A = the warp's Q fragments ``qf[8 ks ..]`` (registers), B = a K tile stored
    as ``k_lay`` (``CoreLayout`` or ``Sw128Layout``: its ``k_major`` gives each step's offset, LBO and SBO)
    from element ``kb``, K-major. The first step overwrites S (scale-d 0): no
    zeroing. ``pv*(oacc, pf, smem, vb)``: A = P's fragments ``pf[8 kk ..]`` (keys ``16 kk ..``), B = a V tile
    stored as ``v_lay`` from ``vb``, MN-major (trans-b, ``v_lay.mn_major``). Registers the wgmma's read or write late are pinned before the
    ``wg_fence`` and after the wait."""
    q_regs, p_regs = s_steps * 4, tk // 4

    @T.macro
    def score_issue(sacc, qf, smem, kb):
        T.evaluate(reg_fence(q_regs, T.address_of(qf[0])))
        T.evaluate(wg_fence())
        for ks in T.unroll(s_steps):
            T.evaluate(wgmma(dtype, tk, 0, T.address_of(sacc[0]), T.address_of(qf[ks * 8]),
                             T.address_of(smem[kb]), *k_lay.k_major(ks), accumulate=ks > 0, swizzle=k_lay.swizzle))
        T.evaluate(wg_commit())

    @T.macro
    def score_done(sacc, qf):
        T.evaluate(reg_fence(q_regs, T.address_of(qf[0])))
        T.evaluate(acc_fence(tk, T.address_of(sacc[0])))

    @T.macro
    def score(sacc, qf, smem, kb):
        score_issue(sacc, qf, smem, kb)
        T.evaluate(wg_wait0())
        score_done(sacc, qf)

    @T.macro
    def pv_issue(oacc, pf, smem, vb):
        T.evaluate(acc_fence(dv, T.address_of(oacc[0])))
        T.evaluate(reg_fence(p_regs, T.address_of(pf[0])))
        T.evaluate(wg_fence())
        for kk in T.unroll(tk // 16):
            T.evaluate(wgmma(dtype, dv, 1, T.address_of(oacc[0]), T.address_of(pf[kk * 8]),
                             T.address_of(smem[vb]), *v_lay.mn_major(kk), swizzle=v_lay.swizzle))
        T.evaluate(wg_commit())

    @T.macro
    def pv_done(oacc, pf):
        T.evaluate(acc_fence(dv, T.address_of(oacc[0])))
        T.evaluate(reg_fence(p_regs, T.address_of(pf[0])))

    @T.macro
    def accumulate(oacc, pf, smem, vb):
        pv_issue(oacc, pf, smem, vb)
        T.evaluate(wg_wait0())
        pv_done(oacc, pf)

    return WgGemms(score_issue, score_done, score, pv_issue, pv_done, accumulate)


__all__ = ["WG_CORE_PAD", "WG_NS", "WG_REG_RUN", "CoreLayout", "Sw128Layout", "WgGemms", "bar_arrive", "bar_sync", "store_before_wait", "wg_attention_gemms", "reg_fence", "acc_fence", "proxy_fence", "wg_commit", "wg_fence", "wg_wait0", "wg_wait1",
           "wgmma", "wgmma_ss", "ld_shared_f32", "st_shared_b32", "st_shared_f32", "st_shared_zero16", "warp_uniform"]
