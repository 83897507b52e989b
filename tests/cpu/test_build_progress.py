"""Progress lines of long builds (``pagedkv.progress``): what is built, how far it is, how long it took, and a
build that raises says FAILED, never "done": the reporter itself, ``pagedkv.compile.build_library`` and the
chat app's model compile (``pagedkv.apps.chat.compiled_library``)."""

from __future__ import annotations

import io
import re
import time

import pytest

from pagedkv.progress import Progress


def test_progress_prints_what_stages_ticks_and_done():
    out = io.StringIO()
    with Progress("compiling 3 things", detail="cached in X", every=0.05, stream=out) as progress:
        progress.stage("step 1/3")
        time.sleep(0.2)
        progress.update("step 2/3")  # no line of its own: the ticks name it
        time.sleep(0.2)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[pagedkv] compiling 3 things (cached in X) ..."
    assert re.fullmatch(r"\[pagedkv\]   step 1/3 \(0\.\d s\)", lines[1]), lines
    assert [line for line in lines if re.fullmatch(r"\[pagedkv\]   \.\.\. step 1/3: \d+ s", line)]
    assert [line for line in lines if re.fullmatch(r"\[pagedkv\]   \.\.\. step 2/3: \d+ s", line)]
    assert not [line for line in lines if re.fullmatch(r"\[pagedkv\]   step 2/3.*", line)]
    assert re.fullmatch(r"\[pagedkv\] compiling 3 things: done in 0\.\d s", lines[-1]), lines


def test_quiet_progress_speaks_only_when_the_build_runs_long():
    out = io.StringIO()
    with Progress("a short build", quiet_for=5.0, stream=out) as progress:
        progress.stage("step 1/1")
    assert out.getvalue() == ""
    with Progress("a long build", quiet_for=0.05, every=0.05, stream=out) as progress:
        progress.update("step 1/2")
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[pagedkv] a long build ..."
    assert re.fullmatch(r"\[pagedkv\]   \.\.\. step 1/2: \d+ s", lines[1]), lines
    assert lines[-1].startswith("[pagedkv] a long build: done in ")


def test_a_build_that_raises_says_failed_never_done():
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="nvcc exploded"):
        with Progress("compiling 9 kernels", quiet_for=5.0, stream=out):  # quiet, yet the failure is said
            raise RuntimeError("nvcc exploded\n  (the rest of the log)")
    assert re.fullmatch(r"\[pagedkv\] compiling 9 kernels: FAILED after 0\.0 s \(RuntimeError: nvcc exploded\)\n",
                        out.getvalue()), out.getvalue()
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        with Progress("compiling 9 kernels", stream=out):
            raise KeyboardInterrupt
    assert out.getvalue().splitlines()[-1].startswith("[pagedkv] compiling 9 kernels: interrupted after ")
    assert "done" not in out.getvalue()


class _Tiny:
    """A one-function nn model (built on first use: importing TVM's frontend is the cost)."""

    @staticmethod
    def make(fail: bool = False):
        from tvm.relax.frontend import nn

        class Tiny(nn.Module):
            def forward(self, x: nn.Tensor):
                if fail:
                    raise RuntimeError("the export exploded")
                return x + x

            def get_default_spec(self):
                return nn.spec.ModuleSpec.from_raw({"forward": {"x": nn.spec.Tensor([4], "float32")}}, self)

        return Tiny()


def test_build_library_prints_progress(tmp_path, capfd):
    from pagedkv.compile import build_library

    build_library(_Tiny.make(), "llvm", tmp_path / "m.so")
    err = capfd.readouterr().err
    assert f"[pagedkv] compiling the model for target llvm (into {tmp_path / 'm.so'}) ..." in err
    for stage in ("exporting the Relax module", "TVM compiles the model (1 function) for target llvm",
                  "writing the library"):
        assert f"[pagedkv]   {stage} (" in err, err
    assert re.search(r"\[pagedkv\] compiling the model for target llvm: done in \d+\.\d s", err), err


def test_build_library_failure_says_failed(tmp_path, capfd):
    from pagedkv.compile import build_library

    with pytest.raises(RuntimeError, match="the export exploded"):
        build_library(_Tiny.make(fail=True), "llvm", tmp_path / "m.so")
    err = capfd.readouterr().err
    assert re.search(r"compiling the model for target llvm: FAILED after \d+\.\d s \(RuntimeError: the export "
                     r"exploded\)", err), err
    assert "done" not in err
    assert not list(tmp_path.iterdir())


def test_chat_compile_failure_says_failed_and_leaves_no_library(tmp_path, monkeypatch, capfd):
    """The chat app's ticker said "done" when the model compile raised; now its compile is a cache entry that a
    failure leaves absent, and the line says FAILED."""
    from pagedkv import compile as compile_mod
    from pagedkv.apps import chat
    from pagedkv.models import llama

    def failing_build(model, target, path, **kwargs):
        path.write_bytes(b"half a library")
        raise RuntimeError("LLVM ran out of memory")

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_mod, "build_library", failing_build)
    monkeypatch.setattr(llama, "LlamaForCausalLM", lambda *args, **kwargs: object())
    with pytest.raises(RuntimeError, match="LLVM ran out of memory"):
        chat.compiled_library("a config", dtype="float32", target="llvm", backend="tir")
    captured = capfd.readouterr()
    assert re.search(r"compiling the model for llvm: FAILED after \d+\.\d s \(RuntimeError: LLVM ran out of "
                     r"memory\)", captured.err), captured.err
    assert "done" not in captured.out + captured.err
    assert not [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
