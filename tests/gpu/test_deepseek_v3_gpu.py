"""DeepSeek-V3 (MLA) on the GPU: the float32 CUDA model library built on the GPU-less host (``make
gpu-bundle`` -> ``.gpu/models/deepseek-*-float32-cuda.so`` + ``.npz``), loaded with the TVM runtime only,
plays the scenario of ``pagedkv.testing.deepseek`` (batched prefill, a fork inside a prompt, a second
prefill, 16 batched decode steps, one token each through ``prefill``); every logits row must match HF
transformers' float64 logits (computed on the build host with the same random weights) to 1e-4."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedkv.testing import deepseek as D

MODEL_DIR = Path(os.environ.get("PAGEDKV_MODEL_DIR", ".gpu/models"))
CASES = sorted(MODEL_DIR.glob("deepseek-*-float32-cuda.so"))


@pytest.mark.parametrize("lib", CASES or [None], ids=[p.stem for p in CASES] or ["missing"])
def test_deepseek_v3_cuda_matches_hf(lib):
    if lib is None:
        pytest.skip(f"no DeepSeek-V3 CUDA model library in {MODEL_DIR} (make gpu-bundle builds it)")
    import tvm
    from tvm.runtime.vm import VirtualMachine  # the runtime's VM: no compiler needed

    from pagedkv.runtime import load_library

    meta, params, expected = D.read_case(lib.with_suffix(".npz"))
    dev = tvm.cuda()
    vm = VirtualMachine(load_library(lib), dev)
    got = D.run_scenario(vm, [tvm.runtime.tensor(p, dev) for p in params], meta["steps"], dev)
    worst = D.worst_errors(got, meta["rows"], expected)
    for kind, (err, at) in worst.items():
        print(f"[{meta['name']} seed {meta['seed']}] max relative logits error, {kind}: {err:.2e} ({at})")
    for kind, (err, at) in worst.items():
        assert err < D.TOL["float32"], f"{kind}: relative error {err:.2e} at {at}"
