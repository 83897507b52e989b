"""Forced code paths of the CUDA kernels (``pagedkv.kernel_spec.SWITCHES``, switches ``cuda_*``) on the build host: no GPU.

- "auto" has no forced code: a decode factory without the switch, with ``decode_splits=0`` and through
  ``KernelSpec(paths={...: "auto"})`` give the same ``script()``; a forced split count changes only the
  host-side split expression of the decode kernels (to the documented clamp), and no other kernel.
- Forced split counts compile with ``nvcc --cubin -arch=sm_90a`` without register spills, at shapes of
  ``test_cuda_compile.py`` / ``test_mla_cuda_compile.py`` (the benchmark shape, the float32 group-1 shape with
  both masking options, DeepSeek's latent): one module per shape, one nvcc job each. Since a forced count
  changes only the split-count line (checked above for every value), nvcc sees a covering set: S = 1 (the
  merge folded away) and S = 8 (with the merge) of the default kernel, and S = 2 of the lane-group kernel
  (MHA, ``cuda_decode_kernel=lanes``).

The numerical check of every forced path needs a GPU (``tests/gpu/test_cuda_paths_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pathlib
import re

import pytest
from _cuda_support import cuda_source_of, nvcc_all, ptxas_usage

ROOT = pathlib.Path(__file__).resolve().parents[2]
from pagedkv import tir_kernels as tk  # noqa: E402

import tvm
from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)
SWITCH = "cuda_decode_splits"
FORCED = [v for v in tk.SWITCHES[SWITCH][1] if v != "auto"]


def _mla(h, rank, rope, dtype):
    return tk.KernelSpec(h, h, rank + rope, rank, dtype, kv_lora_rank=rank, qk_rope_head_dim=rope)


#: name -> KernelSpec (shapes of the existing CUDA compile tests). nvcc runs on the first three (each forced
#: value of a shape in one module); the small MLA shape serves the script checks only.
SHAPES = {
    "32x8x128-f16": tk.KernelSpec(32, 8, 128, 128, "float16"),
    "4x4x64-f32-w100-cap50": tk.KernelSpec(4, 4, 64, 64, "float32", sliding_window=100, logits_soft_cap=50.0),
    "mla-16x512x64-f16": _mla(16, 512, 64, "float16"),
    "mla-3x64x32-f32": _mla(3, 64, 32, "float32"),
}
NVCC_SHAPES = list(SHAPES)[:3]


def _decode_op(cfg) -> str:
    return "mla_attn_decode_paged" if cfg.is_mla else "attn_decode_paged"


def _script(cfg, op: str) -> str:
    return tk.FACTORIES[op](cfg, SM80).script()


def _forced(cfg, value: str):
    return dataclasses.replace(cfg, paths={SWITCH: value})


def test_switch_is_registered():
    assert tk.SWITCHES[SWITCH][1][0] == "auto" and {"1", "2", "8"} <= set(FORCED)
    assert tk.KernelSpec(4, 4, 64, paths={SWITCH: "auto"}).paths == ()
    with pytest.raises(ValueError, match=SWITCH):
        tk.KernelSpec(4, 4, 64, paths={SWITCH: "0"})


@pytest.mark.parametrize("name", ["4x4x64-f32-w100-cap50", "mla-3x64x32-f32"])
def test_auto_has_no_forced_code(name):
    """Auto = the kernel without the switch; each forced value changes only the decode's split count line."""
    cfg = SHAPES[name]
    op = _decode_op(cfg)
    spec_factory = (importlib.import_module(f"{tk.__name__}.mla_cuda").mla_attn_decode_paged_cuda if cfg.is_mla
                    else tk.attention_cuda.attn_decode_paged_cuda)

    def factory(decode_splits: int = 0):  # the factories take the spec: decode_splits 0 is the "auto" path
        return spec_factory(_forced(cfg, str(decode_splits) if decode_splits else "auto"))

    args, kwargs = (), {}
    with tk._common.fast_macro_expansion():  # as the factories' dispatch
        default = factory(*args, **kwargs).script()
        assert factory(*args, **kwargs, decode_splits=0).script() == default
    assert _script(_forced(cfg, "auto"), op) == default
    for value in FORCED:
        forced = _script(_forced(cfg, value), op)
        changed = [(a, b) for a, b in zip(default.splitlines(), forced.splitlines()) if a != b]
        assert len(default.splitlines()) == len(forced.splitlines()), changed
        rule = f"T.max(1, T.min({value}, nnz * ps))"
        if cfg.is_mla:
            assert [b.strip() for _a, b in changed] == [f"S: T.let[T.int32] = {rule}"], changed
        else:  # a forced count keeps each entry's equal ranges under auto ranges (chunk_split)
            assert [b.strip() for _a, b in changed] == [f"S0: T.let[T.int32] = {rule}", "S: T.let[T.int32] = S0",
                                                        "C: T.let[T.int32] = 0"], changed


def test_split_ranges_switch_changes_only_the_launch_shape():
    """``cuda_decode_split_ranges``: entry and chunk change only the lines of ``S`` (the ranges an entry) and
    ``C`` (the range length; 0 under entry) of the MHA decode; auto (the switch left alone) is the default."""
    cfg = SHAPES["4x4x64-f32-w100-cap50"]
    default = _script(cfg, "attn_decode_paged")
    switch = "cuda_decode_split_ranges"
    assert tk.SWITCHES[switch][1] == ("auto", "entry", "chunk")
    assert _script(dataclasses.replace(cfg, paths={switch: "auto"}), "attn_decode_paged") == default
    for value in ("entry", "chunk"):
        forced = _script(dataclasses.replace(cfg, paths={switch: value}), "attn_decode_paged")
        changed = [(a.strip(), b.strip()) for a, b in zip(default.splitlines(), forced.splitlines()) if a != b]
        assert len(default.splitlines()) == len(forced.splitlines()), changed
        assert [b.split(":")[0] for _a, b in changed] == ["S", "C"], changed
        if value == "entry":
            assert [b for _a, b in changed] == ["S: T.let[T.int32] = S0", "C: T.let[T.int32] = 0"]


@pytest.mark.parametrize("op", ["attn_prefill_paged", "attn_prefill_ragged", "merge_state", "split_rotary"])
def test_forced_splits_leave_other_kernels_alone(op):
    cfg = SHAPES["4x4x64-f32-w100-cap50"]
    assert _script(_forced(cfg, "8"), op) == _script(cfg, op)


def test_forced_splits_leave_mla_prefill_alone():
    cfg = SHAPES["mla-3x64x32-f32"]
    assert _script(_forced(cfg, "3"), "mla_attn_prefill_paged") == _script(cfg, "mla_attn_prefill_paged")


def _variants(cfg) -> dict:
    """symbol suffix -> forced paths nvcc compiles: split counts 1 and 8, and (MHA) 2 with the lane-group
    kernel (the other counts differ from these by the split-count line only: ``test_auto_has_no_forced_code``)."""
    assert {"1", "2", "8"} <= set(FORCED)
    out = {f"s{v}": {SWITCH: v} for v in ("1", "8")}
    if not cfg.is_mla:
        out["lanes_s2"] = {SWITCH: "2", "cuda_decode_kernel": "lanes"}
    return out


@functools.cache
def forced_source(name: str) -> str:
    """CUDA source of one module holding ``name``'s decode kernel once per forced variant (``..._<suffix>``,
    ``_variants``)."""
    cfg = SHAPES[name]
    op = _decode_op(cfg)
    funcs = {f"pagedkv_{op}_{k}": tk.FACTORIES[op](dataclasses.replace(cfg, paths=paths), SM80).with_attr(
        "global_symbol", f"pagedkv_{op}_{k}") for k, paths in _variants(cfg).items()}
    with SM80:
        exe = tvm.compile(tvm.IRModule(funcs), target=SM80)
    return cuda_source_of(exe)


@pytest.fixture(scope="module")
def nvcc_forced_results(tmp_path_factory):
    """nvcc on every ``SHAPES`` module, in parallel: ``{name: (returncode, log)}``."""
    return nvcc_all(NVCC_SHAPES, forced_source, tmp_path_factory.mktemp("cuda_paths"), "paths_")


#: shape -> spill bytes (stores and loads) allowed in its staged inline-RoPE decode kernels (the first kernel of
#: each staged variant; default 0): in float32 with a soft cap ptxas stops them at 96 registers and spills one
#: (CUDA 13). float32 decode has no speed target; fp16 / bf16 spill nothing. (test_cuda_compile.KNOWN_SPILLS)
ROPE_SPILLS = {"4x4x64-f32-w100-cap50": 4}


@pytest.mark.parametrize("name", NVCC_SHAPES)
def test_forced_decode_nvcc_no_spills(name, nvcc_forced_results):
    cfg = SHAPES[name]
    op = _decode_op(cfg)
    rc, log = nvcc_forced_results[name]
    assert rc == 0, f"nvcc failed for {name}:\n{log[-4000:]}"
    usage = ptxas_usage(log)
    print("\n".join(f"{k}: {regs} registers, spill stores/loads {st}/{ld} bytes"
                    for k, (regs, st, ld) in sorted(usage.items())))
    for suffix in _variants(cfg):
        kernels = [k for k in usage if re.fullmatch(rf"pagedkv_{op}_{suffix}_kernel(_\d+)?", k)]
        # the attention kernels (MHA: inline RoPE and plain), then the split merge (folded away when S = 1)
        assert len(kernels) >= (1 if cfg.is_mla else 2), (suffix, sorted(usage))
    rope = {f"pagedkv_{op}_{suffix}_kernel" for suffix in _variants(cfg) if not suffix.startswith("lanes")}
    spills = {k: u for k, u in usage.items() if max(u[1], u[2]) > (ROPE_SPILLS.get(name, 0) if k in rope else 0)}
    assert not spills, f"register spills (registers, store, load bytes): {spills}"
