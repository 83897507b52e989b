"""The epilogue the CUDA attention kernels share: a row's final state, or a key split's partial one, written out.

A row's state is ``(m, l, O)``: its running max (log2 units), its sum of ``exp2(s - m)`` over the keys it saw, and
the unnormalized ``O = sum exp2(s - m) v``. With ``S`` key splits of the row's keys (split ``sp`` of them):

* ``S == 1``: ``o = O / l`` in o's dtype (the storage dtype; float32 in a partial-state kernel), ``lse = m + log2(l)``;
* ``S > 1``: the split's normalized partial state in the float32 workspace (``ws_o`` row, ``ws_l``), which
  ``_common_cuda.make_merge_splits`` combines;
* a row that saw no key (``l == 0``): ``o = 0``, ``lse = EMPTY_LSE``; as a split's partial state only its lse
  (the merge reads no ``o`` of a split whose lse is empty, so its workspace row is left unwritten);
* a row whose sum is NaN (a NaN in its q or in a key it sees) is no empty row: o and lse NaN (``_common.no_keys``).

Why one module: the decode kernels (lane groups ``_decode_stages_cuda``, staged ``_decode_staged_cuda``, tensor
cores ``_decode_tc_cuda``) each merge a row's partial states over their warps or key groups and write it, and the
MLA kernels (``mla_cuda_tc``, ``mla_cuda_wg`` and the kernels on its store) write a row's lse to ``lse`` or the
workspace; one text of each rule keeps the kernels from drifting apart. These are macros (and expression helpers)
that the kernels' stores call with their own index expressions: the generated TIR is the one each kernel wrote
inline before (``tools/tir_hashes.py``).
"""

from __future__ import annotations

from typing import Callable

from tvm.script import tirx as T

from ._common import EMPTY_LSE, no_keys


def row_lse(m, lsum):
    """A row's lse from its max ``m`` and sum ``lsum`` (log2 units): ``EMPTY_LSE`` where it saw no key (NaN for
    a NaN sum: ``_common.no_keys``)."""
    return T.if_then_else(no_keys(lsum), T.float32(EMPTY_LSE), m + T.log2(lsum))


def row_scale(lsum):
    """The factor that normalizes a row's O: ``1 / lsum``, 0 where the row saw no key (its O is 0 then too)."""
    return T.if_then_else(no_keys(lsum), T.float32(0), T.float32(1) / lsum)


def make_put_lse(heads: int):
    """``put_lse(lse, ws_l, lv, b, h0, r, S, sp)``: lse value ``lv`` of head ``h0 + r`` of row set ``b`` (of
    ``heads`` heads) into ``lse`` (``S == 1``) or split ``sp``'s slot of the workspace ``ws_l``."""

    @T.macro
    def put_lse(lse, ws_l, lv, b, h0, r, S, sp):
        if S == 1:
            lse[b, h0 + r] = lv
        else:
            ws_l[(b * heads + h0 + r) * S + sp] = lv

    return put_lse


def make_merged_store(states: int, dtype: str, m_at: Callable, l_at: Callable, o_at: Callable):
    """``store(o, lse, ws_o, ws_l, red_ml, red_o, st, b, hq, row, gg, dd, S)``: merge the ``states`` partial states of
    a row (a block's warps or key groups, in shared memory) into element ``dd`` of its O and write it: ``o[b, hq,
    dd]`` (and ``lse[b, hq]`` by the ``dd == 0`` thread) when ``S == 1``, else workspace row ``row``. ``m_at(red_ml,
    w, gg)``, ``l_at(red_ml, w, gg)`` and ``o_at(red_o, w, gg, dd)`` read state ``w``'s max, sum and O element of
    the block's row ``gg``; ``st``: 4 float32 scratch registers (merged max, sum and O in ``st[0 .. 2]``)."""

    @T.macro
    def store(o, lse, ws_o, ws_l, red_ml, red_o, st, b, hq, row, gg, dd, S):
        st[0] = T.float32(EMPTY_LSE)
        for w in T.unroll(states):
            st[0] = T.max(st[0], m_at(red_ml, w, gg))
        st[1] = T.float32(0)
        st[2] = T.float32(0)
        for w in T.unroll(states):
            st[3] = T.exp2(m_at(red_ml, w, gg) - st[0])
            st[1] = st[1] + l_at(red_ml, w, gg) * st[3]
            st[2] = st[2] + o_at(red_o, w, gg, dd) * st[3]
        # l >= 1 once any key was seen (its max contributes 2^0); else 0 (NaN: not empty, _common.no_keys).
        if S == 1:
            if no_keys(st[1]):
                o[b, hq, dd] = T.Cast(o.dtype, T.float32(0))
                if dd == 0:
                    lse[b, hq] = T.float32(EMPTY_LSE)
            else:
                o[b, hq, dd] = T.Cast(o.dtype, st[2] / st[1])
                if dd == 0:
                    lse[b, hq] = st[0] + T.log2(st[1])
        elif no_keys(st[1]):
            if dd == 0:  # no key: the empty lse only (the merge reads no o of it)
                ws_l[row] = T.float32(EMPTY_LSE)
        else:
            ws_o[row, dd] = st[2] / st[1]
            if dd == 0:
                ws_l[row] = st[0] + T.log2(st[1])

    return store


def make_merged_rows(*, states: int, group: int, d: int, nt: int, heads: int, dtype: str, m_at: Callable,
                     l_at: Callable, o_at: Callable):
    """``store(o, lse, ws_o, ws_l, red_ml, red_o, st, b, h, sp, S, t)``: ``make_merged_store``'s store of every
    element of the ``group`` rows of kv head ``h`` (q heads ``h * group ..`` of ``heads``, ``d`` dims each), thread
    ``t`` of ``nt`` taking elements ``t, t + nt, ..`` (consecutive threads on consecutive dims: coalesced)."""
    merged_store = make_merged_store(states, dtype, m_at, l_at, o_at)

    @T.macro
    def store(o, lse, ws_o, ws_l, red_ml, red_o, st, b, h, sp, S, t):
        for idx in T.serial((group * d + nt - 1) // nt):
            if idx * nt + t < group * d:
                gg: T.let[T.int32] = T.truncdiv(idx * nt + t, d)
                dd: T.let[T.int32] = T.truncmod(idx * nt + t, d)
                row: T.let[T.int32] = (b * heads + h * group + gg) * S + sp
                merged_store(o, lse, ws_o, ws_l, red_ml, red_o, st, b, h * group + gg, row, gg, dd, S)

    return store


__all__ = ["make_merged_rows", "make_merged_store", "make_put_lse", "row_lse", "row_scale"]
