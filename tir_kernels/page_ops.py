"""Page movement kernels (CPU): ``append_kv``, ``gather_kv``, ``copy_page``, ``compact_copy``.

``pages[P, 2, Hkv, ps, D]``: index 0 of dim 1 is K, 1 is V; a token at slot ``s`` lives at page
``s // ps``, offset ``s % ps``. MLA pages are ``[P, 1, 1, ps, DL]`` (one latent per token): ``copy_page``
and ``compact_copy`` serve them with ``planes=1``; ``mla_append_kv`` / ``mla_gather_kv`` move latents. The page size ``ps`` is a symbolic shape variable, so one compiled kernel
serves every page size. ``pages`` is the only buffer without a symbolic ``elem_offset`` (it is always a
whole allocation); every other buffer may be a view.
"""

from __future__ import annotations

from tvm.script import tirx as T


def append_kv_cpu(num_kv_heads, head_dim, dtype):
    """``pagedkv_append_kv(pages, k[n,Hkv,D], v[n,Hkv,D], slot[n])``: write token ``s`` to ``slot[s]``.

    A negative slot skips the token (never produced by the runtime; tolerated so that padding rows
    cannot corrupt page 0).
    """
    HKV, D = num_kv_heads, head_dim

    @T.prim_func
    def append_kv(pages_h: T.handle, k_h: T.handle, v_h: T.handle, slot_h: T.handle):
        T.func_attr({"global_symbol": "pagedkv_append_kv", "tirx.noalias": True})
        n, P, ps = T.int32(), T.int32(), T.int32()
        pages = T.match_buffer(pages_h, (P, 2, HKV, ps, D), dtype)
        k = T.match_buffer(k_h, (n, HKV, D), dtype, elem_offset=T.int32())
        v = T.match_buffer(v_h, (n, HKV, D), dtype, elem_offset=T.int32())
        slot = T.match_buffer(slot_h, (n,), "int32", elem_offset=T.int32())
        for s in T.parallel(n):
            if slot[s] >= 0:
                for h in T.serial(HKV):
                    for d in T.vectorized(D):
                        pages[slot[s] // ps, 0, h, slot[s] % ps, d] = k[s, h, d]
                        pages[slot[s] // ps, 1, h, slot[s] % ps, d] = v[s, h, d]

    return append_kv


def gather_kv_cpu(num_kv_heads, head_dim, dtype):
    """``pagedkv_gather_kv(pages, slot[n], k[n,Hkv,D], v[n,Hkv,D])``: read token ``s`` from ``slot[s]``."""
    HKV, D = num_kv_heads, head_dim

    @T.prim_func
    def gather_kv(pages_h: T.handle, slot_h: T.handle, k_h: T.handle, v_h: T.handle):
        T.func_attr({"global_symbol": "pagedkv_gather_kv", "tirx.noalias": True})
        n, P, ps = T.int32(), T.int32(), T.int32()
        pages = T.match_buffer(pages_h, (P, 2, HKV, ps, D), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32", elem_offset=T.int32())
        k = T.match_buffer(k_h, (n, HKV, D), dtype, elem_offset=T.int32())
        v = T.match_buffer(v_h, (n, HKV, D), dtype, elem_offset=T.int32())
        for s in T.parallel(n):
            for h in T.serial(HKV):
                for d in T.vectorized(D):
                    k[s, h, d] = pages[slot[s] // ps, 0, h, slot[s] % ps, d]
                    v[s, h, d] = pages[slot[s] // ps, 1, h, slot[s] % ps, d]

    return gather_kv


def copy_page_cpu(num_kv_heads, head_dim, dtype, *, planes=2):
    """``pagedkv_copy_page(pages, src_page:i64, dst_page:i64, num_tokens:i64)``.

    Copies offsets ``0 .. num_tokens`` of every head, K and V, from ``src_page`` to ``dst_page`` (the
    runtime uses it when a fork point falls mid-page; ``num_tokens`` is capped at the page size).
    Parallel over (K/V, head) pairs.
    """
    HKV, D, PL = num_kv_heads, head_dim, planes

    @T.prim_func
    def copy_page(pages_h: T.handle, src_page: T.int64, dst_page: T.int64, num_tokens: T.int64):
        T.func_attr({"global_symbol": "pagedkv_copy_page", "tirx.noalias": True})
        P, ps = T.int32(), T.int32()
        pages = T.match_buffer(pages_h, (P, PL, HKV, ps, D), dtype)
        for ch in T.parallel(PL * HKV):
            for t in T.serial(T.min(T.Cast("int32", num_tokens), ps)):
                for d in T.vectorized(D):
                    pages[T.Cast("int32", dst_page), ch // HKV, ch % HKV, t, d] = \
                        pages[T.Cast("int32", src_page), ch // HKV, ch % HKV, t, d]

    return copy_page


def compact_copy_cpu(num_kv_heads, head_dim, dtype, *, planes=2):
    """``pagedkv_compact_copy(pages, src_slot[n], dst_slot[n])``: move token ``src_slot[i] -> dst_slot[i]``.

    The runtime guarantees every destination differs from every source of the call, so the copies are
    independent and run in parallel.
    """
    HKV, D, PL = num_kv_heads, head_dim, planes

    @T.prim_func
    def compact_copy(pages_h: T.handle, src_slot_h: T.handle, dst_slot_h: T.handle):
        T.func_attr({"global_symbol": "pagedkv_compact_copy", "tirx.noalias": True})
        n, P, ps = T.int32(), T.int32(), T.int32()
        pages = T.match_buffer(pages_h, (P, PL, HKV, ps, D), dtype)
        src_slot = T.match_buffer(src_slot_h, (n,), "int32", elem_offset=T.int32())
        dst_slot = T.match_buffer(dst_slot_h, (n,), "int32", elem_offset=T.int32())
        for i in T.parallel(n):
            for c, h in T.grid(PL, HKV):
                for d in T.vectorized(D):
                    pages[dst_slot[i] // ps, c, h, dst_slot[i] % ps, d] = \
                        pages[src_slot[i] // ps, c, h, src_slot[i] % ps, d]

    return compact_copy


def mla_append_kv_cpu(latent_dim, dtype):
    """``pagedkv_mla_append_kv(pages[P,1,1,ps,DL], kv[n,DL], slot[n])``; a negative slot skips the token."""
    DL = latent_dim

    @T.prim_func
    def mla_append_kv(pages_h: T.handle, kv_h: T.handle, slot_h: T.handle):
        T.func_attr({"global_symbol": "pagedkv_mla_append_kv", "tirx.noalias": True})
        n, P, ps = T.int32(), T.int32(), T.int32()
        pages = T.match_buffer(pages_h, (P, 1, 1, ps, DL), dtype)
        kv = T.match_buffer(kv_h, (n, DL), dtype, elem_offset=T.int32())
        slot = T.match_buffer(slot_h, (n,), "int32", elem_offset=T.int32())
        for s in T.parallel(n):
            if slot[s] >= 0:
                for d in T.vectorized(DL):
                    pages[slot[s] // ps, 0, 0, slot[s] % ps, d] = kv[s, d]

    return mla_append_kv


def mla_gather_kv_cpu(latent_dim, dtype):
    """``pagedkv_mla_gather_kv(pages[P,1,1,ps,DL], slot[n], kv[n,DL])``: read token ``s`` from ``slot[s]``."""
    DL = latent_dim

    @T.prim_func
    def mla_gather_kv(pages_h: T.handle, slot_h: T.handle, kv_h: T.handle):
        T.func_attr({"global_symbol": "pagedkv_mla_gather_kv", "tirx.noalias": True})
        n, P, ps = T.int32(), T.int32(), T.int32()
        pages = T.match_buffer(pages_h, (P, 1, 1, ps, DL), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32", elem_offset=T.int32())
        kv = T.match_buffer(kv_h, (n, DL), dtype, elem_offset=T.int32())
        for s in T.parallel(n):
            for d in T.vectorized(DL):
                kv[s, d] = pages[slot[s] // ps, 0, 0, slot[s] % ps, d]

    return mla_gather_kv
