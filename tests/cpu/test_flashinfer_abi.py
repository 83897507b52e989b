"""The pinned flashinfer-python 0.7.4 argument lists (``pagedkv.flashinfer.abi``): the C++ header the runtime
adapter uses is generated from them and current, and their counts are the measured ones
(``../shared/gpu-host/BUILD-FACTS.md``: prefill plan 21, MLA run 18, decode plan 15). No flashinfer needed;
``test_flashinfer_build.py`` checks the same table against compiled modules."""

from __future__ import annotations

from pathlib import Path

from pagedkv.flashinfer import abi

HEADER = Path(__file__).resolve().parents[2] / "src" / "flashinfer_abi.h"


def test_header_is_generated_from_the_table():
    assert HEADER.read_text() == abi.cpp_header(), (
        "src/flashinfer_abi.h is stale: python -m pagedkv.flashinfer.abi > src/flashinfer_abi.h")


def test_argument_counts():
    counts = {(f.kind, f.func): f.num_args for fs in abi.CALLED.values() for f in fs}
    assert counts == {
        ("decode", "plan"): 15, ("decode", "run"): 19,
        ("prefill_fa2", "plan"): 21, ("prefill_fa2", "ragged_run"): 27, ("prefill_fa2", "paged_run"): 29,
        ("prefill_fa3", "plan"): 16, ("prefill_fa3", "ragged_run"): 22, ("prefill_fa3", "paged_run"): 24,
        ("mla", "plan"): 9, ("mla", "run"): 18,
    }


def test_argument_names_are_unique_per_function():
    for fs in abi.CALLED.values():
        for f in fs:
            names = [n for n, _ in f.args]
            assert len(names) == len(set(names)), f"{f.kind}.{f.func}"
