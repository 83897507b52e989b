"""Inline RoPE of the CUDA paged decode kernel: no sin / cos in the key loop.

The score of key ``j`` (position ``P + o``, ``P`` the position of the block step's first key and
``o = ty*KPT + kk`` the key's offset in the step) is ``<R(p_q) q, R(P + o) k> = <R(p_q - P) q, R(o) k>``
(``R(a)`` rotates each pair ``(x_i, x_{i+D/2})`` by ``a * w_i``; rotations compose and are orthogonal). So

* ``R(o) k``: ``o`` is fixed per thread and ``kk``, so its cos / sin are computed once per thread
  (``rope_setup``: ``KPT * VEC/2`` of them) and a key costs 4 float ops per pair (``score``);
* ``R(p_q - P) q``: the same for every key of a step and every lane group, so once per step of ``TKB`` keys
  for the whole block: each batch of ``NW`` steps, lane group ``ty`` rotates the ``GC`` q rows to step
  ``ty``'s position into a shared table (``rope_q_table``, one sin / cos per pair and step), and every lane
  group reads the row of the step it runs (``load_q_table``, float4 shared loads).

Sin / cos are ``_sincos_cuda.rope_sincos`` (exact angle, about 1e-7 from the float64 reference up to
position 2M): one per (position, pair) per block, none per kv head of a key nor per GQA row.

Shared rows are lane-major (``lane_slot``): element ``e`` of lane ``tx`` at ``(e // 4) * 4L + 4 tx + e % 4``,
so the 16-byte accesses of consecutive lanes are consecutive (no bank conflicts). A lane's element ``e < VEC/2``
is dim ``tx*VEC/2 + e``, element ``VEC/2 + e`` dim ``D/2 + tx*VEC/2 + e`` (the K layout of ``load_kv``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._common import EMPTY_LSE, LOG2E
from ._decode_stages_cuda import DecodePlan
from ._rope_table import freq_parts
from ._sincos_cuda import rope_freq, rope_sincos


def make_rope_stages(p: DecodePlan, table=None):
    """``(rope_setup, rope_q_table, load_q_table)`` macros for plan ``p`` (module docstring). ``table``: a RoPE
    variant's (``KernelSpec.rope``, whole head in halves): the pair frequencies are its constants and
    ``rope_setup``'s ``rope_theta`` carries the set (``apply_rope``; 2 = LongRoPE's long one)."""
    VEC, GC, L0, KPT, D = p.vec, p.gc, p.l0, p.kpt, p.d
    # LW: elements of one float4 column of a lane-major row (4 per lane)
    H2, HALF, LW = VEC // 2, D // 2, p.l * 4

    @T.macro
    def rope_setup(w_s, Oc, Os, q_raw, Orr, m, lsum, q, b, row0, rope_theta, rope_scale, sm_scale, tx, ty):
        """Per thread: the key-offset rotations ``Oc``, ``Os`` (``[KPT * VEC/2]``, offset ``ty*KPT + kk``) and
        the empty softmax state. Lane group 0 writes, for the first barrier of the key loop, the frequencies of
        each lane's pairs (``w_s[0] + w_s[1]``; in shared memory: 2 * VEC/2 registers less through the key loop)
        and the block's q rows (scaled by ``sm_scale * log2(e)``, unrotated; zeros on padding lanes) to
        ``q_raw``."""
        wh = T.alloc_buffer((H2,), "float32", scope="local")
        wl = T.alloc_buffer((H2,), "float32", scope="local")
        for e in T.unroll(H2):
            if table is None:  # static
                rope_freq(wh, wl, e, tx * H2 + e, rope_theta, rope_scale, D)
            else:
                wh[e] = freq_parts(table, tx * H2 + e, rope_theta)[0]
                wl[e] = freq_parts(table, tx * H2 + e, rope_theta)[1]
        for kk in T.unroll(KPT):
            for e in T.unroll(H2):
                rope_sincos(Oc, Os, kk * H2 + e, ty * KPT + kk, wh[e], wl[e])
        if ty == 0:
            for e in T.unroll(H2):
                w_s[0, tx * H2 + e] = wh[e]
                w_s[1, tx * H2 + e] = wl[e]
        for g in T.unroll(GC):
            for e in T.unroll(VEC):
                Orr[g, e] = T.float32(0)
            m[g] = T.float32(EMPTY_LSE)
            lsum[g] = T.float32(0)
            if ty == 0:
                for e in T.unroll(H2):
                    q_raw[g, T.truncdiv(e, 4) * LW + tx * 4 + T.truncmod(e, 4)] = T.if_then_else(
                        tx < L0, T.Cast("float32", q[b, row0 + g, T.min(tx, L0 - 1) * H2 + e]), T.float32(0)
                    ) * (sm_scale * T.float32(LOG2E))
                    q_raw[g, T.truncdiv(H2 + e, 4) * LW + tx * 4 + T.truncmod(H2 + e, 4)] = T.if_then_else(
                        tx < L0, T.Cast("float32", q[b, row0 + g, HALF + T.min(tx, L0 - 1) * H2 + e]), T.float32(0)
                    ) * (sm_scale * T.float32(LOG2E))

    @T.macro
    def rope_q_table(qtab, q_raw, w_s, rel, tx, ty):
        """``qtab[ty, g] = R(rel) q_raw[g]`` (lane-major rows): the q rows rotated for the step whose first key
        is at ``q_pos - rel``."""
        cs = T.alloc_buffer((H2,), "float32", scope="local")
        sn = T.alloc_buffer((H2,), "float32", scope="local")
        qv = T.alloc_buffer((VEC,), "float32", scope="local")
        qt = T.alloc_buffer((VEC,), "float32", scope="local")
        for e in T.unroll(H2):
            rope_sincos(cs, sn, e, rel, w_s[0, tx * H2 + e], w_s[1, tx * H2 + e])
        for g in T.unroll(GC):
            for u in T.unroll(VEC // 4):
                for e in T.vectorized(4):
                    qv[u * 4 + e] = q_raw[g, u * LW + tx * 4 + e]
            for e in T.unroll(H2):
                qt[e] = qv[e] * cs[e] - qv[H2 + e] * sn[e]
                qt[H2 + e] = qv[H2 + e] * cs[e] + qv[e] * sn[e]
            for u in T.unroll(VEC // 4):
                for e in T.vectorized(4):
                    qtab[ty, g, u * LW + tx * 4 + e] = qt[u * 4 + e]

    @T.macro
    def load_q_table(Qr, qtab, w, tx):
        """``Qr[g] = qtab[w, g]`` (the lane's VEC elements, float4 shared loads)."""
        for g in T.unroll(GC):
            for u in T.unroll(VEC // 4):
                for e in T.vectorized(4):
                    Qr[g, u * 4 + e] = qtab[w, g, u * LW + tx * 4 + e]

    return rope_setup, rope_q_table, load_q_table


__all__ = ["make_rope_stages"]
