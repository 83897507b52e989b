"""Warp-level tensor-core pieces of the CUDA kernels: ``mma.sync.m16n8k16`` (fp16 / bf16 in, fp32 accumulate)
and the per-lane fragment layouts that go with it.

The layouts are those of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type"); each
function maps (lane, element index of the lane's fragment) to a (row, column) of the tile, and takes ints or
TIR expressions alike (the kernels call them inside their ``@T.macro`` s, the CPU test
``tests/cpu/test_prefill_tc_layout.py`` with ints, against an independent NumPy model of the instruction):

* A, 16 x 16 row-major (``row.col``): 8 elements per lane (4 registers of 2 halves);
* B, 16 x 8 (K x N, "col"): 4 elements per lane (2 registers);
* C / D, 16 x 8 float32: 4 elements per lane.

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
// One 32-bit copy (two 16-bit elements): a B-fragment register from shared memory in one LDS.32.
__device__ __forceinline__ void pagedkv_cp4(void* dst, const void* src) {
  *reinterpret_cast<unsigned*>(dst) = *reinterpret_cast<const unsigned*>(src);
}
#endif
"""


def mma_sync(dtype: str, d, a, b):
    """``d[0..3] += A @ B`` for one m16n8k16 tile; ``d``, ``a``, ``b``: addresses (``T.address_of``) of the
    lane's C, A, B fragments (4 floats, 8 and 4 elements of ``dtype``)."""
    if dtype not in _PTX_TYPE:
        raise NotImplementedError(f"pagedkv.tir_kernels: mma.sync takes float16 or bfloat16, got {dtype}")
    return T.cuda.func_call(f"pagedkv_mma_{_PTX_TYPE[dtype]}", d, a, b, source_code=_SOURCE)


def copy4(dst, src):
    """Copy 4 bytes (two 16-bit elements) from address ``src`` to ``dst``; both 4-byte aligned."""
    return T.cuda.func_call("pagedkv_cp4", dst, src, source_code=_SOURCE)


__all__ = ["a_frag", "b_frag", "c_frag", "copy4", "mma_sync"]
