"""One target per machine (issue 43, item 1): every spelling a TVM user has gives one canonical value, sm_90 and
sm_90a are one machine, and an arch the CUDA kernels cannot serve is refused before any code is generated."""

from __future__ import annotations

import pytest
import tvm

import pagedkv
from pagedkv import backends, ops
from pagedkv import target as tg
from pagedkv.backends.flashinfer import target_arch as flashinfer_arch

HOPPER = {"kind": "cuda", "arch": "sm_90a"}

SPELLINGS = ["cuda", "cuda -arch=sm_90a", "cuda -arch=sm_90", "nvidia/nvidia-h100", {"kind": "cuda"},
             {"kind": "cuda", "arch": "sm_90"}, {"kind": "cuda", "arch": "sm_90a"}, '{"kind": "cuda", "arch": "sm_90"}',
             tvm.target.Target("nvidia/nvidia-h100"), tvm.target.Target({"kind": "cuda", "arch": "sm_90"})]


@pytest.mark.parametrize("spelling", SPELLINGS, ids=lambda s: str(s)[:40])
def test_hopper_spellings_are_one_target(spelling, monkeypatch):
    monkeypatch.setattr(tg, "detected_cuda_arch", lambda: None)  # this host: no GPU
    assert tg.canonical(spelling) == HOPPER
    assert tg.key(spelling) == tg.key(HOPPER)
    # FlashInfer's module specs name Hopper sm_90 (its fa3 modules are built from that name).
    assert flashinfer_arch(spelling) == "sm_90"


def test_bare_cuda_means_this_hosts_gpu(monkeypatch):
    monkeypatch.setattr(tg, "detected_cuda_arch", lambda: "sm_89")
    assert tg.canonical("cuda") == {"kind": "cuda", "arch": "sm_89"}
    assert tg.canonical({"kind": "cuda", "arch": "sm_80"}) == {"kind": "cuda", "arch": "sm_80"}  # named: kept
    assert "this host's GPU" in tg.describe("cuda")
    monkeypatch.setattr(tg, "detected_cuda_arch", lambda: None)
    assert f"'cuda' means {tg.DEFAULT_CUDA_ARCH}" in tg.describe("cuda")


def test_other_archs_and_llvm():
    assert tg.canonical("nvidia/nvidia-a100") == {"kind": "cuda", "arch": "sm_80"}
    assert tg.canonical("llvm -mcpu=skylake") == {"kind": "llvm"}
    assert tg.canonical(tvm.target.Target("llvm")) == {"kind": "llvm"}
    assert tg.arch_number("sm_90a") == 90


@pytest.mark.parametrize("bad", ["gpu", "cuda -arch", "nvidia/no-such-card", {"kind": "cuda", "arch": "90"}, {},
                                 3.5])
def test_unreadable_targets_raise(bad):
    with pytest.raises(ValueError):
        tg.canonical(bad)


def test_unservable_arch_is_refused_before_codegen(monkeypatch):
    """TVM's Target("cuda") without a GPU is sm_50: the TIR backend refuses it with the spelling to use, and
    resolving raises before any kernel is generated."""
    from pagedkv import tir_kernels

    def no_codegen(*a, **k):
        raise AssertionError("kernel code generated for an unservable arch")

    monkeypatch.setattr(tir_kernels, "build_kernels", no_codegen)
    cfg = pagedkv.KVCacheConfig(num_layers=1, num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype="float16",
                                max_batch_size=2, max_total_seq_len=256, prefill_chunk_size=64)
    sm50 = tvm.target.Target({"kind": "cuda", "arch": "sm_50"})
    why = backends.get_backend("tir").validate_configuration(ops.ATTN_DECODE_PAGED, cfg, sm50)
    assert any("sm_50" in w and "sm_80 or newer" in w and "'cuda'" in w for w in why), why
    with pytest.raises(backends.NoBackendError, match="sm_80 or newer"):
        backends.resolve(cfg, tg.canonical(sm50), ["tir"])
    assert not backends.get_backend("tir").validate_configuration(ops.ATTN_DECODE_PAGED, cfg, "cuda")
