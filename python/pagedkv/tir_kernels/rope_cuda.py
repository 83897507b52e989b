"""``split_rotary`` for CUDA: split fused qkv into q, k, v and optionally apply RoPE to q and k.

Same ABI and semantics as ``rope.py`` (CPU). One block of 128 threads per token: the token's cos/sin table
(``D/2`` entries, float32, in shared memory) is computed once and shared by its ``Hq + Hkv`` rotated heads;
then the threads walk the token's rotation pairs ``(head, i)`` (rotating ``x[i]`` and ``x[i + D/2]``) and
the copied elements with consecutive threads on consecutive elements. The angle, divisor and sin/cos follow
``_common_cuda`` (the CPU kernels' float32 formula, exact under ``--use_fast_math``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..ops import SPLIT_ROTARY, shape_values
from ._abi import abi_prim_func
from ._common_cuda import ceildiv, cos_approx, rope_angle, rope_divisor, sin_approx
from ._rope_table import freq_parts, rope_on, scaled
from ._sincos_cuda import rope_sincos

#: Threads per block (one block per token).
NT = 128


def split_rotary_cuda(spec):
    """``pagedkv_split_rotary`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``; a RoPE
    variant (``spec.rope``) is ``_split_rotary_table``."""
    if spec.rope is not None:
        return _split_rotary_table(spec)
    HQ, HKV, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    HALF = D // 2
    NROT = (HQ + HKV) * HALF  # rotation pairs of a token
    NQK = (HQ + HKV) * D  # q and k elements of a token
    NV = HKV * D

    @T.macro
    def body(qkv, q_pos, q, k, v, apply_rope, rope_scale, rope_theta, dims):
        n, = dims
        for s in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                cs = T.alloc_buffer((HALF,), "float32", scope="shared")
                sn = T.alloc_buffer((HALF,), "float32", scope="shared")
                if s < n and apply_rope == 1:
                    for it in T.serial(ceildiv(HALF, NT)):
                        if it * NT + tx < HALF:
                            angle: T.let[T.float32] = rope_angle(
                                q_pos[s], rope_scale, rope_divisor(it * NT + tx, rope_theta, D))
                            cs[it * NT + tx] = cos_approx(angle)
                            sn[it * NT + tx] = sin_approx(angle)
                T.tvm_storage_sync("shared")
                if s < n:
                    if apply_rope == 1:
                        for it in T.serial(ceildiv(NROT, NT)):
                            if it * NT + tx < NROT:
                                h: T.let[T.int32] = T.truncdiv(it * NT + tx, HALF)
                                i: T.let[T.int32] = T.truncmod(it * NT + tx, HALF)
                                x0: T.let[T.float32] = T.Cast("float32", qkv[s, h, i])
                                x1: T.let[T.float32] = T.Cast("float32", qkv[s, h, i + HALF])
                                if h < HQ:
                                    q[s, h, i] = T.Cast(dtype, x0 * cs[i] - x1 * sn[i])
                                    q[s, h, i + HALF] = T.Cast(dtype, x1 * cs[i] + x0 * sn[i])
                                else:
                                    k[s, h - HQ, i] = T.Cast(dtype, x0 * cs[i] - x1 * sn[i])
                                    k[s, h - HQ, i + HALF] = T.Cast(dtype, x1 * cs[i] + x0 * sn[i])
                    else:
                        for it in T.serial(ceildiv(NQK, NT)):
                            if it * NT + tx < NQK:
                                h: T.let[T.int32] = T.truncdiv(it * NT + tx, D)
                                d: T.let[T.int32] = T.truncmod(it * NT + tx, D)
                                if h < HQ:
                                    q[s, h, d] = qkv[s, h, d]
                                else:
                                    k[s, h - HQ, d] = qkv[s, h, d]
                    for it in T.serial(ceildiv(NV, NT)):
                        if it * NT + tx < NV:
                            v[s, T.truncdiv(it * NT + tx, D), T.truncmod(it * NT + tx, D)] = \
                                qkv[s, HQ + HKV + T.truncdiv(it * NT + tx, D), T.truncmod(it * NT + tx, D)]

    return abi_prim_func(SPLIT_ROTARY, shape_values(spec), dtype, body, scheduled=True)


def _table_macros(spec):
    """``(sincos, rotate)`` of ``_split_rotary_table``: a pair's cos / sin of the table at a position, and a token's
    rotated pairs (and copied dims past ``rotary_dim``) from the shared cos / sin rows."""
    HQ, HKV, D, dtype, tab = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.rope
    HALF, R = tab.half, tab.rotary_dim
    NROT, NPASS = (HQ + HKV) * HALF, (HQ + HKV) * (D - R)  # rotation pairs; q and k elements past rotary_dim

    def ia(i):
        return tab.pair(i)[0]

    def ib(i):
        return tab.pair(i)[1]

    @T.macro
    def sincos(cs, sn, i, pos, apply_rope):
        w_hi: T.let[T.float32] = freq_parts(tab, i, apply_rope)[0]
        w_lo: T.let[T.float32] = freq_parts(tab, i, apply_rope)[1]
        rope_sincos(cs, sn, i, pos, w_hi, w_lo)
        cs[i] = scaled(tab, cs[i])
        sn[i] = scaled(tab, sn[i])

    @T.macro
    def rotate(qkv, q, k, s, cs, sn, tx):
        for it in T.serial(ceildiv(NROT, NT)):
            if it * NT + tx < NROT:
                h: T.let[T.int32] = T.truncdiv(it * NT + tx, HALF)
                i: T.let[T.int32] = T.truncmod(it * NT + tx, HALF)
                x0: T.let[T.float32] = T.Cast("float32", qkv[s, h, ia(i)])
                x1: T.let[T.float32] = T.Cast("float32", qkv[s, h, ib(i)])
                if h < HQ:
                    q[s, h, ia(i)] = T.Cast(dtype, x0 * cs[i] - x1 * sn[i])
                    q[s, h, ib(i)] = T.Cast(dtype, x1 * cs[i] + x0 * sn[i])
                else:
                    k[s, h - HQ, ia(i)] = T.Cast(dtype, x0 * cs[i] - x1 * sn[i])
                    k[s, h - HQ, ib(i)] = T.Cast(dtype, x1 * cs[i] + x0 * sn[i])
        if NPASS > 0:  # static
            for it in T.serial(ceildiv(NPASS, NT)):
                if it * NT + tx < NPASS:
                    h: T.let[T.int32] = T.truncdiv(it * NT + tx, D - R)
                    d: T.let[T.int32] = R + T.truncmod(it * NT + tx, D - R)
                    if h < HQ:
                        q[s, h, d] = qkv[s, h, d]
                    else:
                        k[s, h - HQ, d] = qkv[s, h, d]

    return sincos, rotate


def _split_rotary_table(spec):
    """``split_rotary_cuda`` for a RoPE variant (``spec.rope``, ``_rope_table``): each pair's frequency is a
    constant (a select tree over the thread's pair; ``apply_rope`` 2 picks LongRoPE's long set), its cos / sin come
    from ``_sincos_cuda.rope_sincos`` on the float32 pair ``hi + lo`` (the angle is never rounded: float64
    reference accuracy, as the decode kernels') times the attention factor; pair ``i`` is ``tab.pair(i)`` and the
    dims past ``rotary_dim`` are copied."""
    HQ, HKV, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    HALF, NQK, NV = spec.rope.half, (HQ + HKV) * D, HKV * D
    sincos, rotate = _table_macros(spec)

    @T.macro
    def body(qkv, q_pos, q, k, v, apply_rope, rope_scale, rope_theta, dims):
        n, = dims
        for s in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                cs = T.alloc_buffer((HALF,), "float32", scope="shared")
                sn = T.alloc_buffer((HALF,), "float32", scope="shared")
                if s < n and rope_on(apply_rope):
                    for it in T.serial(ceildiv(HALF, NT)):
                        if it * NT + tx < HALF:
                            sincos(cs, sn, it * NT + tx, q_pos[s], apply_rope)
                T.tvm_storage_sync("shared")
                if s < n:
                    if rope_on(apply_rope):
                        rotate(qkv, q, k, s, cs, sn, tx)
                    else:
                        for it in T.serial(ceildiv(NQK, NT)):
                            if it * NT + tx < NQK:
                                h: T.let[T.int32] = T.truncdiv(it * NT + tx, D)
                                d: T.let[T.int32] = T.truncmod(it * NT + tx, D)
                                if h < HQ:
                                    q[s, h, d] = qkv[s, h, d]
                                else:
                                    k[s, h - HQ, d] = qkv[s, h, d]
                    for it in T.serial(ceildiv(NV, NT)):
                        if it * NT + tx < NV:
                            v[s, T.truncdiv(it * NT + tx, D), T.truncmod(it * NT + tx, D)] = \
                                qkv[s, HQ + HKV + T.truncdiv(it * NT + tx, D), T.truncmod(it * NT + tx, D)]

    return abi_prim_func(SPLIT_ROTARY, shape_values(spec), dtype, body, scheduled=True)
