"""``@T.macro`` building blocks of the CPU attention kernels (one work item = entry x kv head x query tile).

The row tile, the K/V tile layouts and the base-2 online softmax are described in ``_common``. All
buffers named here are per-work-item float32 scratch:

* ``Qf[R, D]``   query rows (rotated, pre-scaled by ``sm_scale * log2(e)``);
* ``Kt[D, TK]``  the key tile, transposed so scores vectorize over keys;
* ``Vt[TK, Dv]`` the value tile;
* ``S[R, TK]``   scores, then probabilities of the current tile;
* ``O[R, Dv]``   unnormalized output; ``m[R]``, ``l[R]`` running max and sum; ``alpha[R]`` rescale.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ._common import EMPTY_LSE, MASKED, TilePlan, make_rope_macros

# 2^f on f in [-0.5, 0.5]: Taylor coefficients (ln 2)^k / k!, degree 6 (relative error < 2e-7).
_EXP2_COEFFS = (1.0, 0.6931471805599453, 0.2402265069591007, 0.05550410866482158,
                0.009618129107628477, 0.0013333558146428443, 0.00015403530393381606)


def exp2_approx(x):
    """Vectorizable ``2 ** x`` for ``x <= 0`` (float32 PrimExpr).

    ``T.exp2`` lowers to a scalar libm call per lane, which costs more than the whole score GEMM of a
    key at D = 128; this polynomial + exponent-bits form stays in SIMD registers. Inputs at or below
    -127 (masked scores, the empty running max) give exactly 0.
    """
    xv = tirx.Var("e2x", "float32")
    xi = tirx.Var("e2i", "float32")
    f = xv - xi
    poly = tirx.const(_EXP2_COEFFS[-1], "float32")
    for coeff in reversed(_EXP2_COEFFS[:-1]):
        poly = poly * f + tirx.const(coeff, "float32")
    # 2^xi from the exponent bits; xi = -127 gives biased exponent 0, i.e. the value 0.
    scale = tirx.call_intrin("float32", "tirx.reinterpret",
                             tirx.shift_left(tirx.Cast("int32", xi) + 127, 23))
    body = tirx.Let(xi, tirx.floor(xv + tirx.const(0.5, "float32")), poly * scale)
    return tirx.Let(xv, tirx.max(x, tirx.const(-127.0, "float32")), body)


def make_attn_macros(plan: TilePlan):
    """Return a namespace of the macros below, specialized to ``plan``."""
    D, DV, G, TQ, R, TK, RB, DC, dtype = (plan.d, plan.dv, plan.group, plan.tq, plan.rows, plan.tk,
                                          plan.rb, plan.dc, plan.dtype)
    init_inv_freq, rope_row = make_rope_macros(D)

    @T.macro
    def load_q(Qf, q, q_pos, tok0, ntok, h, rope, qk_scale):
        """Fill ``Qf`` from ``q[tok0 : tok0 + ntok, h*G : (h+1)*G]``; rows past the tile are zero."""
        apply_rope, rope_scale, invf = rope
        for r in T.serial(R):
            if r < TQ * G and r // G < ntok:
                for dd in T.vectorized(D):
                    Qf[r, dd] = T.Cast("float32", q[tok0 + r // G, h * G + r % G, dd])
                if apply_rope == 1:
                    rope_row(Qf, r, q_pos[tok0 + r // G], rope_scale, invf)
                for dd in T.vectorized(D):
                    Qf[r, dd] = Qf[r, dd] * qk_scale
            else:
                for dd in T.vectorized(D):
                    Qf[r, dd] = T.float32(0)

    @T.macro
    def init_state(m, l, O):
        for r in T.serial(R):
            m[r] = T.float32(EMPTY_LSE)
            l[r] = T.float32(0)
            for dd in T.vectorized(DV):
                O[r, dd] = T.float32(0)

    @T.macro
    def finish_key(Kt, krow, j, kpos, rope):
        """Rotate the staged key row ``krow`` (position ``kpos``) and store it as column ``j`` of Kt."""
        apply_rope, rope_scale, invf = rope
        if apply_rope == 1:
            rope_row(krow, 0, kpos, rope_scale, invf)
        for dd in T.serial(D):
            Kt[dd, j] = krow[0, dd]

    @T.macro
    def clear_key(Kt, Vt, j):
        # Keys past the entry are zero (never garbage: 0 * NaN would poison the PV sum).
        for dd in T.serial(D):
            Kt[dd, j] = T.float32(0)
        for dd in T.vectorized(DV):
            Vt[j, dd] = T.float32(0)

    @T.macro
    def score(S, Qf, Kt, acc):
        """``S = Qf @ Kt`` with an ``RB x TK`` register block (``acc`` is a small stack buffer)."""
        for rb in T.serial(R // RB):
            for rr in T.unroll(RB):
                for j in T.vectorized(TK):
                    acc[rr, j] = T.float32(0)
            for dd in T.serial(D):
                for rr in T.unroll(RB):
                    for j in T.vectorized(TK):
                        acc[rr, j] = acc[rr, j] + Qf[rb * RB + rr, dd] * Kt[dd, j]
            for rr in T.unroll(RB):
                for j in T.vectorized(TK):
                    S[rb * RB + rr, j] = acc[rr, j]

    @T.macro
    def softmax_update(S, m, l, alpha, mx, j0, kvlen, causal, qlen, qt0):
        """Mask the tile, then the base-2 online softmax step; ``S`` becomes probabilities.

        Row ``r`` is token ``qt0 + r // G`` of an entry with ``qlen`` queries and ``kvlen`` keys; with
        ``causal`` it sees keys ``j < kvlen - qlen + token + 1`` (bottom-right aligned).
        """
        for r in T.serial(R):
            limit: T.let[T.int32] = T.if_then_else(
                causal > 0, T.min(kvlen, kvlen - qlen + qt0 + r // G + 1), kvlen)
            mx[0] = m[r]
            for j in T.serial(TK):
                S[r, j] = T.if_then_else(j0 + j < limit, S[r, j], T.float32(MASKED))
                mx[0] = T.max(mx[0], S[r, j])
            alpha[r] = exp2_approx(m[r] - mx[0])
            for j in T.vectorized(TK):
                S[r, j] = exp2_approx(S[r, j] - mx[0])
            l[r] = l[r] * alpha[r]
            for j in T.serial(TK):
                l[r] = l[r] + S[r, j]
            m[r] = mx[0]

    @T.macro
    def pv(O, S, Vt, alpha, acc0, acc1):
        """``O = O * alpha + S @ Vt`` with an ``RB x 2DC`` register block.

        The block is split over two ``RB x DC`` buffers because TVM places only allocations under
        1 KiB on the stack (larger ones become workspace calls that LLVM cannot keep in registers).
        """
        for rb in T.serial(R // RB):
            for dc in T.serial(DV // (2 * DC)):
                for rr in T.unroll(RB):
                    for c in T.vectorized(DC):
                        acc0[rr, c] = O[rb * RB + rr, dc * 2 * DC + c] * alpha[rb * RB + rr]
                        acc1[rr, c] = O[rb * RB + rr, dc * 2 * DC + DC + c] * alpha[rb * RB + rr]
                for j in T.serial(TK):
                    for rr in T.unroll(RB):
                        for c in T.vectorized(DC):
                            acc0[rr, c] = acc0[rr, c] + S[rb * RB + rr, j] * Vt[j, dc * 2 * DC + c]
                            acc1[rr, c] = acc1[rr, c] + S[rb * RB + rr, j] * Vt[j, dc * 2 * DC + DC + c]
                for rr in T.unroll(RB):
                    for c in T.vectorized(DC):
                        O[rb * RB + rr, dc * 2 * DC + c] = acc0[rr, c]
                        O[rb * RB + rr, dc * 2 * DC + DC + c] = acc1[rr, c]

    @T.macro
    def store(o, lse, O, m, l, tok0, ntok, h):
        """Normalize and write the rows of tokens ``tok0 .. tok0 + ntok``; no keys -> o = 0, lse = EMPTY."""
        for r in T.serial(TQ * G):
            if r // G < ntok:
                if l[r] > T.float32(0):
                    for dd in T.vectorized(DV):
                        o[tok0 + r // G, h * G + r % G, dd] = T.Cast(dtype, O[r, dd] / l[r])
                    lse[tok0 + r // G, h * G + r % G] = m[r] + T.log2(l[r])
                else:
                    for dd in T.vectorized(DV):
                        o[tok0 + r // G, h * G + r % G, dd] = T.Cast(dtype, T.float32(0))
                    lse[tok0 + r // G, h * G + r % G] = T.float32(EMPTY_LSE)

    class _Macros:
        pass

    ns = _Macros()
    for name, fn in dict(init_inv_freq=init_inv_freq, load_q=load_q, init_state=init_state,
                         finish_key=finish_key, clear_key=clear_key, score=score,
                         softmax_update=softmax_update, pv=pv, store=store).items():
        setattr(ns, name, fn)
    return ns
