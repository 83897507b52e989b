"""``tests/cpu/test_prefix_precision.py`` on CUDA: a prefix-shared fp16 / bf16 forward (four shared-prefix depths,
each pass a float32 partial state, merged and rounded once) within 1.2x the error of the same forward unshared,
both against the float64 reference (``pagedkv.testing.prefix_sharing``).

Shapes (prebuilt by the GPU bundle: ``pagedkv.testing.shapes.gpu_shapes``): head dim 64 fp16 (the mma.sync
prefill tiles tc3 / tc2 and the tensor-core decode on Hopper), head dim 128 bf16 (the wgmma tiles wg1t / wg2t,
which write a partial state's float32 o from their fragments), MLA at 4 heads bf16 (tc) and at DeepSeek's latent
with 16 heads fp16 (wgq on Hopper).
"""

from __future__ import annotations

import pytest

from pagedkv.testing import prefix_sharing
from pagedkv.testing.shapes import gpu_shapes

MAX_RATIO = 1.2
SHAPE_IDS = ("h6x2-d64-f16-p8-normal", "h32x8-d128-bf16-p16-normal", "mla-h4-r64-rope32-nope64-v64-bf16-p8",
             "mla-h16-r512-rope64-nope128-v128-f16-p16")


@pytest.mark.parametrize("shape_id", SHAPE_IDS)
def test_prefix_shared_forward_as_precise_as_unshared_gpu(shape_id, make_gpu_cache, gen):
    cfg = prefix_sharing.config_for(next(s for s in gpu_shapes() if s.id == shape_id).config())
    shared, unshared = prefix_sharing.run(make_gpu_cache(cfg), make_gpu_cache(cfg), gen)
    print(f"{shape_id}: relative error shared {shared:.3e}, unshared {unshared:.3e}, "
          f"ratio {shared / unshared:.2f}")
    assert shared <= MAX_RATIO * unshared, (
        f"{shape_id}: the prefix-shared forwards' relative error {shared:.3e} is {shared / unshared:.2f}x the "
        f"unshared ones' {unshared:.3e} (allowed: {MAX_RATIO}x)")
