"""``tests/cpu/test_nan_propagation.py`` on CUDA (issue 44): NaN inputs give NaN outputs, and only there, through
the cache's entry points (``pagedkv.testing.nan_cases``: a NaN q row with NaN in fresh and popped slots, a NaN k or
v of one token, an all-NaN forward, a prefix-shared forward, MLA cross / self / merge; the semantics:
``pagedkv.testing.nan_rows``).

TIR CUDA, on shapes the GPU bundle prebuilds (``pagedkv.testing.shapes.gpu_shapes``), one per default kernel:
head dim 64 fp16 (the mma.sync prefill tiles tc3 / tc2, the tensor-core decode), head dim 128 bf16 (the wgmma
tiles wg1t / wg2t on Hopper), float32 (the SIMT prefill, the staged decode), windowed (float32 window 13: SIMT;
fp16 window 40 + soft cap: tensor cores); MLA at 4 heads bf16 (tc), at DeepSeek's latent with 16 heads fp16
(wgq on Hopper) and float32 (SIMT). FlashInfer (``("flashinfer", "tir")``) on the shapes of
``flashinfer_gpu_shapes`` it serves (skipped where the bundle has no FlashInfer library).

Known limits, as ``xfail`` that only the named exception satisfies (``strict=False``: an XPASS says the limit is
gone; any other failure fails):

* TIR CUDA, a NaN v: a key the row does not see but that a key tile of its query tile holds (the causal
  diagonal, the window's first tile) enters the row as ``0 * NaN`` in P V (``nan_rows.NaNLeak``): the kernels
  would need a per-element test of every V tile to keep it out; FlashAttention-style kernels share this. The
  CPU kernels move such a value's NaN into its key instead (``_attn_cpu_macros``).
* FlashInfer: whether its kernels propagate NaN is not known before a GPU run (its running max drops a NaN
  score as ours does; a row whose scores are all NaN may take its empty-row path): ``NaNLost`` or ``NaNLeak``
  xfails with the rows it found.
"""

from __future__ import annotations

import pytest

from pagedkv import backends
from pagedkv.testing import nan_cases
from pagedkv.testing.nan_rows import NaNLeak, NaNLost
from pagedkv.testing.shapes import flashinfer_gpu_shapes, gpu_shapes

F16, BF16, F32 = "h6x2-d64-f16-p8-normal", "h32x8-d128-bf16-p16-normal", "h4x4-d64-f32-p16-none"
WINDOWED = ["h4x1-d64-f32-p8-normal-w13", "h32x8-d128-f16-p16-normal-w40-cap3"]
MLA = ["mla-h4-r64-rope32-nope64-v64-bf16-p8", "mla-h16-r512-rope64-nope128-v128-f16-p16",
       "mla-h3-r64-rope32-nope32-v48-f32-p8"]
V_LEAK = pytest.mark.xfail(raises=NaNLeak, strict=False, reason=(
    "CUDA kernels: a NaN v of a key a row does not see, in a key tile its query tile visits, enters the row as "
    "0 * NaN in P V (a per-element test of every V tile would keep it out)"))
FI = ["flashinfer", "tir"]
CUDA = {"kind": "cuda", "arch": "sm_90"}
FI_UNKNOWN = pytest.mark.xfail(raises=(NaNLost, NaNLeak), strict=False, reason=(
    "FlashInfer's NaN propagation is not pagedkv's to fix: the message names the rows it got wrong"))


def _config(shape_id):
    return next(s for s in gpu_shapes() if s.id == shape_id).config()


@pytest.mark.parametrize("shape_id", [F16, BF16, F32])
def test_nan_q_row_gives_that_row_only_gpu(shape_id, make_gpu_cache, gen):
    nan_cases.q_row(make_gpu_cache(_config(shape_id)), gen)


@pytest.mark.parametrize("shape_id", [F16, BF16, F32] + WINDOWED)
def test_nan_k_reaches_only_rows_that_see_it_gpu(shape_id, make_gpu_cache, gen):
    nan_cases.key(make_gpu_cache(_config(shape_id)), gen, "k")


@V_LEAK
@pytest.mark.parametrize("shape_id", [F16, BF16, F32] + WINDOWED)
def test_nan_v_reaches_only_rows_that_see_it_gpu(shape_id, make_gpu_cache, gen):
    nan_cases.key(make_gpu_cache(_config(shape_id)), gen, "v")


@pytest.mark.parametrize("shape_id", [F16, BF16, F32])
def test_all_nan_forward_gives_all_nan_gpu(shape_id, make_gpu_cache, gen):
    nan_cases.all_nan(make_gpu_cache(_config(shape_id)), gen)


@pytest.mark.parametrize("shape_id", [F16, BF16, F32])
def test_nan_through_prefix_shared_forward_gpu(shape_id, make_gpu_cache, gen):
    nan_cases.prefix_shared(make_gpu_cache(_config(shape_id)), gen)


@pytest.mark.parametrize("shape_id", MLA)
def test_mla_nan_rows_through_cross_self_and_merge_gpu(shape_id, make_gpu_cache, gen):
    nan_cases.mla(make_gpu_cache(_config(shape_id)), gen)


def _fi_served(shape) -> bool:
    try:
        return "flashinfer" in backends.resolve(shape.config(), CUDA, FI).choice.values()
    except Exception:  # noqa: BLE001 (a config nobody serves is not a FlashInfer shape)
        return False


FI_SHAPES = [s.id for s in flashinfer_gpu_shapes() if _fi_served(s)
             and s.id in ("h8x2-d128-f16-p16-none", BF16, "mla-h16-r512-rope64-nope128-v128-f16-p16")]
FI_MHA = [s for s in FI_SHAPES if not s.startswith("mla")]
FI_CASES = {"q_row": nan_cases.q_row, "k": lambda c, g: nan_cases.key(c, g, "k"),
            "v": lambda c, g: nan_cases.key(c, g, "v"), "all_nan": nan_cases.all_nan,
            "prefix_shared": nan_cases.prefix_shared}


@FI_UNKNOWN
@pytest.mark.parametrize("case", list(FI_CASES))
@pytest.mark.parametrize("shape_id", FI_MHA)
def test_nan_flashinfer(shape_id, case, make_gpu_cache, gen):
    cache = make_gpu_cache(_config(shape_id), FI)
    print(f"{shape_id}: op backends {cache.op_backends}")
    FI_CASES[case](cache, gen)


@FI_UNKNOWN
@pytest.mark.parametrize("shape_id", [s for s in FI_SHAPES if s.startswith("mla")])
def test_mla_nan_flashinfer(shape_id, make_gpu_cache, gen):
    cache = make_gpu_cache(_config(shape_id), FI)
    print(f"{shape_id}: op backends {cache.op_backends}")
    nan_cases.mla(cache, gen)
