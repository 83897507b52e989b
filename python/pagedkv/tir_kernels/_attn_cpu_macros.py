"""Shared ``@T.macro`` pieces of the CPU attention kernels (one work item = entry x kv head x query tile).

The tiling is described in ``_common`` (``TilePlan``); the score / softmax / PV steps, which depend on the
score layout, are in ``_attn_cpu_gemm``. Per-work-item float32 scratch used here:

* ``Qf[R, D]``   query rows (rotated, pre-scaled by ``sm_scale * log2(e)``);
* ``Kf[TK, D]``, ``Vf[TK, Dv]``  the current key / value tile (converted, keys rotated);
* ``O[R, Dv]``   unnormalized output; ``m[R]``, ``l[R]`` running max (log2 units) and sum.
"""

from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from ._common import EMPTY_LSE, TilePlan, const_store_loop, make_rope_macros, no_keys
from ._rope_table import make_cpu_rope_macros, rope_on as table_rope_on


def _rope_macros(plan: TilePlan):
    """``(rope_on, init_inv_freq, rope_row)``: the kernels' own RoPE (``apply_rope == 1``; ``init_inv_freq``
    takes ``rope_theta``), or a variant's table (``plan.rope_table``: ``apply_rope`` 1 or 2, ``init_inv_freq``
    takes ``apply_rope``)."""
    if plan.rope_table is None:
        init_inv_freq, rope_row = make_rope_macros(plan.d)
        return (lambda apply_rope: apply_rope == 1), init_inv_freq, rope_row
    init_inv_freq, rope_row = make_cpu_rope_macros(plan.rope_table)
    return table_rope_on, init_inv_freq, rope_row


def make_attn_macros(plan: TilePlan, fp8=None):
    """The shared macros specialized to ``plan``: ``rope_on, init_inv_freq, load_q, init_state, rope_key,
    clear_key, store`` (``rope_on(apply_rope)``: whether inline RoPE rotates; ``init_inv_freq(invf, apply_rope,
    rope_theta)``). ``fp8`` (``_fp8.Fp8Scales``, for kernels reading FP8 pages): ``load_q`` folds the K scale into
    the q rows and ``store`` the V scale into ``o``; None leaves both as they were."""
    D, DV, G, R = plan.d, plan.dv, plan.group, plan.rows
    KEYS_MAJOR, RB, ROPE = plan.keys_major, plan.rb, plan.rope
    rope_on, init_freqs, rope_row = _rope_macros(plan)
    TABLE = plan.rope_table is not None
    FP8 = fp8

    @T.macro
    def init_inv_freq(invf, apply_rope, rope_theta):
        if TABLE:  # static
            init_freqs(invf, apply_rope)
        else:
            init_freqs(invf, rope_theta)

    @T.macro
    def load_q(Qf, q, q_pos, tok0, ntok, h, rope, qk_scale):
        """Fill the ``ntok * G`` valid rows of ``Qf`` from ``q[tok0 : tok0 + ntok, h*G : (h+1)*G]``.

        Rows-major scores read every row, so there the padding rows are zeroed; keys-major scores
        read the transposed copy, whose padding lanes ``prepare`` zeroes.
        """
        apply_rope, rope_scale, invf = rope
        for r in T.serial(ntok * G):
            for dd in T.vectorized(D):
                Qf[r, dd] = T.Cast("float32", q[tok0 + r // G, h * G + r % G, dd])
            if ROPE:  # static: kernels without inline RoPE (MLA) leave this out
                if rope_on(apply_rope):
                    rope_row(Qf, r, q_pos[tok0 + r // G], rope_scale, invf)
            if FP8 is None:  # static
                for dd in T.vectorized(D):
                    Qf[r, dd] = Qf[r, dd] * qk_scale
            else:  # scores are linear in k: the K scale of the row's kv head (MLA: of the latent part) joins q's
                for dd in T.vectorized(D):
                    Qf[r, dd] = Qf[r, dd] * (qk_scale * FP8.k_of(h, dd))
        if not KEYS_MAJOR:
            for r in T.serial(ntok * G, R):
                for dd in T.vectorized(D):
                    Qf[r, dd] = T.float32(0)

    @T.macro
    def init_state(m, l, O, nrows):
        for r in T.vectorized(R):
            m[r] = T.float32(EMPTY_LSE)
            l[r] = T.float32(0)
        # Only the row blocks the PV step visits (see _attn_cpu_gemm.pv).
        for r in T.serial((nrows + RB - 1) // RB * RB):
            for dd in T.vectorized(DV):
                O[r, dd] = T.float32(0)

    @T.macro
    def rope_key(Kf, j, kpos, rope):
        """Rotate staged key row ``j`` for position ``kpos`` when inline RoPE is on."""
        apply_rope, rope_scale, invf = rope
        if ROPE:
            if rope_on(apply_rope):
                rope_row(Kf, j, kpos, rope_scale, invf)

    @T.macro
    def clear_key(Kf, j):
        # Key rows that a score block reads past the last valid key: their scores are never read,
        # but uninitialized scratch could hold denormals, which make the FMAs slow. V rows past the
        # last valid key are not read at all.
        for dd in T.vectorized(D):
            Kf[j, dd] = T.float32(0)

    return SimpleNamespace(rope_on=rope_on, init_inv_freq=init_inv_freq, load_q=load_q, init_state=init_state,
                           rope_key=rope_key, clear_key=clear_key, isolate_values=_make_isolate_values(plan),
                           store=_make_store(plan, fp8))


def _make_isolate_values(plan: TilePlan):
    """``isolate_values(Kf, Vf, nk)``: a staged key whose value row is not finite gets a NaN key element
    instead, and its value row zeros where it was not finite.

    Why: P V visits every key of the tile for every row, so a key a row does not see (p exactly 0) still adds
    ``0 * v``, which is NaN for a NaN (or infinite) v: one key's NaN value made every row of its tile NaN, the
    causal rows before it and the rows whose window excludes it too (issue 44). Moved into the key, the NaN
    reaches only the rows that see the key (their score is NaN; the mask's select replaces it for the others),
    and it makes their whole row and lse NaN. The kernels run this only on tiles where some row does not see
    some key (``CpuVariant.hides_keys``): in the others every row sees the key and P V passes its NaN as is."""
    D, DV = plan.d, plan.dv
    big = T.float32(3.4028234663852886e38)  # FLT_MAX: |v| <= it is false for NaN and inf

    @T.macro
    def isolate_values(Kf, Vf, nk):
        for j in T.serial(nk):
            if DV <= D:  # static: the key row has an element for every value element
                for dd in T.vectorized(DV):
                    Kf[j, dd] = T.Select(T.abs(Vf[j, dd]) <= big, Kf[j, dd], T.float32("nan"))
                    Vf[j, dd] = T.Select(T.abs(Vf[j, dd]) <= big, Vf[j, dd], T.float32(0))
            else:
                for dd in T.serial(DV):
                    Kf[j, 0] = T.Select(T.abs(Vf[j, dd]) <= big, Kf[j, 0], T.float32("nan"))
                    Vf[j, dd] = T.Select(T.abs(Vf[j, dd]) <= big, Vf[j, dd], T.float32(0))

    return isolate_values


def _make_store(plan: TilePlan, fp8=None):
    """``store(o, lse, O, m, l, tok0, ntok, h)``: normalize and write the rows of tokens
    ``tok0 .. tok0 + ntok``; a row that saw no key gets o = 0 and lse = EMPTY_LSE. ``fp8``: ``o`` times kv head
    ``h``'s V scale (``o`` is linear in v, and a merge of pass states is a convex combination of their ``o``s, so
    scaling each pass's ``o`` is exact whatever the passes; the empty ``o = 0`` needs none)."""
    DV, G, TQ, dtype, FP8 = plan.dv, plan.group, plan.tq, plan.dtype, fp8
    zero_loop = const_store_loop(dtype)

    @T.macro
    def store(o, lse, O, m, l, tok0, ntok, h):
        for r in T.serial(TQ * G):
            if r // G < ntok:
                if no_keys(l[r]):  # (a NaN sum is not "no key": _common.no_keys)
                    for dd in zero_loop(DV):
                        o[tok0 + r // G, h * G + r % G, dd] = T.Cast(o.dtype, T.float32(0))
                    lse[tok0 + r // G, h * G + r % G] = T.float32(EMPTY_LSE)
                else:
                    if FP8 is None:  # static
                        for dd in T.vectorized(DV):
                            o[tok0 + r // G, h * G + r % G, dd] = T.Cast(o.dtype, O[r, dd] / l[r])
                    else:
                        for dd in T.vectorized(DV):
                            o[tok0 + r // G, h * G + r % G, dd] = T.Cast(o.dtype, O[r, dd] / l[r] * FP8.v_of(h))
                    lse[tok0 + r // G, h * G + r % G] = m[r] + T.log2(l[r])

    return store
