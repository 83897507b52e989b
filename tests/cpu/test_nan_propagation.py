"""NaN inputs give NaN outputs on the CPU TIR backend (issue 44; the semantics: ``pagedkv.testing.nan_rows``).

Before the fix a NaN query row came out as a finite row (the CPU kernels' exp2 turned a NaN score into 0, and the
stores took a NaN row sum for "no keys": o = 0, lse = -1e30), and a NaN v made every row of its key tile NaN, the
rows that do not see the key included (``0 * NaN`` in P V); every case here failed. The cases
(``pagedkv.testing.nan_cases``, shared with ``tests/gpu/test_nan_gpu.py``) run through the cache's entry points on
NaN-poisoned caches (every page slot not holding a key is NaN): a NaN q row, a NaN k or v of one token (the causal
rows before it and the rows whose sliding window excludes it stay finite and correct), NaN in popped slots, an
all-NaN forward, a prefix-shared forward (passes merged: the plain merge at float32, the partial-state ops at
float16), and MLA (cross attention over a forked sequence, self attention, the model's merge of the two, a NaN
state with the empty one). Configs are the scenario suite's (``pagedkv.testing.shapes``: their kernels are built
by it anyway).
"""

from __future__ import annotations

import pytest

from pagedkv.testing import nan_cases
from pagedkv.testing.shapes import MLA_SHAPES, SHAPES

F32, F16, WINDOW = "h4x4-d64-f32-p16-none", "h6x2-d64-f16-p8-normal", "h4x1-d64-f32-p8-normal-w13"
MLA = ["mla-h3-r64-rope32-nope32-v48-f32-p8", "mla-h4-r64-rope32-nope64-v64-f16-p16"]


def _config(shape_id):
    return next(s for s in SHAPES + MLA_SHAPES if s.id == shape_id).config()


@pytest.mark.parametrize("shape_id", [F32, F16])
def test_nan_q_row_gives_that_row_only(shape_id, make_cache, gen):
    nan_cases.q_row(make_cache(_config(shape_id)), gen)


@pytest.mark.parametrize("what", ["k", "v"])
@pytest.mark.parametrize("shape_id", [F32, WINDOW])
def test_nan_key_reaches_only_rows_that_see_it(shape_id, what, make_cache, gen):
    nan_cases.key(make_cache(_config(shape_id)), gen, what)


@pytest.mark.parametrize("shape_id", [F32, F16])
def test_all_nan_forward_gives_all_nan(shape_id, make_cache, gen):
    nan_cases.all_nan(make_cache(_config(shape_id)), gen)


@pytest.mark.parametrize("shape_id", [F32, F16])
def test_nan_through_prefix_shared_forward(shape_id, make_cache, gen):
    nan_cases.prefix_shared(make_cache(_config(shape_id)), gen)


@pytest.mark.parametrize("shape_id", MLA)
def test_mla_nan_rows_through_cross_self_and_merge(shape_id, make_cache, gen):
    nan_cases.mla(make_cache(_config(shape_id)), gen)
