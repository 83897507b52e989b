"""``split_rotary`` for CUDA: split fused qkv into q, k, v and optionally apply RoPE to q and k.

Same ABI and semantics as ``rope.py`` (CPU). One block of 128 threads per token: the token's cos/sin table
(``D/2`` entries, float32, in shared memory) is computed once and shared by its ``Hq + Hkv`` rotated heads;
then the threads walk the token's rotation pairs ``(head, i)`` (rotating ``x[i]`` and ``x[i + D/2]``) and
the copied elements with consecutive threads on consecutive elements. The angle, divisor and sin/cos follow
``_common_cuda`` (the CPU kernels' float32 formula, exact under ``--use_fast_math``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._common_cuda import ceildiv, cos_approx, rope_angle, rope_divisor, sin_approx

#: Threads per block (one block per token).
NT = 128


def split_rotary_cuda(num_qo_heads, num_kv_heads, head_dim, dtype):
    """``pagedkv_split_rotary(qkv[n, Hq+2Hkv, D], q_pos[n], q[n,Hq,D], k[n,Hkv,D], v[n,Hkv,D],
    apply_rope:i32, rope_scale:f32, rope_theta:f32)``."""
    HQ, HKV, D = num_qo_heads, num_kv_heads, head_dim
    HALF = D // 2
    NROT = (HQ + HKV) * HALF  # rotation pairs of a token
    NQK = (HQ + HKV) * D  # q and k elements of a token
    NV = HKV * D

    @T.prim_func
    def split_rotary(qkv_h: T.handle, q_pos_h: T.handle, q_h: T.handle, k_h: T.handle, v_h: T.handle,
                     apply_rope: T.int32, rope_scale: T.float32, rope_theta: T.float32):
        T.func_attr({"global_symbol": "pagedkv_split_rotary", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        n = T.int32()
        qkv = T.match_buffer(qkv_h, (n, HQ + 2 * HKV, D), dtype, elem_offset=T.int32())
        q_pos = T.match_buffer(q_pos_h, (n,), "int32", elem_offset=T.int32())
        q = T.match_buffer(q_h, (n, HQ, D), dtype, elem_offset=T.int32())
        k = T.match_buffer(k_h, (n, HKV, D), dtype, elem_offset=T.int32())
        v = T.match_buffer(v_h, (n, HKV, D), dtype, elem_offset=T.int32())
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

    return split_rotary
