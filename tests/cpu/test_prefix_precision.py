"""Prefix sharing costs no precision (issue 44, item 5).

A forward whose sequences share a prefix runs several attention passes (one per shared-prefix depth, the own
pass, and in a fresh prefill the ragged pass over the new tokens) and merges their states. Each pass's partial
output stays float32 until the last merge, which rounds once to the storage dtype, so a prefix-shared fp16 /
bf16 forward is as close to the float64 reference as the same forward without sharing (which runs one pass,
or the ragged pass and one paged pass). Rounding every partial output and every merge to fp16 / bf16, as the
runtime did before (and still does with a library compiled without the partial-state ops), gave 1.46-1.58x the
unshared error here (MHA), 1.75-1.81x (MLA cross attention); now 1.00x.

Two caches run the same forwards on the same K/V contents (``pagedkv.testing.prefix_sharing``): in one the
sequences fork a common prefix (a chain of forks: four shared-prefix depths, the runtime's most), in the other
each sequence holds its own copy of the same tokens. Both are compared with one float64 reference
(``pagedkv.testing.reference``): a decode, a continuation and a prefill with a fresh sequence; MHA through
``attention_with_fused_qkv``, MLA through ``cross_attention``. Fresh random inputs each run. Configs: the
scenario suite's fp16 and bf16 shapes (compiled by it anyway; RoPE mode and capacity are not part of the
kernels).
"""

from __future__ import annotations

import pytest

from pagedkv.testing import prefix_sharing
from pagedkv.testing.shapes import MLA_SHAPES, SHAPES

#: The shared forwards may be at most this much less precise than the unshared ones (issue 44's bound).
MAX_RATIO = 1.2
SHAPE_IDS = ("h6x2-d64-f16-p8-normal", "h7x1-d64-bf16-p16-normal", "mla-h4-r64-rope32-nope64-v64-f16-p16",
             "mla-h4-r64-rope32-nope64-v64-bf16-p8")


@pytest.mark.parametrize("shape_id", SHAPE_IDS)
def test_prefix_shared_forward_as_precise_as_unshared(shape_id, make_cache, gen):
    cfg = prefix_sharing.config_for(next(s for s in SHAPES + MLA_SHAPES if s.id == shape_id).config())
    shared, unshared = prefix_sharing.run(make_cache(cfg, "tir"), make_cache(cfg, "tir"), gen)
    print(f"{shape_id}: relative error shared {shared:.3e}, unshared {unshared:.3e}, "
          f"ratio {shared / unshared:.2f}")
    assert shared <= MAX_RATIO * unshared, (
        f"{shape_id}: the prefix-shared forwards' relative error {shared:.3e} is {shared / unshared:.2f}x the "
        f"unshared ones' {unshared:.3e} (allowed: {MAX_RATIO}x)")
