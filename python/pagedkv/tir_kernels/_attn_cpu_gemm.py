"""Score, online-softmax and PV steps of the CPU attention kernels, in two score layouts.

Both variants expose the same macros, so one work-item body serves decode and prefill:

* ``prepare(Qf, Qt, lim, nrows, kvlen, causal, qlen, qt0)``: per-item setup (``nrows`` valid rows),
  including the per-row key limits ``lim`` of the attention variant (``_variant_cpu.CpuVariant``);
* ``score(S, Qf, Qt, Kf, acc, red, nk, nrows)``: scores of the first ``nk`` keys of the tile (log2 units,
  ``Qf`` is pre-scaled) for (at least) the ``nrows`` valid rows;
* ``softmax(S, m, l, alpha, mx, lim, j0, nk, nrows)``: the variant's logits transform and mask, then the
  base-2 online softmax step; ``S`` becomes probabilities, ``alpha[r]`` the rescale of row ``r``'s previous output;
* ``pv(O, S, Vf, alpha, acc0, acc1, nk, nrows)``: ``O = O * alpha + P @ Vf`` with an ``RB x 2DC``
  register block, over the row blocks that hold the ``nrows`` valid rows.

Only the ``nk`` valid keys of a tile are visited (a short entry or the last tile of an entry costs what
it holds, not a full tile); ``Kf`` rows from ``nk`` to the end of the last score block are zero. Keys-major
steps likewise visit only the ``rw``-row blocks that hold valid rows (a query tile of a short entry).

Register blocks (``acc*``, ``red``) are small buffers: TVM places allocations under 1 KiB on the stack,
where LLVM promotes them to registers.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._common import MASKED, TilePlan
from ._math import exp2_approx


def scratch_shapes(plan: TilePlan) -> dict:
    """Shapes of the layout-dependent scratch buffers of a work item."""
    R, TK, D = plan.rows, plan.tk, plan.d
    if plan.keys_major:
        return {"S": (TK, R), "Qt": (D, R), "acc": (plan.jb, plan.rw), "red": (1,), "mx": (R,)}
    return {"S": (R, TK), "Qt": (1, 1), "acc": (2, plan.vl), "red": (plan.vl,), "mx": (1,)}


def make_gemm_macros(plan: TilePlan):
    """``(prepare, score, softmax, pv)`` for ``plan``'s score layout."""
    return _keys_major(plan) if plan.keys_major else _rows_major(plan)


def _pv_macro(plan: TilePlan, keys_major: bool):
    """PV step; ``P[r, j]`` is ``S[j, r]`` (keys-major) or ``S[r, j]`` (rows-major)."""
    DV, RB, DC = plan.dv, plan.rb, plan.dc

    def p_at(S, r, j):
        return S[j, r] if keys_major else S[r, j]

    @T.macro
    def pv(O, S, Vf, alpha, acc0, acc1, nk, nrows):
        # Only row blocks holding valid rows (a partial query tile costs what it holds).
        for rb in T.serial((nrows + RB - 1) // RB):
            for dc in T.serial(DV // (2 * DC)):
                for rr in T.unroll(RB):
                    for c in T.vectorized(DC):
                        acc0[rr, c] = O[rb * RB + rr, dc * 2 * DC + c] * alpha[rb * RB + rr]
                        acc1[rr, c] = O[rb * RB + rr, dc * 2 * DC + DC + c] * alpha[rb * RB + rr]
                for j in T.serial(nk):
                    for rr in T.unroll(RB):
                        for c in T.vectorized(DC):
                            acc0[rr, c] = acc0[rr, c] + p_at(S, rb * RB + rr, j) * Vf[j, dc * 2 * DC + c]
                            acc1[rr, c] = acc1[rr, c] + p_at(S, rb * RB + rr, j) * Vf[j, dc * 2 * DC + DC + c]
                for rr in T.unroll(RB):
                    for c in T.vectorized(DC):
                        O[rb * RB + rr, dc * 2 * DC + c] = acc0[rr, c]
                        O[rb * RB + rr, dc * 2 * DC + DC + c] = acc1[rr, c]

    return pv


def _keys_major(plan: TilePlan):
    """Prefill: ``St[TK, R] = Kf @ Qt``, everything after it vectorized over blocks of RW rows."""
    R, D, JB, RW = plan.rows, plan.d, plan.jb, plan.rw
    var = plan.variant
    limits = var.limits_macro(plan.group, R)

    @T.macro
    def prepare(Qf, Qt, lim, nrows, kvlen, causal, qlen, qt0):
        # Transpose only the valid rows (a scalar store each); padding lanes are zeroed a vector at a time.
        for dd in T.serial(D):
            for r in T.vectorized(R):
                Qt[dd, r] = T.float32(0)
        for r, dd in T.grid(nrows, D):
            Qt[dd, r] = Qf[r, dd]
        limits(lim, kvlen, causal, qlen, qt0)

    @T.macro
    def score(S, Qf, Qt, Kf, acc, red, nk, nrows):
        # Per block of RW rows holding valid rows: JB keys x RW rows of accumulators; each Kf element is
        # broadcast (a memory operand of the FMA).
        for rb in T.serial((nrows + RW - 1) // RW):
            for jb in T.serial((nk + JB - 1) // JB):
                for jj in T.unroll(JB):
                    for r in T.vectorized(RW):
                        acc[jj, r] = T.float32(0)
                for dd in T.serial(D):
                    for jj in T.unroll(JB):
                        for r in T.vectorized(RW):
                            acc[jj, r] = acc[jj, r] + Kf[jb * JB + jj, dd] * Qt[dd, rb * RW + r]
                for jj in T.unroll(JB):
                    for r in T.vectorized(RW):
                        S[jb * JB + jj, rb * RW + r] = acc[jj, r]

    @T.macro
    def softmax_block(S, m, l, alpha, mx, lim, j0, nk, r0):
        """The online softmax step of rows ``r0 .. r0 + RW``."""
        for r in T.vectorized(RW):
            mx[r0 + r] = m[r0 + r]
        for j in T.serial(nk):
            for r in T.vectorized(RW):
                # A select, not if_then_else: TVM lowers if_then_else to a branch, which scalarizes the row loop.
                S[j, r0 + r] = T.Select(var.visible(lim, R, r0 + r, j0 + j), var.cap(S[j, r0 + r]),
                                        T.float32(MASKED))
                mx[r0 + r] = T.max(mx[r0 + r], S[j, r0 + r])
        for r in T.vectorized(RW):
            alpha[r0 + r] = exp2_approx(m[r0 + r] - mx[r0 + r])
            l[r0 + r] = l[r0 + r] * alpha[r0 + r]
            m[r0 + r] = mx[r0 + r]
        for j in T.serial(nk):
            for r in T.vectorized(RW):
                S[j, r0 + r] = exp2_approx(S[j, r0 + r] - mx[r0 + r])
                l[r0 + r] = l[r0 + r] + S[j, r0 + r]

    @T.macro
    def softmax(S, m, l, alpha, mx, lim, j0, nk, nrows):
        for rb in T.serial((nrows + RW - 1) // RW):
            softmax_block(S, m, l, alpha, mx, lim, j0, nk, rb * RW)

    return prepare, score, softmax, _pv_macro(plan, keys_major=True)


def _rows_major(plan: TilePlan):
    """Decode: ``S[R, TK]``, each score a VL-lane dot product folded by a halving tree."""
    R, TK, D, VL = plan.rows, plan.tk, plan.d, plan.vl
    NPAIR, ODD = (D // VL) // 2, (D // VL) % 2 == 1
    var = plan.variant
    limits = var.limits_macro(plan.group, R)

    @T.macro
    def prepare(Qf, Qt, lim, nrows, kvlen, causal, qlen, qt0):
        limits(lim, kvlen, causal, qlen, qt0)

    @T.macro
    def score(S, Qf, Qt, Kf, acc, red, nk, nrows):
        # Every row (decode tiles are a few rows, all valid but the padding of a register block).
        for j, r in T.grid(nk, R):
            # Two independent accumulators halve the FMA dependency chain.
            for ll in T.vectorized(VL):
                acc[0, ll] = T.float32(0)
                acc[1, ll] = T.float32(0)
            for c in T.serial(NPAIR):
                for ll in T.vectorized(VL):
                    acc[0, ll] = acc[0, ll] + Qf[r, c * 2 * VL + ll] * Kf[j, c * 2 * VL + ll]
                    acc[1, ll] = acc[1, ll] + Qf[r, c * 2 * VL + VL + ll] * Kf[j, c * 2 * VL + VL + ll]
            if ODD:
                for ll in T.vectorized(VL):
                    acc[0, ll] = acc[0, ll] + Qf[r, D - VL + ll] * Kf[j, D - VL + ll]
            for ll in T.vectorized(VL):
                red[ll] = acc[0, ll] + acc[1, ll]
            if VL > 8:
                for ll in T.vectorized(8):
                    red[ll] = red[ll] + red[ll + 8]
            if VL > 4:
                for ll in T.vectorized(4):
                    red[ll] = red[ll] + red[ll + 4]
            if VL > 2:
                for ll in T.vectorized(2):
                    red[ll] = red[ll] + red[ll + 2]
            if VL > 1:
                red[0] = red[0] + red[1]
            S[r, j] = red[0]

    @T.macro
    def softmax(S, m, l, alpha, mx, lim, j0, nk, nrows):
        for r in T.serial(R):
            mx[0] = m[r]
            if var.capped:  # static; whole-tile vectors, as the exp below (keys past nk are never read)
                for j in T.vectorized(TK):
                    S[r, j] = var.cap(S[r, j])
            for j in T.serial(nk):
                S[r, j] = T.if_then_else(var.visible(lim, R, r, j0 + j), S[r, j], T.float32(MASKED))
                mx[0] = T.max(mx[0], S[r, j])
            alpha[r] = exp2_approx(m[r] - mx[0])
            # Whole-tile vector exp (cheaper than a scalar tail); keys past nk are never read.
            for j in T.vectorized(TK):
                S[r, j] = exp2_approx(S[r, j] - mx[0])
            l[r] = l[r] * alpha[r]
            for j in T.serial(nk):
                l[r] = l[r] + S[r, j]
            m[r] = mx[0]

    return prepare, score, softmax, _pv_macro(plan, keys_major=False)
