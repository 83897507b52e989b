"""Shared pieces of the pagedkv TIR kernels: constants, target dispatch and ``@T.macro`` building blocks.

Every attention kernel here follows the same plan (see ``docs/ARCHITECTURE.md``, "Kernel ABI"):

* a *work item* is one entry (sequence or prefix block), one kv head and one tile of query tokens; the
  ``G = Hq / Hkv`` query heads that share the kv head are processed together so that every K/V row is
  loaded (and converted to float32) once per group instead of once per query head;
* the work item keeps a float32 *row tile* ``Qf[R, D]`` whose row ``r`` is query token ``r // G`` of
  the tile and query head ``h * G + r % G``; rows past the tile are zero and never stored;
* keys are visited ``TK`` at a time, staged as float32 rows ``Kf[TK, D]`` and ``Vf[TK, Dv]`` (converted
  and, for inline RoPE, rotated once per work item); the score layout depends on the row count (see
  ``TilePlan.keys_major``); the PV GEMM vectorizes over the head dim;
* softmax is the online (flash) form in base 2: ``sm_scale * log2(e)`` is folded into ``Qf`` so scores
  come out in log2 units, and ``lse = m + log2(l)``.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tvm.script import tirx as T
from tvm.target import Target

from ._math import LOG2E, cos_approx, sin_approx  # noqa: F401 (LOG2E: the kernels import it from here)

if TYPE_CHECKING:  # _variant_cpu imports this module's constants
    from ._variant_cpu import CpuVariant

#: The lse of an entry without keys (finite so ``merge_state`` never computes ``inf - inf``).
EMPTY_LSE = -1.0e30
#: Score given to masked keys. Finite (no inf arithmetic) and far below EMPTY_LSE, so that
#: ``exp2(MASKED - m)`` is exactly 0 even while the running max ``m`` is still EMPTY_LSE.
MASKED = -3.0e38


def no_keys(lsum):
    """Whether a row's softmax sum ``lsum`` says it saw no key (then it gets the empty state, o = 0 and lse =
    ``EMPTY_LSE``): exactly 0, as it is before the first visible key (the row's max contributes ``2^0 = 1``
    after it).

    Tested as ``lsum == 0``, never ``lsum > 0`` for "saw keys": a NaN in what a row attends to (its q, an
    attended key's k or v) makes its scores, sum and O NaN, and the row must come out NaN (o and lse, so that
    every later merge is NaN too), not as the empty state (issue 44). ``NaN == 0`` is false in C and LLVM's
    ordered compare; ``!=`` is not a way around it: LLVM's ``fcmp one`` is false for NaN too. The running max
    needs no such care (nor a "safe max": it starts at the finite ``EMPTY_LSE``, masked scores are the finite
    ``MASKED``, so no ``-inf`` ever meets a NaN): CUDA's ``max`` (``fmaxf``) drops a NaN score, an all-NaN row
    keeping ``EMPTY_LSE``, and LLVM's (``a > b ? a : b``) keeps or drops it by argument order, but either way the
    NaN score reaches ``exp2(s - m)`` (on the CPU through ``_math.exp2_approx``, which keeps NaN), hence sum and
    O. Masks must stay selects (``MASKED``), so a NaN score of a key a row does not see never reaches it."""
    return lsum == T.float32(0)


def const_store_loop(dtype: str):
    """The loop kind for a CPU loop that stores one constant (e.g. an empty row's ``o = 0``) into a buffer of
    ``dtype``: ``T.vectorized``, except ``T.serial`` for bfloat16. TVM 0.27's bf16 storage legalization
    (``tirx.transform.BF16StorageLegalize``, which turns bf16 buffers into uint16 ones for LLVM) leaves a
    broadcast bf16 constant's type unchanged, so a vectorized bf16 store of a constant fails to build
    ("dtype mismatch on BufferStore: ... uint16 ... bfloat16x64"); stores of computed values are legalized
    correctly. A serial constant store is vectorized by LLVM anyway."""
    return T.serial if dtype == "bfloat16" else T.vectorized


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
    with fast_macro_expansion():
        return schedules[kind]()


@contextlib.contextmanager
def fast_macro_expansion():
    """Speed up TVMScript macro expansion while our kernels are parsed (about 5x for attention).

    TVM 0.27's ``ScriptMacro._find_parser_def`` finds the active parser with
    ``inspect.getouterframes``, which reads source lines of every frame on the stack for every macro
    call; with our nested macros that is most of the parse time. Within this context the method walks
    ``frame.f_back`` and checks the same ``f_globals`` key, with the same result. If TVM renames the
    method, nothing is patched.
    """
    try:
        from tvm.script.parser.core.parser import ScriptMacro  # pylint: disable=import-outside-toplevel
    except ImportError:
        ScriptMacro = None
    original = getattr(ScriptMacro, "_find_parser_def", None)
    if original is None:
        yield
        return
    key = ScriptMacro.parser_object_name

    def find_parser_def(_self):
        frame = inspect.currentframe()
        while frame is not None:
            parser = frame.f_globals.get(key)
            if parser is not None:
                return parser
            frame = frame.f_back
        raise RuntimeError(f"{key} not available")

    ScriptMacro._find_parser_def = find_parser_def
    try:
        yield
    finally:
        ScriptMacro._find_parser_def = original


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
        Rows of the row tile (``tq * group``, padded).
    tk : int
        Keys per kv tile.
    keys_major : bool
        Score layout. ``False`` (decode, few rows): ``S[rows, TK]``, each score a SIMD dot product of a
        query row with a key row. ``True`` (prefill, rows a multiple of 16): ``St[TK, rows]``, computed as
        ``K_tile @ Qt`` with the queries transposed once per work item, so scores vectorize over rows and
        the key tile is used in its natural row layout (no per-key transposition).
    jb : int
        Keys per register block of the keys-major score GEMM (``jb * rw * 4`` bytes < 1 KiB).
    rw : int
        Rows per keys-major score register block and softmax step (a divisor of ``rows``): a work item
        visits only the blocks holding its valid rows, so a short entry in a 64-row tile costs what a
        32-row tile did.
    vl : int
        SIMD lanes of the rows-major dot products.
    rb, dc : int
        PV register block: ``rb`` rows x ``2 * dc`` head-dim columns (two ``rb x dc`` accumulators).
    dtype : str
        Storage dtype of q/k/v/o.
    rope : bool
        Whether the kernel takes inline RoPE at all (its ``apply_rope`` argument); ``False`` (MLA)
        leaves the RoPE code out at parse time.
    variant : CpuVariant
        The attention variant (``_variant_cpu``): key range, per-key mask and logits transform.
    rope_table : RopeTable or None
        A RoPE variant (``KernelSpec.rope``; ``_rope_table``): inline RoPE takes its constants. None: the
        kernels' own formula, code unchanged.
    """

    d: int
    dv: int
    group: int
    tq: int
    rows: int
    tk: int
    keys_major: bool
    jb: int
    rw: int
    vl: int
    rb: int
    dc: int
    dtype: str
    variant: "CpuVariant"
    rope: bool = True
    rope_table: object = None


def make_tile_plan(d: int, dv: int, group: int, dtype: str, tokens_per_item: int | None, variant: "CpuVariant",
                   *, rope: bool = True, prefill_rows: int = 32, rope_table=None) -> TilePlan:
    """Choose the CPU tiling.

    ``tokens_per_item=None`` is prefill: about ``prefill_rows`` rows per item (each staged K/V tile is
    reused from the caches by all of them), rounded up to a multiple of 16, keys-major scores. Decode passes 1: the G rows of one token, rows-major scores.
    The spec's options were validated by ``KernelSpec``; only this family's own limit is checked here.
    """
    if dv % 2:
        raise ValueError(f"value head dim {dv} is odd; the CPU attention kernels accumulate P @ V in pairs of "
                         "value columns and need an even value head dim")
    tk = 32
    if tokens_per_item is None:
        tq = max(1, prefill_rows // group)
        rows = -(-tq * group // 16) * 16
        keys_major, rb = True, 4
    else:
        tq = tokens_per_item
        rows = tq * group
        # PV register block of 4 rows when it divides (or costs little padding), else the whole group.
        rb = 4 if rows % 4 == 0 or rows > 4 else rows
        rows = -(-rows // rb) * rb
        keys_major = False
    # Keys-major: two 16-lane row vectors per block when the rows allow; 128 accumulators either way.
    rw = (32 if rows % 32 == 0 else 16) if keys_major else rows
    jb = max(1, min(tk, 128 // rw))
    while tk % jb:
        jb -= 1
    vl = next(v for v in (16, 8, 4, 2, 1) if d % v == 0)
    # Two PV accumulators of rb x dc floats, each under TVM's 1 KiB stack-allocation limit.
    dc = next(c for c in (32, 16, 8, 4, 2, 1) if dv % (2 * c) == 0) if dv % 2 == 0 else dv
    return TilePlan(d=d, dv=dv, group=group, tq=tq, rows=rows, tk=tk, keys_major=keys_major, jb=jb, rw=rw,
                    vl=vl, rb=rb, dc=dc, dtype=dtype, variant=variant, rope=rope, rope_table=rope_table)


def make_rope_macros(d: int):
    """RoPE ("rotate half" over the whole head dim) on float32 rows, as ``@T.macro`` s.

    Returns ``(init_inv_freq, rope_row)``:

    * ``init_inv_freq(invf[d // 2], rope_theta)``: ``invf[i] = rope_theta ** (2 i / d)`` (the divisor of
      the angle), computed once per work item;
    * ``rope_row(buf[*, d], r, pos, rope_scale, invf)``: rotates row ``r`` of ``buf`` in place for
      position ``pos``, vectorized over the ``d / 2`` pairs (sin / cos from ``_math``, so a key costs
      a few SIMD instructions per pair instead of two libm calls).

    The angle is evaluated as written in the ABI (``pos * rope_scale / theta ** (2i/d)``, float32) and
    exactly as in ``split_rotary``, so inline and split RoPE give the same rotation.
    """
    half = d // 2

    @T.macro
    def init_inv_freq(invf, rope_theta):
        for i in T.serial(half):
            invf[i] = T.pow(rope_theta, T.Cast("float32", 2 * i) / T.float32(d))

    @T.macro
    def rope_row(buf, r, pos, rope_scale, invf):
        for i in T.vectorized(half):
            x0: T.let[T.float32] = buf[r, i]
            x1: T.let[T.float32] = buf[r, i + half]
            angle: T.let[T.float32] = rope_angle(pos, rope_scale, invf[i])
            buf[r, i] = x0 * cos_approx(angle) - x1 * sin_approx(angle)
            buf[r, i + half] = x1 * cos_approx(angle) + x0 * sin_approx(angle)

    return init_inv_freq, rope_row


def rope_angle(pos, rope_scale, divisor):
    """The RoPE angle ``pos * rope_scale / divisor`` in float32 (``divisor = theta ** (2i/D)``)."""
    return T.Cast("float32", pos) * rope_scale / divisor


def host_target() -> Target:
    """An ``llvm`` target for this machine's CPU (``mcpu`` set, so AVX2/AVX-512 and F16C are used).

    A bare ``"llvm"`` target compiles for baseline x86-64 (SSE2, software fp16 conversion); the kernels
    work there too, only slower.
    """
    from tvm.target import codegen  # pylint: disable=import-outside-toplevel

    return Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})
