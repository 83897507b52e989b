"""Page movement kernels (CPU): ``append_kv``, ``gather_kv``, ``copy_page``, ``compact_copy``.

``pages[P, 2, Hkv, ps, D]``: index 0 of dim 1 is K, 1 is V; a token at slot ``s`` lives at page
``s // ps``, offset ``s % ps``. MLA pages are ``[P, 1, 1, ps, DL]`` (one latent per token): ``copy_page``
and ``compact_copy`` serve them (one plane); ``mla_append_kv`` / ``mla_gather_kv`` move latents. The page size ``ps`` is a symbolic shape variable, so one compiled kernel
serves every page size. ``pages`` is the only buffer without a symbolic ``elem_offset`` (it is always a
whole allocation); every other buffer may be a view.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._abi import abi_prim_func
from ._fp8 import decode_e4m3, fp8_scales, quantize
from ..ops import shape_values


def _page_shape(spec):
    """(planes, heads, row length) of one page (the op table's ``PL``, ``PH``, ``PD``): MHA
    ``[2, Hkv, ps, D]``, MLA ``[1, 1, ps, DL]``."""
    sv = shape_values(spec)
    return sv["PL"], sv["PH"], sv["PD"]


def append_kv_cpu(spec):
    """``pagedkv_append_kv(pages, k[n,Hkv,D], v[n,Hkv,D], slot[n])``: write token ``s`` to ``slot[s]``.

    A negative slot skips the token (never produced by the runtime; tolerated so that padding rows
    cannot corrupt page 0). FP8 pages (``spec.kv_dtype``): the e4m3 code of ``k / k_scale[h]``, ``v / v_scale[h]``.
    """
    HKV, D = spec.num_kv_heads, spec.head_dim
    if spec.kv_dtype:
        return _append_kv_fp8(spec)

    @T.macro
    def body(pages, k, v, slot, dims):
        _p, ps, n = dims
        for s in T.parallel(n):
            if slot[s] >= 0:
                for h in T.serial(HKV):
                    for d in T.vectorized(D):
                        pages[slot[s] // ps, 0, h, slot[s] % ps, d] = k[s, h, d]
                        pages[slot[s] // ps, 1, h, slot[s] % ps, d] = v[s, h, d]

    return abi_prim_func("append_kv", shape_values(spec), spec.dtype, body)


def gather_kv_cpu(spec):
    """``pagedkv_gather_kv(pages, slot[n], k[n,Hkv,D], v[n,Hkv,D])``: read token ``s`` from ``slot[s]`` (FP8 pages:
    dequantized, ``code * scale``)."""
    HKV, D = spec.num_kv_heads, spec.head_dim
    if spec.kv_dtype:
        return _gather_kv_fp8(spec)

    @T.macro
    def body(pages, slot, k, v, dims):
        _p, ps, n = dims
        for s in T.parallel(n):
            for h in T.serial(HKV):
                for d in T.vectorized(D):
                    k[s, h, d] = pages[slot[s] // ps, 0, h, slot[s] % ps, d]
                    v[s, h, d] = pages[slot[s] // ps, 1, h, slot[s] % ps, d]

    return abi_prim_func("gather_kv", shape_values(spec), spec.dtype, body)


def copy_page_cpu(spec):
    """``pagedkv_copy_page(pages, src_page:i64, dst_page:i64, num_tokens:i64)``.

    Copies offsets ``0 .. num_tokens`` of every head, K and V (MLA: the one latent plane), from
    ``src_page`` to ``dst_page`` (the runtime uses it when a fork point falls mid-page; ``num_tokens`` is
    capped at the page size). Parallel over (plane, head) pairs.
    """
    PL, HKV, D = _page_shape(spec)

    @T.macro
    def body(pages, src_page, dst_page, num_tokens, dims):
        _p, ps = dims
        for ch in T.parallel(PL * HKV):
            for t in T.serial(T.min(T.Cast("int32", num_tokens), ps)):
                for d in T.vectorized(D):
                    pages[T.Cast("int32", dst_page), ch // HKV, ch % HKV, t, d] = \
                        pages[T.Cast("int32", src_page), ch // HKV, ch % HKV, t, d]

    return abi_prim_func("copy_page", shape_values(spec), spec.dtype, body, page_dtype=spec.page_dtype)


def compact_copy_cpu(spec):
    """``pagedkv_compact_copy(pages, src_slot[n], dst_slot[n])``: move token ``src_slot[i] -> dst_slot[i]``.

    The runtime guarantees every destination differs from every source of the call, so the copies are
    independent and run in parallel.
    """
    PL, HKV, D = _page_shape(spec)

    @T.macro
    def body(pages, src_slot, dst_slot, dims):
        _p, ps, n = dims
        for i in T.parallel(n):
            for c, h in T.grid(PL, HKV):
                for d in T.vectorized(D):
                    pages[dst_slot[i] // ps, c, h, dst_slot[i] % ps, d] = \
                        pages[src_slot[i] // ps, c, h, src_slot[i] % ps, d]

    return abi_prim_func("compact_copy", shape_values(spec), spec.dtype, body, page_dtype=spec.page_dtype)


def mla_append_kv_cpu(spec):
    """``pagedkv_mla_append_kv(pages[P,1,1,ps,DL], kv[n,DL], slot[n])``; a negative slot skips the token. FP8 pages:
    the code of ``kv / ckv_scale`` (first ``kv_lora_rank`` elements) and ``kv / kpe_scale`` (the rope part)."""
    DL = spec.latent_dim
    if spec.kv_dtype:
        return _mla_append_kv_fp8(spec)

    @T.macro
    def body(pages, kv, slot, dims):
        _p, ps, n = dims
        for s in T.parallel(n):
            if slot[s] >= 0:
                for d in T.vectorized(DL):
                    pages[slot[s] // ps, 0, 0, slot[s] % ps, d] = kv[s, d]

    return abi_prim_func("mla_append_kv", shape_values(spec), spec.dtype, body)


def mla_gather_kv_cpu(spec):
    """``pagedkv_mla_gather_kv(pages[P,1,1,ps,DL], slot[n], kv[n,DL])``: read token ``s`` from ``slot[s]`` (FP8 pages:
    dequantized)."""
    DL = spec.latent_dim
    if spec.kv_dtype:
        return _mla_gather_kv_fp8(spec)

    @T.macro
    def body(pages, slot, kv, dims):
        _p, ps, n = dims
        for s in T.parallel(n):
            for d in T.vectorized(DL):
                kv[s, d] = pages[slot[s] // ps, 0, 0, slot[s] % ps, d]

    return abi_prim_func("mla_gather_kv", shape_values(spec), spec.dtype, body)


# -- FP8 pages (tir_kernels._fp8): separate bodies, so that the kernels of other caches stay what they were --------
def _append_kv_fp8(spec):
    HKV, D, F = spec.num_kv_heads, spec.head_dim, fp8_scales(spec)

    @T.macro
    def body(pages, k, v, slot, dims):
        _p, ps, n = dims
        for s in T.parallel(n):
            if slot[s] >= 0:
                for h in T.serial(HKV):
                    for d in T.vectorized(D):
                        pages[slot[s] // ps, 0, h, slot[s] % ps, d] = quantize(T.Cast("float32", k[s, h, d]),
                                                                               F.k_of(h))
                        pages[slot[s] // ps, 1, h, slot[s] % ps, d] = quantize(T.Cast("float32", v[s, h, d]),
                                                                               F.v_of(h))

    return abi_prim_func("append_kv", shape_values(spec), spec.dtype, body, page_dtype=spec.page_dtype)


def _gather_kv_fp8(spec):
    HKV, D, F = spec.num_kv_heads, spec.head_dim, fp8_scales(spec)

    @T.macro
    def body(pages, slot, k, v, dims):
        _p, ps, n = dims
        for s in T.parallel(n):
            for h in T.serial(HKV):
                for d in T.vectorized(D):
                    k[s, h, d] = T.Cast(k.dtype, decode_e4m3(pages[slot[s] // ps, 0, h, slot[s] % ps, d]) * F.k_of(h))
                    v[s, h, d] = T.Cast(v.dtype, decode_e4m3(pages[slot[s] // ps, 1, h, slot[s] % ps, d]) * F.v_of(h))

    return abi_prim_func("gather_kv", shape_values(spec), spec.dtype, body, page_dtype=spec.page_dtype)


def _mla_append_kv_fp8(spec):
    DL, F = spec.latent_dim, fp8_scales(spec)

    @T.macro
    def body(pages, kv, slot, dims):
        _p, ps, n = dims
        for s in T.parallel(n):
            if slot[s] >= 0:
                for d in T.vectorized(DL):
                    pages[slot[s] // ps, 0, 0, slot[s] % ps, d] = quantize(T.Cast("float32", kv[s, d]), F.k_of(0, d))

    return abi_prim_func("mla_append_kv", shape_values(spec), spec.dtype, body, page_dtype=spec.page_dtype)


def _mla_gather_kv_fp8(spec):
    DL, F = spec.latent_dim, fp8_scales(spec)

    @T.macro
    def body(pages, slot, kv, dims):
        _p, ps, n = dims
        for s in T.parallel(n):
            for d in T.vectorized(DL):
                kv[s, d] = T.Cast(kv.dtype, decode_e4m3(pages[slot[s] // ps, 0, 0, slot[s] % ps, d]) * F.k_of(0, d))

    return abi_prim_func("mla_gather_kv", shape_values(spec), spec.dtype, body, page_dtype=spec.page_dtype)
