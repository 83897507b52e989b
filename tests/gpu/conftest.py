"""GPU suite: the CPU scenario suite on CUDA. Not collected without a CUDA GPU (one header line says so).

On the GPU host (TVM runtime only) kernels come prebuilt from ``$PAGEDKV_KERNEL_DIR`` (``make gpu-bundle``
on the build host writes them to ``.gpu/kernels``); with a TVM compiler present they are compiled here.
"""

from __future__ import annotations

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
#: Without a GPU none of these modules is collected (importing them costs time and their cases would all skip).
collect_ignore_glob = [] if HAS_GPU else ["test_*.py"]


def pytest_report_header(config):
    if not HAS_GPU:
        return ["tests/gpu: not collected (no CUDA GPU: torch.cuda.is_available() is False)"]
    return []


@pytest.fixture(scope="session")
def make_gpu_cache():
    import pagedkv

    def make(config, backend="tir"):
        try:
            return pagedkv.create(config, backend=backend, target="cuda", device="cuda", poison=True)
        except FileNotFoundError as err:
            # A TIR-only bundle (`make gpu-bundle BUNDLE_ARGS=--no-flashinfer`) has no FlashInfer libraries, and a
            # runtime-only process cannot build one: the FlashInfer cases skip saying so. A missing TIR library
            # stays an error (every bundle has them).
            if "flashinfer" in (backend if isinstance(backend, (list, tuple)) else [backend]):
                pytest.skip(f"no prebuilt FlashInfer kernel library in this bundle: {err}")
            raise

    return make
