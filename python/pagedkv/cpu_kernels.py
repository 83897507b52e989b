"""Hand-written CPU matmul kernels for the model's projections (``pagedkv.cpu_pipeline`` puts them in).

A projection after TVM's legalization is ``out[..., n] = sum_k a[..., k] * w[k, n]`` (``w`` a ``[K, N]``
weight, see ``models._common.LinearKN``), maybe followed by a residual add. TVM 0.27's CPU pipeline leaves
it an unscheduled loop nest (no threads, no vectors); dlight's CPU ``GEMV`` rule vectorizes the reduction's
spatial axis with strided loads. These kernels replace such a function with one of the same parameters:

* **one row** (decode of one sequence, the prefill's logits): the weight streams from memory once. ``K``
  is cut into ``KSPLIT`` slices run in parallel; a slice reads its rows of ``w`` front to back (one
  contiguous range of memory per thread) into float32 partial sums of the whole output row, which one
  thread then adds. Column chunks per thread instead (``w[k, chunk]`` for every ``k``: a few KiB, then a
  jump) streamed at half the bandwidth on the 2-core host.
* **2 to GEMV_ROWS rows** (batched decode): the register tiles below, rows zero-padded to ``GEMV_ROWS``, so
  each weight vector is loaded once for every row.
* **more rows** (prefill): a register-tiled GEMM. Tiles of ``MR x NR`` outputs (6 x 64: 24 AVX-512
  accumulators) run over the whole ``K``; ``NR``-column strips run in parallel, and each strip's ``K x NR``
  weight panel stays in L2 while every row tile passes over it. The rows past the last full tile are
  copied into one zero-padded tile.

Loops all start at 0 (TVM 0.27's ``CanonicalizeLoop`` miscompiles nested loops under an outer loop that
starts above 0, see ``tir_kernels/attention_cpu.py``): the row tail is ``base + t`` for ``t`` from 0. No
``x = ...`` binding inside a vectorized loop either: TVM 0.27 compiled one (a let of the lane index) into
wrong sums without a word. Sums are float32 whatever the input dtype.

float16 / bfloat16 (a half model's projections: ``matmul`` in float32, ``cast`` back, maybe ``add``): inputs and
weights are converted to float32 as they are loaded (F16C's ``vcvtph2ps``; for bfloat16 a zero-extend and a
16-bit shift, on any x86 CPU), outputs rounded to the dtype as they are stored, then the residual added in it,
as the original functions do. A decode step reads half the bytes of float32's. No bf16 dot-product (AVX512-BF16)
or AMX instructions: they need the weights re-laid in pairs along ``K``, and the library is built for the host's
``mcpu`` only (``pagedkv.target.host_target``), so it runs wherever that CPU's instructions do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from .tir_kernels._common import fast_macro_expansion

#: Rows up to which one zero-padded register tile serves (above one row: one row streams, see above).
GEMV_ROWS = 4
#: Float32 lanes of one vector (AVX-512); strips and chunks are multiples of it.
LANES = 16
#: Register tile of the GEMM path: rows x columns.
MR, NR = 6, 64
#: Slices of ``K`` the GEMV path streams in parallel (the final sum below adds exactly four).
KSPLIT = 4
#: Largest column block of the GEMV path's final sum over the slices.
MAX_CHUNK = 1024
#: Dtypes of inputs, weights and outputs the kernels take (half ones are converted to float32 in registers:
#: F16C / AVX-512 conversions for float16, a 16-bit shift for bfloat16).
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class MatmulShape:
    """A projection to replace: buffers of the original function and the weight's dims.

    Parameters
    ----------
    params :
        The original function's parameters, in order; each is ``"a"``, ``"w"``, ``"res"`` or ``"out"``.
    a_shape, out_shape :
        Shapes (``PrimExpr``) of the input rows ``[..., K]`` and of the output ``[..., N]``.
    k, n :
        The weight's ``[K, N]``.
    a_dtype, w_dtype, out_dtype :
        Dtypes, each one of ``DTYPES``; the residual has ``out_dtype``. Sums are float32 whatever they are,
        cast to ``out_dtype`` before the residual is added (as a half model's ``matmul``, ``cast``, ``add``).
    """

    params: tuple[str, ...]
    a_shape: tuple
    out_shape: tuple
    k: int
    n: int
    a_dtype: str
    w_dtype: str
    out_dtype: str = "float32"

    @property
    def has_residual(self) -> bool:
        return "res" in self.params


def gemv_chunk(n: int) -> int | None:
    """Column block of the GEMV path's final sum: the largest multiple of ``LANES`` dividing ``n``, at most ``MAX_CHUNK``,
    that leaves an even number (>= 4) of chunks for the threads, else one leaving >= 2; None if none."""
    cands = [c for c in range(LANES, min(n, MAX_CHUNK) + 1, LANES) if n % c == 0]
    for ok in (lambda q: q >= 4 and q % 2 == 0, lambda q: q >= 2):
        good = [c for c in cands if ok(n // c)]
        if good:
            return max(good)
    return None


def gemm_strip(n: int) -> int | None:
    """Column strip of the GEMM path: ``NR``, or a smaller power-of-two multiple of ``LANES`` dividing ``n``."""
    return next((s for s in (NR, 32, LANES) if n % s == 0), None)


def supported(shape: MatmulShape) -> bool:
    """Whether ``matmul_kernel`` serves ``shape`` (``N`` a multiple of ``LANES``; dtypes of ``DTYPES``)."""
    dtypes = (shape.a_dtype, shape.w_dtype, shape.out_dtype)
    return (all(d in DTYPES for d in dtypes) and gemv_chunk(shape.n) is not None
            and gemm_strip(shape.n) is not None and shape.k % KSPLIT == 0)


def matmul_kernel(shape: MatmulShape) -> tirx.PrimFunc:
    """The replacement PrimFunc for ``shape`` (same parameters, in the same order)."""
    with fast_macro_expansion():  # TVM's macro lookup otherwise walks every frame's source: a fifth of a model build
        return _matmul_kernel(shape)


def _matmul_kernel(shape: MatmulShape) -> tirx.PrimFunc:
    K, N = shape.k, shape.n
    RB, SR = gemv_chunk(N), gemm_strip(N)
    rows = math.prod(shape.a_shape[:-1])
    gemv, small, gemm = _gemv_body(K, N, RB), _small_body(K, N, SR), _gemm_body(K, N, SR, shape.a_dtype)
    store = _store_fn(shape.out_dtype, residual=shape.has_residual)
    a_shape, o_shape, adt, wdt, odt = shape.a_shape, shape.out_shape, shape.a_dtype, shape.w_dtype, shape.out_dtype

    @T.macro
    def body(A, W, O, R):
        Af = T.decl_buffer((rows, K), adt, data=A.data)
        Of = T.decl_buffer((rows, N), odt, data=O.data)
        Rf = T.decl_buffer((rows, N), odt, data=R.data)
        if rows == 1:
            gemv(Af, W, Of, Rf, store)
        elif rows <= GEMV_ROWS:
            small(Af, W, Of, Rf, rows, store)
        else:
            gemm(Af, W, Of, Rf, rows, store)

    # Only the variant needed is parsed: TVMScript's parse is most of the time a model's compile spends here.
    if shape.has_residual:

        @T.prim_func(private=True)
        def func(a_h: T.handle, w_h: T.handle, r_h: T.handle, o_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            A = T.match_buffer(a_h, a_shape, adt)
            W = T.match_buffer(w_h, (K, N), wdt)
            R = T.match_buffer(r_h, o_shape, odt)
            O = T.match_buffer(o_h, o_shape, odt)
            body(A, W, O, R)

    else:

        @T.prim_func(private=True)
        def func(a_h: T.handle, w_h: T.handle, o_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            A = T.match_buffer(a_h, a_shape, adt)
            W = T.match_buffer(w_h, (K, N), wdt)
            O = T.match_buffer(o_h, o_shape, odt)
            body(A, W, O, O)

    # The kernels above take (a, w, [res,] out); put the parameters in the original function's order.
    canonical = ("a", "w", "res", "out") if shape.has_residual else ("a", "w", "out")
    params = [func.params[canonical.index(role)] for role in shape.params]
    return tirx.PrimFunc(params, func.body, func.ret_type, func.attrs)


def _store_fn(out_dtype: str, *, residual: bool):
    """The macro writing one float32 sum: cast to ``out_dtype``, then the residual (of that dtype) added."""
    if out_dtype == "float32":  # no cast node at all: the float32 kernels stay as they were

        @T.macro
        def store(Of, Rf, m, n, value):
            Of[m, n] = value

        @T.macro
        def store_res(Of, Rf, m, n, value):
            Of[m, n] = Rf[m, n] + value

    else:

        @T.macro
        def store(Of, Rf, m, n, value):
            Of[m, n] = T.Cast(out_dtype, value)

        @T.macro
        def store_res(Of, Rf, m, n, value):
            Of[m, n] = Rf[m, n] + T.Cast(out_dtype, value)

    return store_res if residual else store


def _gemv_body(K: int, N: int, RB: int):
    """One row: ``KSPLIT`` parallel slices of ``K``, each streaming its contiguous rows of ``w`` into
    partial sums ``part[slice, :]``; then one thread adds the slices up."""
    V, KC = LANES, K // KSPLIT

    @T.macro
    def gemv(Af, W, Of, Rf, store):
        part = T.alloc_buffer((KSPLIT, N), "float32")
        for c in T.parallel(KSPLIT):
            for jo in range(N // V):
                for ji in T.vectorized(V):
                    part[c, jo * V + ji] = T.float32(0)
            for kk in range(KC):
                for jo in range(N // V):
                    for ji in T.vectorized(V):
                        part[c, jo * V + ji] = part[c, jo * V + ji] + T.Cast(
                            "float32", Af[0, c * KC + kk]) * T.Cast("float32", W[c * KC + kk, jo * V + ji])
        # The sum of the slices is a few microseconds of work: one thread, no second parallel launch
        # (each costs ~10 us on the 2-core host, and a decode step makes hundreds).
        for r in range(N // RB):
            for jo in range(RB // V):
                for ji in T.vectorized(V):
                    store(Of, Rf, 0, r * RB + jo * V + ji, part[0, r * RB + jo * V + ji]
                          + part[1, r * RB + jo * V + ji] + part[2, r * RB + jo * V + ji]
                          + part[3, r * RB + jo * V + ji])

    return gemv


def _small_body(K: int, N: int, SR: int):
    """2 to GEMV_ROWS rows: the rows, zero-padded to GEMV_ROWS, times ``SR``-column strips of ``w`` in
    parallel, ``GEMV_ROWS x SR`` sums in registers (each weight vector is loaded once for every row)."""

    @T.macro
    def small(Af, W, Of, Rf, rows, store):
        a = T.alloc_buffer((GEMV_ROWS, K), "float32")
        for m, k in T.grid(GEMV_ROWS, K):
            row = T.Cast("int64", m)
            a[m, k] = T.if_then_else(row < rows, T.Cast("float32", Af[T.min(row, rows - 1), k]), T.float32(0))
        for s in T.parallel(N // SR):
            acc = T.alloc_buffer((GEMV_ROWS, SR), "float32", scope="local")
            for i in T.unroll(GEMV_ROWS):
                for j in T.vectorized(SR):
                    acc[i, j] = T.float32(0)
            for k in range(K):
                for i in T.unroll(GEMV_ROWS):
                    for j in T.vectorized(SR):
                        acc[i, j] = acc[i, j] + a[i, k] * T.Cast("float32", W[k, s * SR + j])
            for i in range(rows):
                for j in T.vectorized(SR):
                    store(Of, Rf, i, s * SR + j, acc[i, j])

    return small


def _gemm_body(K: int, N: int, SR: int, a_dtype: str):
    """More rows: ``MR x SR`` register tiles, ``SR``-column strips in parallel; the last ``rows % MR`` rows
    form one more tile, zero-padded (one row at a time would re-read the strip's weights per row). Half rows
    are converted to float32 once first: converting them in the tile loop (6 scalar loads and conversions
    per step of ``k``, for 24 vector FMAs) made the float16 GEMM ~20% slower than the float32 one."""
    tiles = _gemm_tiles(K, N, SR)
    if a_dtype == "float32":
        return tiles

    @T.macro
    def gemm(Af, W, Of, Rf, rows, store):
        Ac = T.alloc_buffer((rows, K), "float32")
        for m, k in T.grid(rows, K):
            Ac[m, k] = T.Cast("float32", Af[m, k])
        tiles(Ac, W, Of, Rf, rows, store)

    return gemm


def _gemm_tiles(K: int, N: int, SR: int):
    """The tiles of ``_gemm_body`` over rows ``Af`` (float32, or converted to it per load)."""

    @T.macro
    def gemm(Af, W, Of, Rf, rows, store):
        full = rows // MR * MR
        tail = T.alloc_buffer((MR, K), "float32")
        for i, k in T.grid(MR, K):
            row = full + T.Cast("int64", i)
            tail[i, k] = T.if_then_else(row < rows, T.Cast("float32", Af[T.min(row, rows - 1), k]), T.float32(0))
        for s in T.parallel(N // SR):
            acc = T.alloc_buffer((MR, SR), "float32", scope="local")
            for mb in range(rows // MR):
                for i in T.unroll(MR):
                    for j in T.vectorized(SR):
                        acc[i, j] = T.float32(0)
                for k in range(K):
                    for i in T.unroll(MR):
                        for j in T.vectorized(SR):
                            acc[i, j] = acc[i, j] + T.Cast("float32", Af[mb * MR + i, k]) * T.Cast(
                                "float32", W[k, s * SR + j])
                for i in T.unroll(MR):
                    for j in T.vectorized(SR):
                        store(Of, Rf, mb * MR + i, s * SR + j, acc[i, j])
            if full < rows:
                for i in T.unroll(MR):
                    for j in T.vectorized(SR):
                        acc[i, j] = T.float32(0)
                for k in range(K):
                    for i in T.unroll(MR):
                        for j in T.vectorized(SR):
                            acc[i, j] = acc[i, j] + tail[i, k] * T.Cast("float32", W[k, s * SR + j])
                for t in range(rows - full):
                    for j in T.vectorized(SR):
                        store(Of, Rf, full + t, s * SR + j, acc[t, j])

    return gemm
