"""Shared pieces of the pagedkv CUDA kernels: vector widths, warp shuffles and float32-exact RoPE.

Conventions of every ``*_cuda.py`` kernel (see ``docs/ARCHITECTURE.md``, "Kernel ABI"):

* kernels are written already scheduled (``"tirx.is_scheduled": True``): every loop that runs in parallel is
  a ``T.thread_binding`` to ``blockIdx.*`` / ``threadIdx.*``; scratch lives in ``local`` (registers) or
  static ``shared`` memory (under 48 KB; TVM 0.27's merge of ``shared.dyn`` buffers failed on the prefill
  kernels); ``T.tvm_storage_sync("shared")`` separates writes and reads of shared memory by different
  threads and is always reached by every thread of the block (TVM's sync planner also refuses barriers
  under a condition);
* ``pages`` is the only buffer with a zero element offset, so only page accesses are 16-byte vector loads
  (``*(uint4*)``); every other buffer has a symbolic ``elem_offset`` (any value, odd included), for which
  TVM emits element accesses; the kernels arrange those so that consecutive threads touch consecutive
  elements (coalesced);
* grid extents are at least 1 (a launch with a zero grid is an error in CUDA), and every block whose index
  is past the work returns without touching memory;
* TVM compiles CUDA with ``--use_fast_math``: ``sinf``/``cosf``/``powf``/``/`` become approximations.
  RoPE therefore uses the same polynomial sin/cos as the CPU kernels (``_math``), the divisor
  ``theta ** (2i/D)`` in float64 and an IEEE float32 angle division (``__fdiv_rn``, or a reciprocal
  plus one FMA residual step, which rounds the same), so the rotation equals the CPU kernels' one up to
  FMA contraction.
* the attention variant (causal / sliding-window masks, logits soft cap) is defined once, in
  ``_variant_cuda.CudaVariant``, which the decode and prefill kernels consume.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel_spec import forced as forced_path
from ._common import EMPTY_LSE
from ._math import cos_approx, sin_approx

#: Threads of a warp.
WARP = 32


def itemsize(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (``float16`` / ``bfloat16`` / ``float32``)."""
    return {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]


def vec16(dtype: str) -> int:
    """Elements of ``dtype`` in 16 bytes (one ``uint4`` / ``float4`` load)."""
    return 16 // itemsize(dtype)


def check_head_dim(op: str, head_dim: int, what: str = "head_dim"):
    """The CUDA kernels need ``head_dim % 16 == 0`` (16 threads split a row; 16-byte page vectors)."""
    if head_dim % 16 or head_dim <= 0:
        raise NotImplementedError(
            f"pagedkv.tir_kernels: the CUDA {op!r} kernel needs {what} to be a multiple of 16, got {what}="
            f"{head_dim} (the CPU kernels serve any even head dim)")


def shfl_xor(value, offset):
    """``__shfl_xor_sync(full mask, value, offset, 32)``: every lane of the warp must execute it."""
    return T.call_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), value, offset, WARP)


def ballot(pred):
    """``__ballot_sync(full mask, pred)`` (uint32: bit l = lane l's predicate): every lane of the warp must
    execute it."""
    return T.call_extern("uint32", "__ballot_sync", T.uint32(0xFFFFFFFF), T.Cast("int32", pred))


def popc(x):
    """``__popc``: the set bits of a uint32 (int32)."""
    return T.call_extern("int32", "__popc", x)


def fdiv_rn(a, b):
    """IEEE round-to-nearest float32 division (``a / b`` is approximate under ``--use_fast_math``)."""
    return T.call_extern("float32", "__fdiv_rn", a, b)


def rope_divisor(i, theta, head_dim: int):
    """``theta ** (2 i / D)`` in float32: computed in float64 and rounded (the correctly rounded float32
    ``powf`` of the CPU kernels, which fast-math ``powf`` is not)."""
    expo = T.Cast("float64", T.Cast("float32", T.Cast("float64", 2 * i) / T.float64(head_dim)))
    return T.Cast("float32", T.pow(T.Cast("float64", theta), expo))


def rope_angle(pos, rope_scale, divisor):
    """``pos * rope_scale / divisor`` in float32 (IEEE division), as ``_common.rope_angle`` on the CPU."""
    return fdiv_rn(T.Cast("float32", pos) * rope_scale, divisor)


def frcp_rn(x):
    """IEEE round-to-nearest float32 reciprocal."""
    return T.call_extern("float32", "__frcp_rn", x)


def rope_angle_rcp(pos, rope_scale, divisor, rcp):
    """``rope_angle`` without a division: ``rcp = frcp_rn(divisor)``; ``q0 = a * rcp`` is within an ulp of
    ``a / divisor`` and one FMA residual step (Markstein) rounds it exactly as the IEEE division does."""
    a = T.Cast("float32", pos) * rope_scale
    q0 = a * rcp
    return fmaf(fmaf(-q0, divisor, a), rcp, q0)


def fmaf(a, b, c):
    """``a * b + c`` with one rounding (``__fmaf_rn``)."""
    return T.call_extern("float32", "__fmaf_rn", a, b, c)


def rotate(x, partner, first_half, angle):
    """One RoPE output element (float32): ``x cos - partner sin`` for dims below D/2 (``first_half``),
    ``x cos + partner sin`` above; ``x`` and ``partner`` in the storage dtype or float32."""
    return (T.Cast("float32", x) * cos_approx(angle)
            + T.if_then_else(first_half, T.float32(-1), T.float32(1)) * T.Cast("float32", partner)
            * sin_approx(angle))


def ceildiv(a, b):
    return (a + b - 1) // b


def next_pow2(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def paged_kv_len(page_indptr, last_page_len, b, ps):
    """Keys of entry ``b`` in a paged layout (0 when it has no pages)."""
    npg = page_indptr[b + 1] - page_indptr[b]
    return T.if_then_else(npg > 0, (npg - 1) * ps + last_page_len[b], 0)


@T.macro
def find_tile_entry(srch, q_indptr, B, vt, tiles_before):
    """``srch[0]`` = the entry of virtual tile ``vt`` in a grid where entry ``b`` owns the virtual tiles from
    ``tiles_before(q_indptr, b) + b`` on (the prefill grids of the SIMT kernels: a tile per ``R`` rows of
    ``q_indptr``'s tokens, one spare tile an entry): the last such ``b < B`` that starts at or below ``vt``
    (binary search; 0 when ``B <= 1``). ``tiles_before`` is a Python function (parse time)."""
    srch[0] = 0
    srch[1] = B
    while srch[1] - srch[0] > 1:
        if tiles_before(q_indptr, T.truncdiv(srch[0] + srch[1], 2)) + T.truncdiv(srch[0] + srch[1], 2) <= vt:
            srch[0] = T.truncdiv(srch[0] + srch[1], 2)
        else:
            srch[1] = T.truncdiv(srch[0] + srch[1], 2)


def decode_splits(spec) -> int:
    """The forced split count of the CUDA decode kernels (MHA and MLA): path switch ``cuda_decode_splits``
    (``pagedkv.kernel_spec.SWITCHES``); 0 = automatic."""
    splits = forced_path(spec.paths, "cuda_decode_splits")
    return 0 if splits == "auto" else int(splits)


def split_count(B, nnz, ps, blocks_per_split, *, target_blocks: int, min_split_keys: int, max_splits: int,
                avg_keys=None, forced: int = 0):
    """Key splits per (entry, block) of a split-KV decode kernel, from shapes only (host side): enough blocks
    to fill the GPU (``target_blocks``), each split at least ``min_split_keys`` keys of an average entry (of
    the keys it reads: ``avg_keys(keys)``, e.g. ``CudaVariant.decode_avg_keys``), at most ``max_splits``.

    ``forced = N > 0`` (the ``cuda_decode_splits`` path switch): ``N`` splits, clamped to ``[1, nnz * ps]``
    (never more splits than the batch has key slots, so a tiny batch gets no grid of empty splits). Any
    ``S >= 1`` is correct: the kernels give every entry its own split ranges, and a split past an entry's
    keys writes the empty state, which the merge weights 0. ``forced = 0``: the expression above, unchanged.
    """
    if forced:
        return T.max(1, T.min(T.int32(forced), nnz * ps))
    want = T.truncdiv(target_blocks + B * blocks_per_split - 1, T.max(B * blocks_per_split, 1))
    keys = T.truncdiv(nnz * ps, T.max(B, 1))
    if avg_keys is not None:
        keys = avg_keys(keys)
    return T.max(1, T.min(T.min(want, T.truncdiv(keys, min_split_keys)), max_splits))


#: ``wave_split_count``'s block budget: up to ``n0 <= f * resident_blocks`` blocks at ``S = 1``, at most ``k``
#: waves' worth of blocks (the last entry has no bound).
WAVE_BUDGETS = ((0.5, 1), (2, 4), (None, 8))
#: ``wave_split_count`` keeps ``S = 1`` when ``S = 1``'s own waves are at least this full (``n0 >= 0.9 *
#: ceil(n0 / resident) * resident``): splitting then adds blocks and a merge, not occupancy.
FULL_WAVES = (9, 10)
#: ... and for a single such wave only when the batch is known to be balanced: its longest entry has at most
#: this many times the average keys (``max_keys * 4 <= 5 * average``).
BALANCED = (5, 4)


def wave_split_count(B, nnz, ps, blocks_per_split, *, resident_blocks: int, min_split_keys: int, max_splits: int,
                     avg_keys=None, forced: int = 0, max_keys=None, entries=None):
    """Key splits per (entry, block) of a split-KV decode kernel whose blocks all take about as long (one per
    entry, kv head and split), from shapes only (host side): the most splits whose blocks fit in ``k`` waves
    of ``resident_blocks``, ``k`` from ``n0 = B * blocks_per_split`` (``WAVE_BUDGETS``: one wave while ``n0 <=
    resident / 2``, four up to ``n0 <= 2 * resident``, eight past that), each split at least
    ``min_split_keys`` keys of an average entry (``avg_keys`` as in ``split_count``), ``1 <= S <=
    max_splits``; but ``S = 1`` when ``S = 1``'s own waves are ``FULL_WAVES`` full and the batch is balanced,
    or past one wave when its spread is not known. ``max_keys``: the longest entry's keys (the runtime's
    ``max_kv_len``; ``None`` or 0: not known). Balanced: ``max_keys <= 5/4`` of the average keys
    (``BALANCED``). ``forced``: as ``split_count``. ``entries``: the sequences the ``nnz`` pages belong to
    where they are not the ``B`` row sets (a paged prefill: ``B`` query tokens over ``entries`` sequences).

    Why: ``split_count`` fills one wave and stops splitting past it, so a batch just over one wave runs a
    second, nearly empty one (B = 64 at 8 kv heads: 512 blocks on 396 resident slots of an H200, 65% of the
    slots busy on average; here S = 3, 1536 blocks in 3.9 waves). Against the least modelled time over every
    ``S`` (``waves(S) * (keys / S + 64)``, +64 for the merge kernel, B = 1 .. 512 x 256 .. 32K keys) this rule
    is 5% over on average, within 5.5% on the benchmark shapes; ``split_count`` is 18% over (44-47% at B = 64).
    A rule and not that search: TVM's simplifier substitutes the split count's host expression at every use
    of ``S`` (the kernels now see it through ``opaque_i32``, but the grid extent, the workspace and the merge
    launch still do), and a min over candidate costs there took minutes to compile."""
    if forced:
        return T.max(1, T.min(T.int32(forced), nnz * ps))
    n0 = T.max(B * blocks_per_split, 1)
    # The block budget, k * resident_blocks (WAVE_BUDGETS), as a sum of steps, k_0 + sum (k_i+1 - k_i) [n0 >
    # f_i * resident]: a Select chain here tripled the kernel's compile time (the simplifier split cases at
    # every use of S; measured before opaque_i32).
    budget = T.int32(WAVE_BUDGETS[0][1] * resident_blocks)
    for (f, k), (_, k_next) in zip(WAVE_BUDGETS, WAVE_BUDGETS[1:]):
        budget = budget + T.Cast("int32", n0 > int(f * resident_blocks)) * ((k_next - k) * resident_blocks)
    raw_keys = T.truncdiv(nnz * ps, T.max(B if entries is None else entries, 1))  # an entry's average keys
    keys = raw_keys if avg_keys is None else avg_keys(raw_keys)
    ladder = T.max(1, T.min(T.min(T.truncdiv(budget, n0), T.truncdiv(keys, min_split_keys)), max_splits))
    # S = 1's waves nearly full: its time is ceil(n0 / R) block times, and any S that fills the waves better
    # must double them and pay a merge (H200, B = 64 x 8 kv heads on 264 slots of the tc kernel: S = 1 2-3%
    # faster than the ladder's S = 2). An arithmetic select, not a Select (see above). But S = 1 leaves each
    # entry in one block, so the longest entry sets the time: a single wave takes it only when the batch is
    # known to be balanced (equal lengths, B = 32 / 33 x 4K: 3.4-4% faster; MLA 16 heads B = 128 x 1K: 1.46x;
    # the skewed batch, 32 entries of 128 .. 16K keys: 1.93x slower), past one wave unless known to be skewed.
    full = T.Cast("int32", FULL_WAVES[1] * n0 >= FULL_WAVES[0] * resident_blocks
                  * T.truncdiv(n0 + resident_blocks - 1, resident_blocks))
    if max_keys is None:
        return ladder - (ladder - 1) * full * T.Cast("int32", n0 > resident_blocks)
    known = T.Cast("int32", max_keys > 0)
    balanced = known * T.Cast("int32", BALANCED[1] * max_keys <= BALANCED[0] * raw_keys)
    # balanced, or past one wave and not known: a 0/1 sum (the two cannot both hold)
    take = balanced + (1 - known) * T.Cast("int32", n0 > resident_blocks)
    return ladder - (ladder - 1) * full * take


#: Key alignment of a chunked split (``chunk_split``): a multiple of every decode kernel's key tile.
CHUNK_ALIGN = 64


def decode_split_ranges(spec) -> str:
    """The forced split-range mode of the CUDA MHA decode kernels: path switch ``cuda_decode_split_ranges``
    (``pagedkv.kernel_spec.SWITCHES``): "auto", "entry" or "chunk"."""
    return forced_path(spec.paths, "cuda_decode_split_ranges")


def chunk_split(B, nnz, S, *, ps, ranges: int, max_keys, max_splits: int, min_keys: int, avg_keys=None,
                mode: str = "auto", forced: int = 0):
    """``(S', C)``: how a split-KV decode cuts its entries' keys, from the shapes, the split count ``S`` of
    the split rule and the runtime's ``max_keys`` (``max_kv_len``; 0: not known). Host side.

    * ``C == 0`` ("entry" ranges): every entry's span in ``S' = S`` equal ranges (the kernels' own rule).
    * ``C > 0`` ("chunk" ranges): every entry's span in ranges of ``C`` keys, as many as it needs; ``S' =
      ceil(span of the longest entry / C)`` blocks an (entry, kv head), the ones past an entry's keys empty.
      ``C``: the batch's keys over ``ranges`` (a constant: the blocks aimed at / blocks a range), at least
      ``min_keys``, a multiple of ``CHUNK_ALIGN``, and large enough for ``S' <= max_splits``; with a forced
      split count (``forced``) and "chunk", the longest entry's span over it (tests reach any range count).

    Why: with entry ranges the longest entry's ranges are the longest blocks, ``S`` times an average one's
    in a batch of 128 .. 16K keys, and the last ones to start leave the GPU mostly idle while they run
    (H100, 32 x 8 kv heads of that batch: 0.92 of FlashInfer's decode, which plans ranges of one size).
    Chunk ranges bound every block by ``C``. ``mode``: "entry", "chunk" (whenever ``max_keys`` is known;
    tests), "auto" (chunk when known, the batch skewed, ``max_keys`` over ``BALANCED`` times the average,
    and its longest entry more than one range: a balanced batch keeps equal ranges, which a uniform ``C``
    would leave a short tail range); a forced split count (``forced``, ``cuda_decode_splits``) keeps entry
    ranges under "auto". ``C`` reads neither ``S`` nor a block budget of the shapes: TVM substitutes
    host lets at every use, and with ``S``'s rule inside ``C`` the decode PrimFunc's compile took 290 s (2.4 s
    before; CompactBufferAllocation's regions under the grid extent ``S'``). Arithmetic selects, as in
    ``wave_split_count``."""
    if mode == "entry" or (mode == "auto" and forced) or max_keys is None:
        return S, 0
    raw = T.truncdiv(nnz * ps, T.max(B, 1))
    longest = max_keys if avg_keys is None else avg_keys(max_keys)
    total = nnz * ps if avg_keys is None else B * avg_keys(raw)  # a window bounds every entry's keys
    # Each sub-expression once: the sizes multiply (below, every ceil is (x - 1) / y + 1 for x >= 1).
    if forced:  # chunk forced with the split count: the longest entry's ranges
        per_range = T.truncdiv(T.max(longest, 1) - 1, min(forced, max_splits)) + 1
    else:
        per_range = T.max(T.max(T.truncdiv(T.max(total, 1) - 1, ranges),
                                T.truncdiv(T.max(longest, 1) - 1, max_splits)) + 1, min_keys)
    C = (T.truncdiv(per_range - 1, CHUNK_ALIGN) + 1) * CHUNK_ALIGN
    # Chunk ranges' count an (entry, kv head); the kind of ranges decided by this count's being above 1.
    X = T.truncdiv(T.max(longest, 1) - 1, C) + 1
    use = T.Cast("int32", max_keys > 0)
    if mode == "auto":
        use = use * T.Cast("int32", BALANCED[1] * max_keys > BALANCED[0] * raw) * T.Cast("int32", X > 1)
    # Bounded for TVM's analyses (S' <= max_splits holds already): an unbounded grid extent made
    # CompactBufferAllocation take 20-60 s on the decode PrimFunc (2 s without chunked ranges).
    return T.min(S * (1 - use) + use * X, max_splits), use * C


def split_chunk(var, kvlen, Sk, Ck, tk: int):
    """Keys of each split range of an entry of ``kvlen`` keys (device side): ``Ck`` (a chunked split,
    ``chunk_split``) or, when ``Ck == 0``, the span (``var.decode_span_len``) in ``Sk`` equal ranges, a
    multiple of the key tile ``tk``. Range ``sp``: ``[decode_key(kvlen, sp * chunk), + chunk)`` capped at
    ``kvlen``."""
    span = var.decode_span_len(kvlen)
    return T.if_then_else(Ck > 0, Ck, T.truncdiv(T.truncdiv(span + Sk - 1, Sk) + tk - 1, tk) * tk)


_OPAQUE_SOURCE = ("#ifndef PAGEDKV_OPAQUE\n#define PAGEDKV_OPAQUE\n"
                  "__device__ __forceinline__ int pagedkv_opaque_i32(int x) { return x; }\n#endif\n")


def opaque_i32(x):
    """``x`` (int32) as a kernel sees it, hidden from TVM's simplifier; nvcc inlines the identity (same code).

    For the split count ``S`` of the split-KV kernels: a host expression of the shapes (``wave_split_count``,
    ~700 characters), and TVM's passes substitute a pure let's value at every use. In a kernel,
    ``ceil(keys / S)``, the rows' ``* S`` and the ``S == 1`` test then carried it through every simplification:
    the default decode PrimFunc (32/8/128 fp16: tc kernels, merge) took 42 s to lower, ~5 s with ``S`` opaque
    inside its kernels. Bind it once a kernel (``Sk: T.let[T.int32] = opaque_i32(S)``); the grid's extent keeps
    the host's ``S``."""
    return T.cuda.func_call("pagedkv_opaque_i32", x, source_code=_OPAQUE_SOURCE, return_type="int32")


def make_merge_splits(num_heads: int, dv: int, threads: int, dtype: str):
    """``merge_splits(o, lse, B, S, ws_o, ws_l)``: the second kernel of a split-KV decode. Every (entry, head)
    row of ``o[B, H, Dv]`` / ``lse[B, H]`` from its ``S`` normalized partial states ``ws_o[B*H*S, Dv]`` /
    ``ws_l[B*H*S]`` (base-2 lse merge); one block of ``threads`` threads per row."""
    H, DV, MT = num_heads, dv, threads

    @T.macro
    def merge_splits(o, lse, B, S, ws_o, ws_l):
        for row in T.thread_binding(T.max(B, 1) * H, thread="blockIdx.x"):
            for t in T.thread_binding(MT, thread="threadIdx.x"):
                ms = T.alloc_buffer((3,), "float32", scope="local")
                if row < B * H:
                    Sk: T.let[T.int32] = opaque_i32(S)
                    ms[0] = T.float32(EMPTY_LSE)
                    for sp in T.serial(Sk):
                        ms[0] = T.max(ms[0], ws_l[row * Sk + sp])
                    ms[1] = T.float32(0)
                    for sp in T.serial(Sk):
                        ms[1] = ms[1] + T.exp2(ws_l[row * Sk + sp] - ms[0])
                    for c in T.serial(ceildiv(DV, MT)):
                        if c * MT + t < DV:
                            ms[2] = T.float32(0)
                            for sp in T.serial(Sk):
                                # An empty partial (lse -1e30) writes no o (the decode kernels' stores). A NaN
                                # one's o is skipped too, but its weight makes ms[1], hence o and lse, NaN.
                                if ws_l[row * Sk + sp] > T.float32(EMPTY_LSE):
                                    ms[2] = ms[2] + ws_o[row * Sk + sp, c * MT + t] * T.exp2(
                                        ws_l[row * Sk + sp] - ms[0])
                            o[T.truncdiv(row, H), T.truncmod(row, H), c * MT + t] = T.Cast(o.dtype, ms[2] / ms[1])
                    if t == 0:
                        # All splits empty: lse = -1e30 + log2(S) == -1e30 in float32, o = 0.
                        lse[T.truncdiv(row, H), T.truncmod(row, H)] = ms[0] + T.log2(ms[1])

    return merge_splits
