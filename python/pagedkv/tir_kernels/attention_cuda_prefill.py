"""CUDA prefill, ragged and paged (``attn_prefill_ragged`` / ``attn_prefill_paged``).

Design and ABI: the docstring of ``attention_cuda.py``.
"""

from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from ..kernel_table import auto_order, choose, unserved
from ..ops import ATTN_PREFILL_PAGED, ATTN_PREFILL_RAGGED, shape_values
from ._rope_table import cuda_inline_serves, make_no_inline_rope, rope_on, whole_head_scale
from ._abi import abi_prim_func, spec_op
from ._tma_cuda import host_aligned16
from ._common_cuda import check_head_dim, vec16
from ._prefill_simt_stages import PF_TY, PrefillPlan, make_prefill_kernel
from ._variant_cuda import CudaVariant
from .attention_cuda_prefill_tc import TC_TILES, make_prefill_tc

#: Path switch choosing the plain (apply_rope == 0) prefill kernel: "simt" (FP32 FMA) or a tensor-core tile of
#: ``attention_cuda_prefill_tc.TC_TILES``; which one auto takes is the selection table's (``pagedkv.kernel_table``).
PREFILL_SWITCH = "cuda_prefill_kernel"

# ---------------------------------------------------------------------------------------------------
# prefill (ragged and paged): the SIMT kernel's plan; its stages are ``_prefill_simt_stages``
# ---------------------------------------------------------------------------------------------------
def _chunk_vec(d: int, dtype: str, rope_partner: bool) -> int:
    """Elements per global-memory chunk (16 bytes when possible; a divisor of ``d`` and, for the RoPE
    partner chunk, of ``d / 2``)."""
    vec = vec16(dtype)
    while d % vec or (rope_partner and (d // 2) % vec):
        vec //= 2
    return vec


def _prefill_plan(op: str, spec, paged: bool) -> PrefillPlan:
    """The SIMT kernel's parameters (its plain kernel's: ``rope`` False): ``RI`` rows and ``KJ`` keys per
    thread, so that a block takes 48 KB of static shared memory at most; ``paged`` selects the K/V source."""
    HQ, HKV, d, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    dv = d if paged else shape_values(spec)["Dv"]  # the paged op has no Dv (o is [n, Hq, D])
    g = HQ // HKV
    check_head_dim(op, d)
    check_head_dim(op, dv, "v_head_dim")
    if max(d, dv) > 256:
        raise NotImplementedError(f"pagedkv.tir_kernels: the CUDA {op!r} kernel supports head dims up to 256, "
                                  f"got head_dim={d}, v_head_dim={dv}")
    ri, kj = (4, 2) if max(d, dv) <= 128 else (2, 1)
    rows = PF_TY * ri
    if g > rows:
        raise NotImplementedError(f"pagedkv.tir_kernels: the CUDA {op!r} kernel supports GQA groups up to "
                                  f"{rows} for head_dim={d}, got {g}")
    return PrefillPlan(hkv=HKV, g=g, d=d, dv=dv, dtype=dtype, ri=ri, kj=kj, vec=_chunk_vec(d, dtype, True),
                       vecv=_chunk_vec(dv, dtype, False), paged=paged, rope=False, var=CudaVariant.from_spec(spec))


def _make_prefill(op: str, spec, paged: bool):
    """The (rope, plain) SIMT kernel macros of a prefill PrimFunc: ``paged`` selects the K/V source; the mask
    and logits rules are ``CudaVariant`` s (compile-time; an option off leaves the code as without it)."""
    plan = _prefill_plan(op, spec, paged)
    if spec.rope is not None and not cuda_inline_serves(spec.rope, spec.head_dim):
        return None, make_prefill_kernel(plan)  # no inline kernel for the variant: the body refuses apply_rope != 0
    return make_prefill_kernel(dataclasses.replace(plan, rope=True, rope_table=spec.rope)), make_prefill_kernel(plan)


def _inline_modes(op: str, spec):
    """``(INLINE, TABLE, refuse)`` of a prefill body: whether it has an inline RoPE kernel, whether that kernel takes
    a variant's table (``apply_rope`` 1 or 2 then, passed as its set; ``rope_scale`` 1; ``sm_scale`` times the
    attention factor squared, ``_rope_table.whole_head_scale``), and the host check of a body without one."""
    table = spec.rope is not None and cuda_inline_serves(spec.rope, spec.head_dim)
    return spec.rope is None or table, table, make_no_inline_rope(op)


def use_tensor_cores(op: str, spec) -> str | None:
    """The tensor-core tile (``TC_TILES`` key) of the plain prefill kernel of ``spec``, or None for the SIMT one:
    the selection table's choice (``pagedkv.kernel_table.choose``: forced through ``cuda_prefill_kernel``, raising
    where the forced tile does not serve, else the op's first serving variant)."""
    name = choose(op, spec).name
    return None if name == "simt" else name


def tma_fallback(op: str, spec) -> str:
    """The tile a TMA tile's PrimFunc runs where TMA cannot read the operands (k / v, or the pages, not 16-byte
    aligned; pages of a size not a multiple of 8): the first non-TMA tile of the op's auto order that serves."""
    return next(v.name for v in auto_order(op)
                if v.name in TC_TILES and not TC_TILES[v.name].tma and not unserved(v, spec, op))


def attn_prefill_ragged_cuda(spec):
    """``pagedkv_attn_prefill_ragged`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``.

    The mask and logits rules (causal, sliding window, soft cap) are ``CudaVariant.from_spec(spec)``'s; a
    window also skips the key tiles below the query tile's first window start. A RoPE variant (``spec.rope``)
    has no inline kernel: ``apply_rope != 0`` raises (``_rope_table.make_no_inline_rope``).
    """
    tile = use_tensor_cores(ATTN_PREFILL_RAGGED, spec)
    TC = tile is not None  # a bool: parse-time ``if``
    # A TMA tile needs 16-byte aligned k / v (a tensor map's address): other views take its fallback tile.
    TMA = TC and TC_TILES[tile].tma
    kernel_rope, kernel_plain = _make_prefill(ATTN_PREFILL_RAGGED, spec, paged=False)
    kernel_tc = make_prefill_tc(ATTN_PREFILL_RAGGED, spec, paged=False, tile=tile) if TC else None
    kernel_fb = make_prefill_tc(ATTN_PREFILL_RAGGED, spec, paged=False, tile=tma_fallback(ATTN_PREFILL_RAGGED, spec)) if TMA else None
    INLINE, TABLE, refuse = _inline_modes(ATTN_PREFILL_RAGGED, spec)

    @T.macro
    def plain(q, k, v, q_indptr, kv_indptr, q_pos, k_pos_offset, o, lse, causal, rope_scale, rope_theta, sm_scale,
              n, B):
        if TMA:
            if T.And(host_aligned16(T.address_of(k[0, 0, 0])), host_aligned16(T.address_of(v[0, 0, 0]))):
                kernel_tc(q, q_indptr, o, lse, (k, v, kv_indptr), B, n, causal, sm_scale)
            else:
                kernel_fb(q, q_indptr, o, lse, (k, v, kv_indptr), B, n, causal, sm_scale)
        elif TC:
            kernel_tc(q, q_indptr, o, lse, (k, v, kv_indptr), B, n, causal, sm_scale)
        else:
            kernel_plain(q, q_indptr, q_pos, k_pos_offset, o, lse, (k, v, kv_indptr), B, n, causal,
                         rope_scale, rope_theta, sm_scale)

    @T.macro
    def body(q, k, v, q_indptr, kv_indptr, q_pos, k_pos_offset, o, lse, causal, apply_rope, rope_scale,
             rope_theta, sm_scale, dims):
        n, _m, B = dims
        # Two kernels: inline RoPE costs registers that the plain kernel does not pay for. The tensor-core
        # kernel has no inline RoPE: with it, apply_rope == 1 still runs the SIMT RoPE kernel.
        if not INLINE:  # static: a RoPE variant without an inline kernel
            refuse(apply_rope)
            plain(q, k, v, q_indptr, kv_indptr, q_pos, k_pos_offset, o, lse, causal, rope_scale, rope_theta,
                  sm_scale, n, B)
        elif TABLE:  # static: a variant's table (_inline_modes)
            if rope_on(apply_rope):
                kernel_rope(q, q_indptr, q_pos, k_pos_offset, o, lse, (k, v, kv_indptr), B, n, causal,
                            T.float32(1), T.Cast("float32", apply_rope), whole_head_scale(spec.rope, sm_scale))
            else:
                plain(q, k, v, q_indptr, kv_indptr, q_pos, k_pos_offset, o, lse, causal, rope_scale, rope_theta,
                      sm_scale, n, B)
        elif apply_rope == 1:
            kernel_rope(q, q_indptr, q_pos, k_pos_offset, o, lse, (k, v, kv_indptr), B, n, causal,
                        rope_scale, rope_theta, sm_scale)
        else:
            plain(q, k, v, q_indptr, kv_indptr, q_pos, k_pos_offset, o, lse, causal, rope_scale, rope_theta,
                  sm_scale, n, B)

    return abi_prim_func(spec_op(ATTN_PREFILL_RAGGED, spec), shape_values(spec), spec.dtype, body, scheduled=True,
                         any_align=("k", "v") if TMA else ())


def attn_prefill_paged_cuda(spec):
    """``pagedkv_attn_prefill_paged`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``;
    mask and logits rules and RoPE variants as ``attn_prefill_ragged_cuda``."""
    tile = use_tensor_cores(ATTN_PREFILL_PAGED, spec)
    TC = tile is not None
    TMA = TC and TC_TILES[tile].tma  # boxes of 8 keys of a page: pages 16-byte aligned, ps a multiple of 8
    kernel_rope, kernel_plain = _make_prefill(ATTN_PREFILL_PAGED, spec, paged=True)
    kernel_tc = make_prefill_tc(ATTN_PREFILL_PAGED, spec, paged=True, tile=tile) if TC else None
    kernel_fb = make_prefill_tc(ATTN_PREFILL_PAGED, spec, paged=True,
                                tile=tma_fallback(ATTN_PREFILL_PAGED, spec)) if TMA else None
    INLINE, TABLE, refuse = _inline_modes(ATTN_PREFILL_PAGED, spec)

    @T.macro
    def plain(q, q_indptr, kvb, q_pos, k_pos_offset, o, lse, causal, rope_scale, rope_theta, sm_scale, n, B):
        pages, page_values, page_indptr, ps, last_page_len = kvb
        if TMA:
            if T.And(T.truncmod(ps, 8) == 0, host_aligned16(T.address_of(pages[0, 0, 0, 0, 0]))):
                kernel_tc(q, q_indptr, o, lse, (pages, page_values, page_indptr, ps, last_page_len), B, n,
                          causal, sm_scale)
            else:
                kernel_fb(q, q_indptr, o, lse, (pages, page_values, page_indptr, ps, last_page_len), B, n,
                          causal, sm_scale)
        elif TC:
            kernel_tc(q, q_indptr, o, lse, (pages, page_values, page_indptr, ps, last_page_len), B, n,
                      causal, sm_scale)
        else:
            kernel_plain(q, q_indptr, q_pos, k_pos_offset, o, lse,
                         (pages, page_values, page_indptr, ps, last_page_len), B, n, causal,
                         rope_scale, rope_theta, sm_scale)

    @T.macro
    def body(q, q_indptr, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, causal,
             apply_rope, rope_scale, rope_theta, sm_scale, dims):
        n, B, _p, ps, _nnz = dims
        if not INLINE:  # static: a RoPE variant without an inline kernel
            refuse(apply_rope)
            plain(q, q_indptr, (pages, page_values, page_indptr, ps, last_page_len), q_pos, k_pos_offset, o, lse,
                  causal, rope_scale, rope_theta, sm_scale, n, B)
        elif TABLE:  # static: a variant's table (_inline_modes)
            if rope_on(apply_rope):
                kernel_rope(q, q_indptr, q_pos, k_pos_offset, o, lse,
                            (pages, page_values, page_indptr, ps, last_page_len), B, n, causal,
                            T.float32(1), T.Cast("float32", apply_rope), whole_head_scale(spec.rope, sm_scale))
            else:
                plain(q, q_indptr, (pages, page_values, page_indptr, ps, last_page_len), q_pos, k_pos_offset, o,
                      lse, causal, rope_scale, rope_theta, sm_scale, n, B)
        elif apply_rope == 1:
            kernel_rope(q, q_indptr, q_pos, k_pos_offset, o, lse,
                        (pages, page_values, page_indptr, ps, last_page_len), B, n, causal,
                        rope_scale, rope_theta, sm_scale)
        else:
            plain(q, q_indptr, (pages, page_values, page_indptr, ps, last_page_len), q_pos, k_pos_offset, o, lse,
                  causal, rope_scale, rope_theta, sm_scale, n, B)

    return abi_prim_func(spec_op(ATTN_PREFILL_PAGED, spec), shape_values(spec), spec.dtype, body, scheduled=True,
                         any_align=("pages",) if TMA else ())
