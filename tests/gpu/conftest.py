"""GPU suite: the CPU scenario suite on CUDA. Skips cleanly without a CUDA GPU.

On the GPU host (TVM runtime only) kernels come prebuilt from ``$PAGEDKV_KERNEL_DIR`` (``make gpu-bundle``
on the build host writes them to ``.gpu/kernels``); with a TVM compiler present they are compiled here.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def make_gpu_cache():
    import pagedkv

    def make(config, backend="tir"):
        return pagedkv.create(config, backend=backend, target="cuda", device="cuda", poison=True)

    return make
