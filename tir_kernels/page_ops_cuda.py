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

from ._common_cuda import ceildiv, itemsize

#: Threads per block of the page kernels.
NT = 256


def _vec(head_dim: int, dtype: str) -> int:
    """Largest chunk (<= 16 bytes) that divides the head dim."""
    v = 16 // itemsize(dtype)
    while head_dim % v:
        v //= 2
    return v


def append_kv_cuda(num_kv_heads, head_dim, dtype):
    """``pagedkv_append_kv(pages, k[n,Hkv,D], v[n,Hkv,D], slot[n])``; a negative slot skips the token."""
    HKV, D = num_kv_heads, head_dim
    VEC = _vec(D, dtype)
    C = D // VEC

    @T.prim_func
    def append_kv(pages_h: T.handle, k_h: T.handle, v_h: T.handle, slot_h: T.handle):
        T.func_attr({"global_symbol": "pagedkv_append_kv", "tirx.noalias": True, "tirx.is_scheduled": True})
        n, P, ps = T.int32(), T.int32(), T.int32()
        pages = T.match_buffer(pages_h, (P, 2, HKV, ps, D), dtype)
        k = T.match_buffer(k_h, (n, HKV, D), dtype, elem_offset=T.int32())
        v = T.match_buffer(v_h, (n, HKV, D), dtype, elem_offset=T.int32())
        slot = T.match_buffer(slot_h, (n,), "int32", elem_offset=T.int32())
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

    return append_kv


def gather_kv_cuda(num_kv_heads, head_dim, dtype):
    """``pagedkv_gather_kv(pages, slot[n], k[n,Hkv,D], v[n,Hkv,D])``."""
    HKV, D = num_kv_heads, head_dim
    VEC = _vec(D, dtype)
    C = D // VEC

    @T.prim_func
    def gather_kv(pages_h: T.handle, slot_h: T.handle, k_h: T.handle, v_h: T.handle):
        T.func_attr({"global_symbol": "pagedkv_gather_kv", "tirx.noalias": True, "tirx.is_scheduled": True})
        n, P, ps = T.int32(), T.int32(), T.int32()
        pages = T.match_buffer(pages_h, (P, 2, HKV, ps, D), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32", elem_offset=T.int32())
        k = T.match_buffer(k_h, (n, HKV, D), dtype, elem_offset=T.int32())
        v = T.match_buffer(v_h, (n, HKV, D), dtype, elem_offset=T.int32())
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

    return gather_kv


def copy_page_cuda(num_kv_heads, head_dim, dtype, *, planes=2):
    """``pagedkv_copy_page(pages, src_page:i64, dst_page:i64, num_tokens:i64)``: offsets
    ``0 .. min(num_tokens, ps)`` of every head, K and V."""
    HKV, D, PL = num_kv_heads, head_dim, planes
    VEC = _vec(D, dtype)
    C = D // VEC

    @T.prim_func
    def copy_page(pages_h: T.handle, src_page: T.int64, dst_page: T.int64, num_tokens: T.int64):
        T.func_attr({"global_symbol": "pagedkv_copy_page", "tirx.noalias": True, "tirx.is_scheduled": True})
        P, ps = T.int32(), T.int32()
        pages = T.match_buffer(pages_h, (P, PL, HKV, ps, D), dtype)
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

    return copy_page


def compact_copy_cuda(num_kv_heads, head_dim, dtype, *, planes=2):
    """``pagedkv_compact_copy(pages, src_slot[n], dst_slot[n])``: token ``src_slot[i] -> dst_slot[i]``
    (destinations never overlap sources within a call, so all copies run at once)."""
    HKV, D, PL = num_kv_heads, head_dim, planes
    VEC = _vec(D, dtype)
    C = D // VEC

    @T.prim_func
    def compact_copy(pages_h: T.handle, src_slot_h: T.handle, dst_slot_h: T.handle):
        T.func_attr({"global_symbol": "pagedkv_compact_copy", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        n, P, ps = T.int32(), T.int32(), T.int32()
        pages = T.match_buffer(pages_h, (P, PL, HKV, ps, D), dtype)
        src_slot = T.match_buffer(src_slot_h, (n,), "int32", elem_offset=T.int32())
        dst_slot = T.match_buffer(dst_slot_h, (n,), "int32", elem_offset=T.int32())
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

    return compact_copy
