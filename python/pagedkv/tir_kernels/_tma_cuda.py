"""TMA (the tensor memory accelerator's bulk tensor copies) and mbarrier pieces of the CUDA kernels (sm_90a).

A tensor map (``CUtensorMap``, 128 bytes) describes a global tensor and the box one copy moves. The PrimFunc's
host code encodes it at each call (``TensorMap3.encode``: TVM's ``runtime.cuTensorMapEncodeTiled``, the CUDA
driver's ``cuTensorMapEncodeTiled``) and passes it by value (TVM emits the kernel parameter as
``const __grid_constant__ CUtensorMap``). In the kernel one thread arms a stage's mbarrier with the bytes to come
(``mbar_expect_tx``) and issues the copies (``tma_load3``); they land in shared memory asynchronously and count
their bytes on the mbarrier, whose phase then completes; every reader waits for that phase (``mbar_wait``,
parity = how many times the stage was filled before, mod 2). Copies write through the async proxy, which
``wgmma`` reads too: no proxy fence between them.

Order at start: ``mbar_init`` by one thread, then a block barrier before any other thread waits on it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tvm.script import tirx as T

#: ``CUtensorMapSwizzle``: 128-byte swizzle (``_wgmma_cuda.Sw128Layout``).
SWIZZLE_128B = 3
#: ``CUtensorMapL2promotion``: 128-byte L2 promotion.
L2_PROMOTION_128B = 2
#: Bytes of one mbarrier (a shared ``uint64``).
MBAR_BYTES = 8
#: Alignment of a 128-byte-swizzled box in shared memory (the swizzle repeats every 1024 bytes).
SW128_ALIGN = 1024

_SOURCE = r"""
#ifndef PAGEDKV_TMA_HELPERS
#define PAGEDKV_TMA_HELPERS
__device__ __forceinline__ unsigned pagedkv_smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// mbarrier of `count` arrivals; the init made visible to the async proxy (the TMA's complete_tx).
__device__ __forceinline__ void pagedkv_mbar_init(void* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(pagedkv_smem_addr(bar)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` more transaction bytes (the copies issued next) in the current phase.
__device__ __forceinline__ void pagedkv_mbar_expect_tx(void* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(pagedkv_smem_addr(bar)),
               "r"(bytes) : "memory");
}
// A plain arrival (a consumer done with a stage: an "empty" barrier's count).
__device__ __forceinline__ void pagedkv_mbar_arrive(void* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(pagedkv_smem_addr(bar)) : "memory");
}
// Wait until the phase of parity `parity` completed (try_wait suspends a while in hardware between polls).
__device__ __forceinline__ void pagedkv_mbar_wait(void* bar, int parity) {
  asm volatile("{\n.reg .pred done;\nPAGEDKV_MBAR_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra PAGEDKV_MBAR_WAIT;\n}\n"
               :: "r"(pagedkv_smem_addr(bar)), "r"(parity) : "memory");
}
// A box of a rank-3 tensor map at coordinates (c0, c1, c2) (innermost first) into shared memory at dst, its
// bytes counted on the mbarrier bar.
__device__ __forceinline__ void pagedkv_tma_load3(void* dst, void* bar, unsigned long long map, int c0, int c1,
                                                  int c2) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];\n"
               :: "r"(pagedkv_smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(pagedkv_smem_addr(bar))
               : "memory");
}
// The same for a rank-5 tensor map (c0..c4).
__device__ __forceinline__ void pagedkv_tma_load5(void* dst, void* bar, unsigned long long map, int c0, int c1,
                                                  int c2, int c3, int c4) {
  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n"
               :: "r"(pagedkv_smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4),
                  "r"(pagedkv_smem_addr(bar)) : "memory");
}
// Elements of `elem_bytes` from p to the next 1024-byte aligned shared address.
__device__ __forceinline__ int pagedkv_sw128_pad(const void* p, int elem_bytes) {
  return static_cast<int>((1024u - (pagedkv_smem_addr(p) & 1023u)) & 1023u) / elem_bytes;
}
#endif
"""


def mbar_init(bar, count: int):
    """``mbarrier.init`` of the shared ``uint64`` at address ``bar`` for ``count`` arrivals a phase."""
    return T.cuda.func_call("pagedkv_mbar_init", bar, T.int32(count), source_code=_SOURCE)


def mbar_expect_tx(bar, nbytes: int):
    """Arrive on ``bar`` expecting ``nbytes`` transaction bytes (the copies this thread issues next)."""
    return T.cuda.func_call("pagedkv_mbar_expect_tx", bar, T.int32(nbytes), source_code=_SOURCE)


def mbar_arrive(bar):
    """Arrive on ``bar`` (no transaction bytes)."""
    return T.cuda.func_call("pagedkv_mbar_arrive", bar, source_code=_SOURCE)


def mbar_wait(bar, parity):
    """Wait for the completion of ``bar``'s phase of parity ``parity`` (0 / 1)."""
    return T.cuda.func_call("pagedkv_mbar_wait", bar, T.Cast("int32", parity), source_code=_SOURCE)


def tma_load3(dst, bar, tmap, c0, c1, c2):
    """The box of tensor map ``tmap`` (the kernel's ``CUtensorMap`` parameter) at (c0, c1, c2) into shared memory
    at ``dst`` (1024-byte aligned for the 128-byte swizzle), counted on mbarrier ``bar``."""
    return T.cuda.func_call("pagedkv_tma_load3", dst, bar, T.address_of(tmap), T.Cast("int32", c0),
                            T.Cast("int32", c1), T.Cast("int32", c2), source_code=_SOURCE)


def tma_load5(dst, bar, tmap, *coords):
    """``tma_load3`` for a rank-5 tensor map (coordinates innermost first)."""
    if len(coords) != 5:
        raise ValueError(f"pagedkv.tir_kernels: tma_load5 takes 5 coordinates, got {len(coords)}")
    return T.cuda.func_call("pagedkv_tma_load5", dst, bar, T.address_of(tmap), *(T.Cast("int32", c) for c in coords),
                            source_code=_SOURCE)


def sw128_pad(p, elem_bytes: int):
    """Elements (of ``elem_bytes``) from shared address ``p`` to the next 1024-byte boundary (int32)."""
    return T.cuda.func_call("pagedkv_sw128_pad", p, T.int32(elem_bytes), source_code=_SOURCE, return_type="int32")


def host_aligned16(ptr):
    """Host code: ``ptr`` (a buffer element's address) is 16-byte aligned, as a tensor map's global address must be
    (``llvm.ptrmask`` keeps its low 4 bits: null iff aligned). The buffer must be declared element-aligned
    (``_abi.abi_prim_func(any_align=...)``), else LLVM folds the test with TVM's default 64-byte assumption."""
    return T.isnullptr(T.call_llvm_pure_intrin("handle", "llvm.ptrmask", ptr, T.int64(15)))


def _encode(dims: list, strides: list, box: list) -> list:
    """The arguments of ``cuTensorMapEncodeTiled`` after the data pointer, as TVM's packed
    ``runtime.cuTensorMapEncodeTiled`` takes them (2-byte elements): dims, byte strides of dims 1.., box, element
    strides 1, then interleave none, 128-byte swizzle, 128-byte L2 promotion, zeros out of bounds."""
    return [*dims, *strides, *box, *([1] * len(dims)), 0, SWIZZLE_128B, L2_PROMOTION_128B, 0]


class EncodeArgs(NamedTuple):
    """``encode_args``' list by field (``decode_args``): what a launcher outside TVM (the CPU emulator, the probe)
    passes to its own ``cuTensorMapEncodeTiled``. ``strides`` are the byte strides of dims 1.. (dim 0's is the
    element size)."""

    dims: list
    strides: list
    box: list
    elem_strides: list
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int


def decode_args(rank: int, args: list) -> EncodeArgs:
    """``encode_args(shape)`` of a rank-``rank`` map (``_encode``'s order) by field."""
    if len(args) != 4 * rank + 3:
        raise ValueError(f"pagedkv.tir_kernels: a rank-{rank} tensor map takes {4 * rank + 3} encode arguments, "
                         f"got {len(args)}")
    r = rank
    return EncodeArgs(list(args[:r]), list(args[r:2 * r - 1]), list(args[2 * r - 1:3 * r - 1]),
                      list(args[3 * r - 1:4 * r - 1]), *args[4 * r - 1:])


@dataclasses.dataclass(frozen=True)
class TensorMap3:
    """The tensor map of a ``[rows][heads][d]`` tensor of 2-byte elements (rows of ``heads * d`` elements, as
    ragged k / v), read as boxes of ``box_rows`` rows x 64 dims of one head in the 128-byte swizzle: the box
    at (``dim0``, ``head``, ``row0``) lands as ``box_rows`` rows of 128 bytes (``Sw128Layout``'s column block).
    Dims innermost first: (d, heads, rows); rows past ``rows`` read as zeros."""

    heads: int
    d: int
    box_rows: int
    rank = 3

    def encode_args(self, shape) -> list:
        """``_encode``'s arguments for a tensor of shape ``shape`` (ints or TIR expressions)."""
        return _encode([self.d, self.heads, shape[0]], [self.d * 2, self.heads * self.d * 2], [64, 1, self.box_rows])


@dataclasses.dataclass(frozen=True)
class PagedTensorMap:
    """The tensor map of a page pool ``[pages][2][heads][ps][d]`` (K then V of each page; 2-byte elements), read as
    boxes of 8 rows (keys of one page: ``ps`` a multiple of 8) x 64 dims of one head of K or V, 128-byte
    swizzled (1024 bytes, one swizzle period). Dims innermost first: (d, ps, heads, 2, pages); the box at
    (``dim0``, ``row``, ``head``, ``kv``, ``page``)."""

    heads: int
    d: int
    rank = 5
    box_rows = 8

    def encode_args(self, shape) -> list:
        ps, d, hk = shape[3], self.d, self.heads
        return _encode([d, ps, hk, 2, shape[0]], [d * 2, ps * d * 2, hk * ps * d * 2, 2 * hk * ps * d * 2],
                       [64, self.box_rows, 1, 1, 1])


@dataclasses.dataclass(frozen=True)
class LatentPageMap:
    """The tensor map of an MLA page pool ``[pages][1][1][ps][dl]`` (a page's latent rows; 2-byte elements), read as
    boxes of ``box_rows`` rows (keys of one page: a multiple of 8 dividing ``ps``; an int or the host code's
    expression of ``ps``) x 64 dims, 128-byte swizzled (each 8 rows one 1024-byte swizzle period). Dims innermost
    first: (dl, ps, pages); the box at (``dim0``, ``row``, ``page``)."""

    dl: int
    box_rows: object
    rank = 3

    def encode_args(self, shape) -> list:
        ps, dl = shape[3], self.dl
        return _encode([dl, ps, shape[0]], [dl * 2, ps * dl * 2], [64, self.box_rows, 1])


__all__ = ["EncodeArgs", "LatentPageMap", "decode_args", "host_aligned16", "L2_PROMOTION_128B", "MBAR_BYTES", "PagedTensorMap", "SW128_ALIGN", "SWIZZLE_128B", "TensorMap3",
           "mbar_arrive", "mbar_expect_tx", "mbar_init", "mbar_wait", "sw128_pad", "tma_load3", "tma_load5"]
