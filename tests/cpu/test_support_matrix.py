"""``pagedkv backends``: the support matrix per op and backend, with the reasons and the automatic choice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagedkv import ops
from pagedkv.config import KVCacheConfig
from pagedkv.support import dtype_support, support_matrix

CUDA = '{"kind":"cuda","arch":"sm_90"}'


def test_cli_prints_every_op_with_the_automatic_choice():
    exe = Path(sys.executable).parent / "pagedkv"  # the console script `make install` puts beside python
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "pagedkv"]
    out = subprocess.run(cmd + ["backends", "--target", CUDA, "--attention-sinks"], capture_output=True, text=True,
                         check=True).stdout
    for op in ops.OPS_BY_KIND["mha"]:  # every MHA op: the sink ops too (--attention-sinks)
        assert f"{op}: automatic selection -> " in out
    assert "serves (TIR cuda kernel pagedkv_attn_decode_paged: tc" in out  # the selection table's variant
    # FlashInfer either serves (with its module kind) or says why not (e.g. flashinfer-python missing)
    assert "flashinfer   serves (module decode)" in out or "flashinfer   cannot:" in out


def test_cpu_target_reasons_and_json():
    cfg = KVCacheConfig(num_layers=1, num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype="float32")
    cells, auto = support_matrix(cfg, "llvm")
    assert set(auto.values()) == {"tir"}
    fi = [c for c in cells if c.backend == "flashinfer" and c.op == ops.ATTN_DECODE_PAGED]
    assert fi and not fi[0].served and "CUDA code" in fi[0].reasons[0]
    out = subprocess.run([sys.executable, "-m", "pagedkv", "backends", "--target", "llvm", "--num-qo-heads", "8",
                          "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "float32", "--json"],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert data["auto"] == auto and len(data["cells"]) == len(cells)


def test_mla_matrix_and_a_config_no_backend_serves():
    mla = KVCacheConfig.mla(num_layers=1, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128)
    cells, auto = support_matrix(mla, {"kind": "cuda", "arch": "sm_90"})
    assert set(auto) == set(ops.OPS_BY_KIND["mla"]) - set(ops.SINK_OPS)
    odd = KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=4, head_dim=24, dtype="float16")
    _, auto = support_matrix(odd, {"kind": "cuda", "arch": "sm_90"})
    assert auto[ops.ATTN_DECODE_PAGED] is None  # head_dim % 16 != 0: no CUDA backend, said, not hidden
    bad = subprocess.run([sys.executable, "-m", "pagedkv", "backends", "--num-qo-heads", "3", "--num-kv-heads", "2"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "num_qo_heads" in bad.stderr


def test_bfloat16_support_is_shown():
    """TIR serves bf16 on both targets; FlashInfer (CUDA) serves fp16 and bf16 or says why not; the CLI lists
    the dtypes and a bf16 config's matrix."""
    cfg = KVCacheConfig(num_layers=1, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype="float16")
    assert dtype_support(cfg, "llvm")["tir"] == ["float16", "float32", "bfloat16"]
    cuda = dtype_support(cfg, {"kind": "cuda", "arch": "sm_90"})
    assert cuda["tir"] == ["float16", "float32", "bfloat16"]
    assert cuda["flashinfer"] in (["float16", "bfloat16"], [])  # [] without a FlashInfer JIT build
    out = subprocess.run([sys.executable, "-m", "pagedkv", "backends", "--target", CUDA, "--dtype", "bfloat16"],
                         capture_output=True, text=True, check=True).stdout
    assert "dtypes served (some op of this config): " in out and "tir float16, float32, bfloat16" in out
    assert '"dtype": "bfloat16"' in out
    assert "serves (TIR cuda kernel pagedkv_split_rotary)" in out
    assert "flashinfer   serves (module decode)" in out or "flashinfer   cannot:" in out
