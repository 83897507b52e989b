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

#: Threads per block (one block per token).
NT = 128


def split_rotary_cuda(spec):
    """``pagedkv_split_rotary`` for CUDA (arguments: ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec``."""
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
