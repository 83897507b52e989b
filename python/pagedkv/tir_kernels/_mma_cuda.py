"""Warp-level tensor-core pieces of the CUDA kernels: ``mma.sync.m16n8k16`` (fp16 / bf16 in, fp32 accumulate)
and the per-lane fragment layouts that go with it.

The layouts are those of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type"); each
function maps (lane, element index of the lane's fragment) to a (row, column) of the tile, and takes ints or
TIR expressions alike (the kernels call them inside their ``@T.macro`` s, the CPU test
``tests/cpu/test_prefill_tc_layout.py`` with ints, against an independent NumPy model of the instruction):

* A, 16 x 16 row-major (``row.col``): 8 elements per lane (4 registers of 2 halves);
* B, 16 x 8 (K x N, "col"): 4 elements per lane (2 registers);
* C / D, 16 x 8 float32: 4 elements per lane;
* ``ldmatrix`` (x4, optionally transposed): what each lane receives of four 8 x 8 matrices.

The instruction itself is a small CUDA ``__device__`` function handed to TVM with ``T.cuda.func_call``
(inline PTX, so the emitted code does not depend on TVM's own MMA lowering); fragments are ``local``
arrays indexed by constants after unrolling, which nvcc keeps in registers.
"""

from __future__ import annotations

from tvm.script import tirx as T


def a_frag(lane, i):
    """(row, col) of element ``i`` (0..7) of lane ``lane``'s A fragment (16 x 16)."""
    return lane // 4 + 8 * ((i // 2) % 2), (lane % 4) * 2 + i % 2 + 8 * (i // 4)


def b_frag(lane, i):
    """(k, n) of element ``i`` (0..3) of lane ``lane``'s B fragment (16 x 8)."""
    return (lane % 4) * 2 + i % 2 + 8 * (i // 2), lane // 4


def c_frag(lane, i):
    """(row, col) of element ``i`` (0..3) of lane ``lane``'s C / D fragment (16 x 8)."""
    return lane // 4 + 8 * (i // 2), (lane % 4) * 2 + i % 2


_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}

_SOURCE = r"""
#ifndef PAGEDKV_MMA_HELPERS
#define PAGEDKV_MMA_HELPERS
// d[0..3] += a (4 x b32: 8 halves) * b (2 x b32: 4 halves), m16n8k16, A row-major, B column-major.
__device__ __forceinline__ void pagedkv_mma_f16(float* d, const void* a, const void* b) {
  const unsigned* A = reinterpret_cast<const unsigned*>(a);
  const unsigned* B = reinterpret_cast<const unsigned*>(b);
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B[0]), "r"(B[1]));
}
__device__ __forceinline__ void pagedkv_mma_bf16(float* d, const void* a, const void* b) {
  const unsigned* A = reinterpret_cast<const unsigned*>(a);
  const unsigned* B = reinterpret_cast<const unsigned*>(b);
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B[0]), "r"(B[1]));
}
// ldmatrix .x4: four 8 x 8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8 (16 bytes,
// 16-byte aligned, shared memory); register i of lane t gets row t / 4, elements 2 (t % 4) and + 1 of
// matrix i (.trans: column t / 4, rows 2 (t % 4) and + 1).
__device__ __forceinline__ void pagedkv_ldsm_x4(void* dst, const void* smem) {
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(a));
}
__device__ __forceinline__ void pagedkv_ldsm_x4_trans(void* dst, const void* smem) {
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(a));
}
// cp.async of 16 bytes global -> shared (both 16-byte aligned), L2 only (.cg: the tile is used once per
// block); completion through commit / wait groups. No "memory" clobber here or on ldmatrix (it would make
// nvcc reload every index after each copy): shared-memory order comes from the wait (clobbers memory) and
// the barrier after it, which nvcc does not move volatile asm across.
__device__ __forceinline__ void pagedkv_cp_async16(void* smem, const void* gmem) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(a), "l"(gmem));
}
// The same with an L2 prefetch hint: a miss fills the whole naturally aligned 128 bytes around the chunk
// from DRAM at once (``CP_ASYNC_L2_PREFETCH``).
__device__ __forceinline__ void pagedkv_cp_async16_pf128(void* smem, const void* gmem) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" :: "r"(a), "l"(gmem));
}
__device__ __forceinline__ void pagedkv_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Wait until at most one committed group of this thread is still in flight.
__device__ __forceinline__ void pagedkv_cp_async_wait1() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}
// Wait until every committed group of this thread is complete (the two-stage pipeline: the newest group is
// the tile the block computes next).
__device__ __forceinline__ void pagedkv_cp_async_wait0() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
// Wait until at most two committed groups of this thread are still in flight (a 4-stage ring).
__device__ __forceinline__ void pagedkv_cp_async_wait2() {
  asm volatile("cp.async.wait_group 2;\n" ::: "memory");
}
// Whether an address is 16-byte aligned (1) or not (0).
__device__ __forceinline__ int pagedkv_aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull ? 1 : 0;
}
#endif
"""


def mma_sync(dtype: str, d, a, b):
    """``d[0..3] += A @ B`` for one m16n8k16 tile; ``d``, ``a``, ``b``: addresses (``T.address_of``) of the
    lane's C, A, B fragments (4 floats, 8 and 4 elements of ``dtype``)."""
    if dtype not in _PTX_TYPE:
        raise NotImplementedError(f"pagedkv.tir_kernels: mma.sync takes float16 or bfloat16, got {dtype}")
    return T.cuda.func_call(f"pagedkv_mma_{_PTX_TYPE[dtype]}", d, a, b, source_code=_SOURCE)


def ldmatrix_x4(dst, src, trans: bool):
    """``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``: 4 registers at address ``dst`` (local) from the
    row address ``src`` this lane gives (shared, 16-byte aligned); layout in ``ldmatrix_elem``."""
    name = "pagedkv_ldsm_x4_trans" if trans else "pagedkv_ldsm_x4"
    return T.cuda.func_call(name, dst, src, source_code=_SOURCE)


#: L2 prefetch size (bytes) the 16-byte copies ask for: None (no hint) or 128. 128 since its H200 A/B (two
#: interleaved rounds, every output checked): tc decode 32/8 fp16 at B = 64-256 1.022-1.025x faster (DRAM
#: throughput 84.6% -> 86.3% in ncu), 64/8 1.017-1.023x, MLA decode at 16 heads 1.02-1.04x; a 256-byte
#: prefetch gained nothing (BENCHMARKS.md, run 13 experiments).
CP_ASYNC_L2_PREFETCH = 128


def cp_async16(dst, src):
    """``cp.async.cg.shared.global`` of 16 bytes from address ``src`` (global) to ``dst`` (shared), with the
    L2 prefetch hint ``CP_ASYNC_L2_PREFETCH``."""
    pf = CP_ASYNC_L2_PREFETCH
    if pf not in (None, 128):
        raise ValueError(f"pagedkv.tir_kernels: CP_ASYNC_L2_PREFETCH is None or 128, got {pf!r}")
    name = "pagedkv_cp_async16" if pf is None else f"pagedkv_cp_async16_pf{pf}"
    return T.cuda.func_call(name, dst, src, source_code=_SOURCE)


@T.macro
def keep_extent(buf, n: int):
    """Keep shared buffer ``buf`` at its declared ``n`` elements through ``s_tir.CompactBufferAllocation``.

    The pass sizes a buffer by the elements it sees indexed, but a ``cp.async`` / ``ldmatrix`` / wgmma operand
    reached through ``T.address_of(buf[i])`` spans 16 bytes or more from ``i``: when the indices are simple
    enough for the pass to bound, it cut the tail of the last such chunk (and the row padding after it), so the
    launch gave less dynamic shared memory than the kernel writes. A read of the last element, evaluated and
    dropped, bounds the analysis at ``n``; ``RemoveNoOp`` removes it (no code)."""
    T.evaluate(buf[n - 1])


def cp_async_commit():
    """``cp.async.commit_group``: the copies issued since the last commit form one group."""
    return T.cuda.func_call("pagedkv_cp_async_commit", source_code=_SOURCE)


def cp_async_wait(newest_left: int):
    """``cp.async.wait_group newest_left`` (0 .. 2): all but this thread's newest ``newest_left`` groups are
    complete (then a barrier makes every thread's copies visible to the block)."""
    if not 0 <= newest_left <= 2:
        raise ValueError(f"pagedkv.tir_kernels: cp.async.wait_group {newest_left}: the helpers take 0 .. 2")
    return T.cuda.func_call(f"pagedkv_cp_async_wait{newest_left}", source_code=_SOURCE)


def aligned16(addr):
    """1 when address ``addr`` is a multiple of 16 bytes, else 0 (int32)."""
    return T.cuda.func_call("pagedkv_aligned16", addr, source_code=_SOURCE, return_type="int32")


def ldmatrix_elem(lane, reg, half, trans: bool):
    """(row, col) within matrix ``reg`` of 16-bit half ``half`` (0 low, 1 high) of register ``reg`` of lane
    ``lane`` after ``ldmatrix`` (rows are the 8 addresses lanes ``8 reg ..`` gave)."""
    if trans:
        return (lane % 4) * 2 + half, lane // 4
    return lane // 4, (lane % 4) * 2 + half


__all__ = ["a_frag", "aligned16", "b_frag", "c_frag", "cp_async16", "cp_async_commit", "cp_async_wait",
           "keep_extent",
           "ldmatrix_elem", "ldmatrix_x4", "mma_sync"]
