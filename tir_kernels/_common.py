"""Shared pieces of the pagedkv TIR kernels: constants, target dispatch and ``@T.macro`` building blocks.

Every attention kernel here follows the same plan (see ``docs/ARCHITECTURE.md``, "Kernel ABI"):

* a *work item* is one entry (sequence or prefix block), one kv head and one tile of query tokens; the
  ``G = Hq / Hkv`` query heads that share the kv head are processed together so that every K/V row is
  loaded (and converted to float32) once per group instead of once per query head;
* the work item keeps a float32 *row tile* ``Qf[R, D]`` whose row ``r`` is query token ``r // G`` of
  the tile and query head ``h * G + r % G``; rows past the tile are zero and never stored;
* keys are visited ``TK`` at a time: K is transposed into ``Kt[D, TK]`` so the score GEMM vectorizes
  over keys, V is kept as ``Vt[TK, Dv]`` so the PV GEMM vectorizes over the head dim;
* softmax is the online (flash) form in base 2: ``sm_scale * log2(e)`` is folded into ``Qf`` so scores
  come out in log2 units, and ``lse = m + log2(l)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm.script import tirx as T
from tvm.target import Target

#: log2(e): converts natural-log scores to base 2 so the kernels can use exp2/log2.
LOG2E = math.log2(math.e)
#: The lse of an entry without keys (finite so ``merge_state`` never computes ``inf - inf``).
EMPTY_LSE = -1.0e30
#: Score given to masked keys. Finite (no inf arithmetic) and far below EMPTY_LSE, so that
#: ``exp2(MASKED - m)`` is exactly 0 even while the running max ``m`` is still EMPTY_LSE.
MASKED = -3.0e38


def as_target(target) -> Target:
    """Return ``target`` as a ``tvm.target.Target`` (accepts a string, a dict or a Target)."""
    return target if isinstance(target, Target) else Target(target)


def dispatch(family: str, target, schedules: dict):
    """Pick the schedule of ``family`` for ``target``'s kind.

    Parameters
    ----------
    family : str
        Op name, only for the error message.
    target : str | dict | Target
        Compilation target.
    schedules : dict[str, callable]
        Target kind name (``"llvm"``, ``"cuda"``...) -> factory taking no argument.

    Raises
    ------
    NotImplementedError
        When no schedule exists for the target kind (GPU schedules are added per family later).
    """
    kind = as_target(target).kind.name
    if kind not in schedules:
        raise NotImplementedError(
            f"pagedkv.tir_kernels: no {kind!r} schedule for {family!r} yet (have: {', '.join(schedules)})")
    return schedules[kind]()


@dataclass(frozen=True)
class TilePlan:
    """Compile-time tiling of one attention kernel on the CPU.

    Attributes
    ----------
    d, dv : int
        qk and v head dims.
    group : int
        Query heads per kv head (G).
    tq : int
        Query tokens per work item.
    rows : int
        Rows of the row tile (``tq * group`` rounded up to ``rb``).
    tk : int
        Keys per kv tile.
    rb : int
        Rows per register block of the GEMM micro-kernels.
    dc : int
        Head-dim columns of each of the two accumulators of the PV micro-kernel.
    dtype : str
        Storage dtype of q/k/v/o.
    """

    d: int
    dv: int
    group: int
    tq: int
    rows: int
    tk: int
    rb: int
    dc: int
    dtype: str


def make_tile_plan(d: int, dv: int, group: int, dtype: str, tokens_per_item: int | None) -> TilePlan:
    """Choose the CPU tiling.

    ``tokens_per_item=None`` sizes the query tile for prefill (about 32 rows, enough to reuse each
    K/V tile from L1 many times); decode passes 1.
    """
    tq = tokens_per_item if tokens_per_item is not None else max(1, 32 // group)
    # Register block: 4 rows keep 4 x (TK / 16) score accumulators and 4 x (DC / 16) output
    # accumulators in AVX-512 registers; smaller groups (decode with G < 4) use G rows to avoid padding.
    rb = 4 if tq * group >= 4 else tq * group
    rows = -(-tq * group // rb) * rb
    # PV block: RB rows x 2*DC columns (two RB x DC accumulators, each under TVM's 1 KiB stack limit).
    dc = next(c for c in (32, 16, 8, 4, 2, 1) if dv % (2 * c) == 0) if dv % 2 == 0 else dv
    return TilePlan(d=d, dv=dv, group=group, tq=tq, rows=rows, tk=32, rb=rb, dc=dc, dtype=dtype)


def make_rope_macros(d: int):
    """RoPE ("rotate half" over the whole head dim) on float32 rows, as ``@T.macro`` s.

    Returns ``(init_inv_freq, rope_row)``:

    * ``init_inv_freq(invf[d // 2], rope_theta)``: ``invf[i] = rope_theta ** (2 i / d)`` (the divisor of
      the angle), computed once per work item so rotating a row costs one divide, cos and sin per pair;
    * ``rope_row(buf[*, d], r, pos, rope_scale, invf)``: rotates row ``r`` of ``buf`` in place for
      position ``pos``.

    The angle is evaluated exactly as written in the ABI (``pos * rope_scale / theta ** (2i/d)``, float32)
    and in the same order as ``split_rotary``, so inline and split RoPE round identically.
    """
    half = d // 2

    @T.macro
    def init_inv_freq(invf, rope_theta):
        for i in T.serial(half):
            invf[i] = T.pow(rope_theta, T.Cast("float32", 2 * i) / T.float32(d))

    @T.macro
    def rope_row(buf, r, pos, rope_scale, invf):
        for i in T.serial(half):
            angle: T.let[T.float32] = T.Cast("float32", pos) * rope_scale / invf[i]
            c: T.let[T.float32] = T.cos(angle)
            s: T.let[T.float32] = T.sin(angle)
            x0: T.let[T.float32] = buf[r, i]
            x1: T.let[T.float32] = buf[r, i + half]
            buf[r, i] = x0 * c - x1 * s
            buf[r, i + half] = x1 * c + x0 * s

    return init_inv_freq, rope_row


def host_target() -> Target:
    """An ``llvm`` target for this machine's CPU (``mcpu`` set, so AVX2/AVX-512 and F16C are used).

    A bare ``"llvm"`` target compiles for baseline x86-64 (SSE2, software fp16 conversion); the kernels
    work there too, only slower.
    """
    from tvm.target import codegen  # pylint: disable=import-outside-toplevel

    return Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})
