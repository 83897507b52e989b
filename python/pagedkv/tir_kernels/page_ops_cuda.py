"""Page movement kernels for CUDA: ``append_kv``, ``gather_kv``, ``copy_page``, ``compact_copy``.

Same ABI and semantics as ``page_ops.py`` (CPU). Every kernel is a flat 1-D grid of 256-thread blocks; a
thread moves one ``VEC``-element chunk (16 bytes when the head dim allows) of one (token, K/V, head) row.
Page accesses are 16-byte vector loads/stores (``pages`` has no element offset and rows are ``D`` elements,
so a chunk is 16-byte aligned); the other buffers are views with any element offset, read or written one
element at a time by the same thread (consecutive threads own consecutive chunks, so a warp still covers
contiguous memory).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..ops import APPEND_KV, COMPACT_COPY, COPY_PAGE, GATHER_KV, shape_values
from ._abi import abi_prim_func
from ._common_cuda import ceildiv, itemsize

#: Threads per block of the page kernels.
NT = 256


def _vec(head_dim: int, dtype: str) -> int:
    """Largest chunk (<= 16 bytes) that divides the head dim."""
    v = 16 // itemsize(dtype)
    while head_dim % v:
        v //= 2
    return v


def append_kv_cuda(spec):
    """``pagedkv_append_kv`` (arguments: ``pagedkv.ops.OP_SPECS``) for a ``KernelSpec``; a negative slot
    skips the token."""
    HKV, D, dtype = spec.num_kv_heads, spec.head_dim, spec.dtype
    VEC = _vec(D, dtype)
    C = D // VEC

    @T.macro
    def body(pages, k, v, slot, dims):
        _p, ps, n = dims
        for bx in T.thread_binding(T.max(ceildiv(n * (HKV * C), NT), 1), thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                kr = T.alloc_buffer((VEC,), dtype, scope="local")
                vr = T.alloc_buffer((VEC,), dtype, scope="local")
                if bx * NT + tx < n * (HKV * C):
                    s: T.let[T.int32] = T.truncdiv(bx * NT + tx, HKV * C)
                    h: T.let[T.int32] = T.truncmod(T.truncdiv(bx * NT + tx, C), HKV)
                    c: T.let[T.int32] = T.truncmod(bx * NT + tx, C)
                    sl: T.let[T.int32] = slot[s]
                    if sl >= 0:
                        # Element reads of the views into registers, then one vector store per row.
                        for e in T.serial(VEC):
                            kr[e] = k[s, h, c * VEC + e]
                        for e in T.serial(VEC):
                            vr[e] = v[s, h, c * VEC + e]
                        for e in T.vectorized(VEC):
                            pages[T.truncdiv(sl, ps), 0, h, T.truncmod(sl, ps), c * VEC + e] = kr[e]
                        for e in T.vectorized(VEC):
                            pages[T.truncdiv(sl, ps), 1, h, T.truncmod(sl, ps), c * VEC + e] = vr[e]

    return abi_prim_func(APPEND_KV, shape_values(spec), dtype, body, scheduled=True)


def gather_kv_cuda(spec):
    """``pagedkv_gather_kv`` (arguments: ``pagedkv.ops.OP_SPECS``) for a ``KernelSpec``."""
    HKV, D, dtype = spec.num_kv_heads, spec.head_dim, spec.dtype
    VEC = _vec(D, dtype)
    C = D // VEC

    @T.macro
    def body(pages, slot, k, v, dims):
        _p, ps, n = dims
        for bx in T.thread_binding(T.max(ceildiv(n * (HKV * C), NT), 1), thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                kr = T.alloc_buffer((VEC,), dtype, scope="local")
                vr = T.alloc_buffer((VEC,), dtype, scope="local")
                if bx * NT + tx < n * (HKV * C):
                    s: T.let[T.int32] = T.truncdiv(bx * NT + tx, HKV * C)
                    h: T.let[T.int32] = T.truncmod(T.truncdiv(bx * NT + tx, C), HKV)
                    c: T.let[T.int32] = T.truncmod(bx * NT + tx, C)
                    sl: T.let[T.int32] = slot[s]
                    for e in T.vectorized(VEC):
                        kr[e] = pages[T.truncdiv(sl, ps), 0, h, T.truncmod(sl, ps), c * VEC + e]
                    for e in T.vectorized(VEC):
                        vr[e] = pages[T.truncdiv(sl, ps), 1, h, T.truncmod(sl, ps), c * VEC + e]
                    for e in T.serial(VEC):
                        k[s, h, c * VEC + e] = kr[e]
                    for e in T.serial(VEC):
                        v[s, h, c * VEC + e] = vr[e]

    return abi_prim_func(GATHER_KV, shape_values(spec), dtype, body, scheduled=True)


def _page_dims(spec):
    """``(heads, dim, planes)`` of a page row: ``(Hkv, D, 2)`` (K and V) or, MLA, ``(1, latent dim, 1)``."""
    sv = shape_values(spec)
    return sv["PH"], sv["PD"], sv["PL"]


def copy_page_cuda(spec):
    """``pagedkv_copy_page`` (arguments: ``pagedkv.ops.OP_SPECS``) for a ``KernelSpec`` (MHA or MLA pages):
    offsets ``0 .. min(num_tokens, ps)`` of every head and plane."""
    (HKV, D, PL), dtype = _page_dims(spec), spec.dtype
    VEC = _vec(D, dtype)
    C = D // VEC

    @T.macro
    def body(pages, src_page, dst_page, num_tokens, dims):
        _p, ps = dims
        # Tokens to copy (0 when num_tokens <= 0).
        nt: T.let[T.int32] = T.max(T.min(T.Cast("int32", T.min(num_tokens, T.int64(1 << 30))), ps), 0)
        for bx in T.thread_binding(T.max(ceildiv(nt * (PL * HKV * C), NT), 1), thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                if bx * NT + tx < nt * (PL * HKV * C):
                    ch: T.let[T.int32] = T.truncdiv(bx * NT + tx, nt * C)
                    t: T.let[T.int32] = T.truncmod(T.truncdiv(bx * NT + tx, C), nt)
                    c: T.let[T.int32] = T.truncmod(bx * NT + tx, C)
                    for e in T.vectorized(VEC):
                        pages[T.Cast("int32", dst_page), ch // HKV, ch % HKV, t, c * VEC + e] = \
                            pages[T.Cast("int32", src_page), ch // HKV, ch % HKV, t, c * VEC + e]

    return abi_prim_func(COPY_PAGE, shape_values(spec), dtype, body, scheduled=True)


def compact_copy_cuda(spec):
    """``pagedkv_compact_copy`` (arguments: ``pagedkv.ops.OP_SPECS``) for a ``KernelSpec`` (MHA or MLA
    pages): token ``src_slot[i] -> dst_slot[i]`` (destinations never overlap sources within a call, so all
    copies run at once)."""
    (HKV, D, PL), dtype = _page_dims(spec), spec.dtype
    VEC = _vec(D, dtype)
    C = D // VEC

    @T.macro
    def body(pages, src_slot, dst_slot, dims):
        _p, ps, n = dims
        for bx in T.thread_binding(T.max(ceildiv(n * (PL * HKV * C), NT), 1), thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                if bx * NT + tx < n * (PL * HKV * C):
                    i: T.let[T.int32] = T.truncdiv(bx * NT + tx, PL * HKV * C)
                    ch: T.let[T.int32] = T.truncmod(T.truncdiv(bx * NT + tx, C), PL * HKV)
                    c: T.let[T.int32] = T.truncmod(bx * NT + tx, C)
                    src: T.let[T.int32] = src_slot[i]
                    dst: T.let[T.int32] = dst_slot[i]
                    for e in T.vectorized(VEC):
                        pages[T.truncdiv(dst, ps), ch // HKV, ch % HKV, T.truncmod(dst, ps), c * VEC + e] = \
                            pages[T.truncdiv(src, ps), ch // HKV, ch % HKV, T.truncmod(src, ps), c * VEC + e]

    return abi_prim_func(COMPACT_COPY, shape_values(spec), dtype, body, scheduled=True)
