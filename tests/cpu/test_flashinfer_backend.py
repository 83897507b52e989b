"""Backend selection with FlashInfer: it serves the attention ops it has runtime adapters for (decode, ragged
and paged prefill, MLA decode and prefill) on CUDA where it can, fp16 and bf16 alike, says why where it
cannot (target, dtype, head dims, GQA group, RoPE mode, MLA dims and planner capacity, package), never
silently; and a kernel library built with it holds the TIR fatbins and the FlashInfer objects in one file."""

from __future__ import annotations

import json
import subprocess

import pytest

from pagedkv import KVCacheConfig, backends, ops
from pagedkv.backends import NoBackendError
from pagedkv.backends import flashinfer as fib
from pagedkv.backends.tir import forced_paths
from pagedkv.flashinfer import unavailable_reasons

SM90 = {"kind": "cuda", "arch": "sm_90"}
CFG = KVCacheConfig(num_layers=2, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype="float16",
                    page_size=16, max_batch_size=4, max_total_seq_len=256, prefill_chunk_size=64)
_WHY = unavailable_reasons()
needs_jit = pytest.mark.skipif(bool(_WHY), reason="FlashInfer JIT build unavailable: " + "; ".join(_WHY))


MLA = KVCacheConfig.mla(num_layers=2, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, dtype="float16", page_size=16, max_batch_size=4, max_total_seq_len=256,
                        prefill_chunk_size=64)
MHA_OPS = (ops.ATTN_DECODE_PAGED, ops.ATTN_PREFILL_RAGGED, ops.ATTN_PREFILL_PAGED)
MLA_OPS = (ops.MLA_ATTN_DECODE_PAGED, ops.MLA_ATTN_PREFILL_PAGED)


def _reasons(cfg, target=SM90, op=ops.ATTN_DECODE_PAGED):
    return backends.get_backend("flashinfer").validate_configuration(op, cfg, target)


@pytest.mark.parametrize("op", MHA_OPS)
@pytest.mark.parametrize("changes,fragment", [
    (dict(dtype="float32"), "dtype_q 'float32' not supported"),
    (dict(head_dim=96), "head dim 96 not supported"),
    (dict(rope_mode="inline"), "rope_mode 'inline'"),
])
def test_reasons_name_what_is_unsupported(op, changes, fragment):
    assert any(fragment in r for r in _reasons(CFG.replace(**changes), op=op)), _reasons(CFG.replace(**changes), op=op)


@pytest.mark.parametrize("op", MHA_OPS + MLA_OPS)
def test_bfloat16_configs_validate(op):
    """bf16 caches (Llama 3, Qwen, DeepSeek-V3 checkpoints) take the same modules as fp16 ones, in bf16."""
    cfg = (MLA if op in MLA_OPS else CFG).replace(dtype="bfloat16")
    assert not _reasons(cfg, op=op) or _WHY, _reasons(cfg, op=op)
    for spec, fp16 in zip(fib.module_specs(op, cfg, "sm_90"), fib.module_specs(op, cfg.replace(dtype="float16"), "sm_90")):
        assert spec.dtype_q == spec.dtype_kv == spec.dtype_o == "bfloat16" and not spec.reasons()
        assert spec.name == fp16.name.replace("_f16_f16_f16_", "_bf16_bf16_bf16_")


def test_group_size_limits_decode_only():
    cfg = CFG.replace(num_qo_heads=40)  # group 5: the tensor-core path serves it, the CUDA-core kernel cannot
    assert not _reasons(cfg) or _WHY
    with fib.forced_modules({ops.ATTN_DECODE_PAGED: "decode"}):
        assert any("GQA group size 40/8 not supported by the decode kernels" in r for r in _reasons(cfg))
    assert not _reasons(cfg, op=ops.ATTN_PREFILL_PAGED) or _WHY
    assert not _reasons(cfg, op=ops.ATTN_PREFILL_RAGGED) or _WHY


def test_mla_ops_and_reasons():
    assert all(not _reasons(MLA, op=op) or _WHY for op in MLA_OPS)
    # the MLA cache's self_attention (qk 192, v 128) stays with TIR: pagedkv builds prefill modules with qk == vo
    assert any("head_dim_qk == head_dim_vo" in r for r in _reasons(MLA, op=ops.ATTN_PREFILL_RAGGED))
    small = KVCacheConfig.mla(num_layers=1, num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                              v_head_dim=32, dtype="float16")
    assert any("MLA head dims (ckv 64, kpe 32) not supported" in r for r in _reasons(small, op=ops.MLA_ATTN_DECODE_PAGED))
    # DeepSeek-V3's 128 heads at a 16K chunk: the adapter splits passes the MLA planner cannot hold at once
    big = MLA.replace(num_qo_heads=128, num_kv_heads=128, prefill_chunk_size=16384)
    assert not [r for r in _reasons(big, op=ops.MLA_ATTN_PREFILL_PAGED) if "work items" in r]
    assert _reasons(MLA, op=ops.ATTN_DECODE_PAGED) == ["op 'attn_decode_paged' is not an op of mla layers"]
    assert _reasons(CFG, op=ops.MLA_ATTN_DECODE_PAGED) == ["op 'mla_attn_decode_paged' is not an op of mha layers"]


def test_module_kinds():
    kind = fib.module_kind
    assert kind(ops.ATTN_PREFILL_RAGGED, CFG, "sm_90") == "prefill_fa3"
    assert kind(ops.ATTN_PREFILL_RAGGED, CFG, "sm_80") == "prefill_fa2"
    assert kind(ops.ATTN_PREFILL_PAGED, CFG, "sm_90") == "prefill_fa3"
    assert kind(ops.ATTN_PREFILL_PAGED, CFG, "sm_80") == "prefill_fa2"
    assert kind(ops.MLA_ATTN_PREFILL_PAGED, MLA, "sm_90") == "mla_fa3"
    assert kind(ops.MLA_ATTN_DECODE_PAGED, MLA, "sm_80") == "mla"
    # decode: tensor cores from a GQA group of 8 (and groups the CUDA-core kernel lacks), both kernels chosen
    # per forward at 4 and 6, the CUDA-core kernel below
    def dec(hq, hkv=8):
        return kind(ops.ATTN_DECODE_PAGED, CFG.replace(num_qo_heads=hq, num_kv_heads=hkv), "sm_90")
    assert dec(64) == dec(40) == dec(56) == "prefill_fa2"
    assert dec(32) == dec(48) == "decode|prefill_fa2"
    assert dec(16) == dec(24) == dec(8) == "decode"
    assert [s.kind for s in fib.module_specs(ops.ATTN_DECODE_PAGED, CFG, "sm_90")] == ["decode", "prefill_fa2"]
    # a windowed cache's prefill ops share the fa2 module
    windowed = CFG.replace(sliding_window=64)
    assert kind(ops.ATTN_PREFILL_RAGGED, windowed, "sm_90") == kind(ops.ATTN_PREFILL_PAGED, windowed, "sm_90") \
        == "prefill_fa2"


def test_forced_modules():
    with fib.forced_modules({ops.ATTN_DECODE_PAGED: "prefill_fa3", ops.MLA_ATTN_DECODE_PAGED: "mla"}):
        assert fib.module_kind(ops.ATTN_DECODE_PAGED, CFG, "sm_90") == "prefill_fa3"
        assert fib.module_kind(ops.MLA_ATTN_DECODE_PAGED, MLA, "sm_90") == "mla"
        key = fib.FlashInferBackend().key_part(CFG, SM90, (ops.ATTN_DECODE_PAGED,))
    assert key != fib.FlashInferBackend().key_part(CFG, SM90, (ops.ATTN_DECODE_PAGED,))
    with pytest.raises(ValueError, match=r"runs on decode, prefill_fa2, prefill_fa3, decode\|prefill_fa2, not .mla."):
        with fib.forced_modules({ops.ATTN_DECODE_PAGED: "mla"}):
            pass
    with pytest.raises(ValueError, match="not a FlashInfer op"):
        with fib.forced_modules({ops.SPLIT_ROTARY: "decode"}):
            pass


def test_module_specs_follow_the_attention_options():
    """Modules are built with use_sliding_window / use_logits_soft_cap exactly when the config turns them on
    (a module built without them would ignore the run-time values)."""
    def specs(cfg):
        return {op: fib.module_specs(op, cfg, "sm_90") for op in fib.MHA_OPS}

    def every(d):
        return [s for v in d.values() for s in v]

    plain = specs(CFG)
    assert not any(s.use_sliding_window or s.use_logits_soft_cap for s in every(plain))
    capped = specs(CFG.replace(logits_soft_cap=30.0))
    assert all(s.use_logits_soft_cap and not s.use_sliding_window for s in every(capped))
    assert capped[ops.ATTN_PREFILL_RAGGED][0].kind == "prefill_fa3"
    both = specs(CFG.replace(sliding_window=512, logits_soft_cap=30.0))
    assert all(s.use_sliding_window and s.use_logits_soft_cap for s in every(both))
    for op, fp16 in plain.items():  # bf16: the same modules in bf16
        bf16 = fib.module_specs(op, CFG.replace(dtype="bfloat16"), "sm_90")
        assert [s.name for s in bf16] == [s.name.replace("_f16_f16_f16_", "_bf16_bf16_bf16_") for s in fp16]
    assert both[ops.ATTN_PREFILL_RAGGED] == both[ops.ATTN_PREFILL_PAGED]  # one fa2 module
    assert both[ops.ATTN_DECODE_PAGED][1] == both[ops.ATTN_PREFILL_PAGED][0]  # tensor-core decode shares it
    assert both[ops.ATTN_DECODE_PAGED][0].name == "decode_f16_f16_f16_qk128_vo128_pe0_swa_cap_sm90"


def test_not_on_cpu_and_not_other_ops():
    assert _reasons(CFG, "llvm") == ["FlashInfer modules are CUDA code; target kind is 'llvm'"]
    assert _reasons(CFG, SM90, ops.SPLIT_ROTARY) == [
        "backend 'flashinfer' does not implement op 'split_rotary'"]


def test_missing_package_is_a_reason(monkeypatch):
    from pagedkv.flashinfer import build

    monkeypatch.setattr(build, "installed_version", lambda: None)
    assert any("flashinfer-python is not installed" in r for r in _reasons(CFG))
    monkeypatch.setattr(build, "installed_version", lambda: "0.6.0")
    assert any("pins 0.7.4" in r for r in _reasons(CFG))


def test_explicit_choice_fails_listing_reasons():
    with pytest.raises(NoBackendError) as info:
        backends.resolve(CFG.replace(head_dim=96), "llvm", "flashinfer", ops=[ops.ATTN_DECODE_PAGED])
    assert "flashinfer: FlashInfer modules are CUDA code" in str(info.value)
    with pytest.raises(NoBackendError) as info:
        backends.resolve(CFG.replace(dtype="float32"), SM90, "flashinfer", ops=[ops.ATTN_DECODE_PAGED])
    assert "dtype_q 'float32' not supported" in str(info.value)


@needs_jit
def test_automatic_selection_prefers_flashinfer_on_cuda():
    res = backends.resolve(CFG, SM90)
    assert all(res.choice[op] == "flashinfer" for op in MHA_OPS)
    assert all(tag == "tir" for op, tag in res.choice.items() if op not in MHA_OPS)
    assert "attn_decode_paged=flashinfer" in res.report()
    res = backends.resolve(MLA, SM90)
    assert all(res.choice[op] == "flashinfer" for op in MLA_OPS)
    assert all(tag == "tir" for op, tag in res.choice.items() if op not in MLA_OPS)
    # a per-op choice
    res = backends.resolve(CFG, SM90, {ops.ATTN_DECODE_PAGED: ["flashinfer", "tir"], "*": "tir"})
    assert res.choice[ops.ATTN_DECODE_PAGED] == "flashinfer"
    assert all(tag == "tir" for op, tag in res.choice.items() if op != ops.ATTN_DECODE_PAGED)
    # where it cannot serve, the next backend does and the reason is kept
    res = backends.resolve(CFG.replace(head_dim=96), SM90)
    assert res.choice[ops.ATTN_DECODE_PAGED] == "tir"
    assert any("head dim 96" in r for r in res.reasons[ops.ATTN_DECODE_PAGED]["flashinfer"])
    # on the CPU nothing changes
    assert set(backends.resolve(CFG, "llvm").choice.values()) == {"tir"}
    # bfloat16 as float16 (validation only: nothing is built here)
    for cfg, fi_ops in ((CFG, MHA_OPS), (MLA, MLA_OPS)):
        res = backends.resolve(cfg.replace(dtype="bfloat16"), SM90)
        assert {op: res.choice[op] for op in fi_ops} == {op: "flashinfer" for op in fi_ops}, res.report()
        assert all(tag == "tir" for op, tag in res.choice.items() if op not in fi_ops)


@needs_jit
@pytest.mark.slow
def test_kernel_library_links_flashinfer_objects(tmp_path):
    from pagedkv.cache import build_kernel_library
    from pagedkv.cuda_build import has_device_code

    # only the decode module (CI builds no other FlashInfer module); one dtype: the link is the same for both
    # (test_flashinfer_build builds both dtypes' modules), and each library costs a CUDA compile of the TIR ops
    dtype = "bfloat16"
    backend = {ops.ATTN_DECODE_PAGED: ["flashinfer", "tir"], "*": "tir"}
    # the TIR ops on their CUDA-core kernels: the link is what is checked, and the tensor-core prefill tiles' and the
    # tc decode's (its partial-state op is TIR's) nvcc builds (their own modules) would cost most of this test's time
    with fib.forced_modules({ops.ATTN_DECODE_PAGED: "decode"}), \
            forced_paths({"cuda_prefill_kernel": "simt", "cuda_decode_kernel": "lanes"}):
        lib = build_kernel_library(CFG.replace(dtype=dtype), tmp_path, target=SM90, backend=backend)
    entries = {op: (tag, names, opts)
               for op, tag, names, opts in json.loads(lib.with_suffix(".json").read_text())["entries"]}
    tag, names, opts = entries[ops.ATTN_DECODE_PAGED]
    # head [adapter kind, module kind]; functions [empty_rows, plan, run]
    assert tag == "flashinfer" and opts == ["adapter=flashinfer", "decode"] and names[0] == "pagedkv_empty_rows"
    assert len(names) == 3 and names[1].endswith("_plan") and names[2].endswith("_run")
    assert all(t == "tir" for op, (t, _, _) in entries.items() if op != ops.ATTN_DECODE_PAGED)
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                              check=True).stdout
    for name in names[1:]:
        assert f"__tvm_ffi_{name}" in exported
    assert "__tvm_ffi_pagedkv_empty_rows" in exported
    assert has_device_code(lib)  # the TIR kernels' fatbins are in the same file


@needs_jit
@pytest.mark.slow
@pytest.mark.skipif(__import__("os").environ.get("PAGEDKV_FLASHINFER_ALL") != "1",
                    reason="compiles a CUDA model (minutes): set PAGEDKV_FLASHINFER_ALL=1")
def test_model_library_holds_flashinfer_module(tmp_path):
    """A Llama model for sm_90 with backends ("flashinfer", "tir"): one library file with the model's fatbins
    and the FlashInfer decode module's exports (measured: 78 s, 1.27 MB with the module cached)."""
    import tvm

    from pagedkv.compile import build_library
    from pagedkv.cuda_build import has_device_code
    from pagedkv.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=384, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=128, rope_theta=10000.0)
    target = tvm.target.Target(SM90, host="llvm")
    model = LlamaForCausalLM(cfg, dtype="float16", target=target, backend=["flashinfer", "tir"])
    path, _ = build_library(model, target, tmp_path / "model.so")
    assert has_device_code(path)
    exported = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True,
                              check=True).stdout
    names = {line.split()[-1] for line in exported.splitlines() if "pagedkv_fi_decode_" in line}
    assert {n.rsplit("_", 1)[-1] for n in names} >= {"plan", "run"}
