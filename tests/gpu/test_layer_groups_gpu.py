"""Layer groups on CUDA (``tests/cpu/test_layer_groups.py`` on the GPU): a cache whose layers alternate window 40 and
full attention (``pagedkv.testing.layer_groups.GPU_GROUPS``: 32 / 8 heads x 128, fp16) on the TIR CUDA kernels, every
output within 1e-2 of the float64 reference, and far from attention without the window in the sliding layers; the
sliding group's pool gives pages back. Libraries: the GPU suite's plain 32x8x128 fp16 shape and the window-40 kernels
of that shape, both prebuilt by ``make gpu-bundle`` (``pagedkv.apps.gpu_bundle``: ``GPU_GROUPS``)."""

from __future__ import annotations

from pagedkv.testing.layer_groups import GPU_GROUPS, GPU_PLAN, run_alternating


def test_layer_groups_alternating_gpu(make_gpu_cache, gen):
    cache = make_gpu_cache(GPU_GROUPS, "tir")
    assert run_alternating(cache, gen, tol=1e-2, plan=GPU_PLAN) > 5e-2
    pools = cache.pool_pages()
    assert pools["sliding40"][1] > pools["main"][1]
