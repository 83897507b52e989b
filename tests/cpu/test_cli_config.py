"""Small traps of the first use: ``KVCacheConfig.from_json`` (the inverse of ``to_json``, strict about keys and
schema), ``pagedkv --version``, ``pagedkv backends`` exiting non-zero when an op has no backend, and options
``pagedkv backends`` cannot honor for the cache kind refused instead of replaced. Nothing here compiles."""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import pytest

from pagedkv import KVCacheConfig
from pagedkv.__main__ import main as pagedkv_main
from pagedkv.support import main as backends_cli

_REPO = Path(__file__).resolve().parents[2]
SM90 = '{"kind": "cuda", "arch": "sm_90"}'


# -- KVCacheConfig.from_json ------------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [
    dict(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64),
    dict(num_layers=3, num_qo_heads=4, num_kv_heads=4, head_dim=32, dtype="bfloat16", rope_mode="inline",
         rope_theta=5e5, rope_scale=0.25, page_size=8, max_batch_size=3, max_total_seq_len=100,
         prefill_chunk_size=40, sliding_window=16, logits_soft_cap=30.0, cuda_graph_batch=4),
    dict(num_layers=2, num_qo_heads=4, num_kv_heads=4, head_dim=64, v_head_dim=48, rope_mode="none",
         layer_kinds=("mla", "mla"), kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32),
], ids=["mha", "options", "mla"])
def test_from_json_inverts_to_json(fields):
    cfg = KVCacheConfig(**fields)
    back = KVCacheConfig.from_json(cfg.to_json())
    assert back == cfg and back.to_json() == cfg.to_json()
    assert KVCacheConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_from_json_fills_runtime_fields_and_defaults():
    cfg = KVCacheConfig(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=8)
    text = cfg.to_json(runtime_fields=("page_size",))
    assert KVCacheConfig.from_json(text, runtime_values={"page_size": 8}) == cfg
    with pytest.raises(ValueError, match=r"leaves \['page_size'\] to run time.*missing \['page_size'\]"):
        KVCacheConfig.from_json(text)
    # a hand-written config names what it changes; the rest are the constructor's defaults
    assert KVCacheConfig.from_json('{"num_layers": 2, "num_qo_heads": 8, "num_kv_heads": 2, "head_dim": 64, '
                                   '"page_size": 8}') == cfg


@pytest.mark.parametrize("data,error,pattern", [
    ({"num_layers": 1, "num_qo_heads": 1, "num_kv_heads": 1, "head_dim": 2, "num_kv_head": 1}, ValueError,
     r"unknown KVCacheConfig keys \['num_kv_head'\]"),
    ({"schema_version": 8, "num_layers": 1, "num_qo_heads": 1, "num_kv_heads": 1, "head_dim": 2}, ValueError,
     r"schema_version 8 is newer than this pagedkv reads \(up to 7\)"),
    ({"schema_version": 2, "num_layers": 1, "num_qo_heads": 1, "num_kv_heads": 1, "head_dim": 2,
      "sliding_window": 4}, ValueError, r"\['sliding_window'\] need schema_version >= 3"),
    ({"num_layers": 1, "num_qo_heads": 1, "num_kv_heads": 1, "head_dim": 2, "rope_theta": "1e4"}, TypeError,
     "rope_theta must be a number"),
    ({"num_layers": 0, "num_qo_heads": 1, "num_kv_heads": 1, "head_dim": 2}, ValueError,
     "num_layers must be a positive int"),
    ([1, 2], TypeError, "takes a mapping"),
], ids=["unknown-key", "newer-schema", "key-of-later-schema", "float-type", "invalid", "not-a-dict"])
def test_from_json_rejects_what_it_cannot_read(data, error, pattern):
    with pytest.raises(error, match=pattern):
        KVCacheConfig.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="not JSON"):
        KVCacheConfig.from_json("{num_layers: 1}")


# -- the command line ------------------------------------------------------------------------------------
def test_version_names_pagedkv_and_what_it_runs_on(capsys):
    assert pagedkv_main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    own = re.search(r'^version = "(.+)"$', (_REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert out.startswith(f"pagedkv {own} (")
    for name, dist in (("tvm", "apache-tvm"), ("tvm-ffi", "apache-tvm-ffi"), ("flashinfer", "flashinfer-python")):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "not installed"
        assert f"{name} {version}" in out, out


def test_backends_exits_nonzero_when_an_op_has_no_backend(capsys):
    # head dim 24: no CUDA attention kernel takes it (TIR needs % 16, FlashInfer 64/128/256)
    assert backends_cli(["--target", SM90, "--num-qo-heads", "4", "--num-kv-heads", "4", "--head-dim", "24"]) == 1
    err = capsys.readouterr().err
    assert "attn_prefill_ragged, attn_prefill_paged, attn_decode_paged" in err
    assert backends_cli(["--target", "llvm", "--num-qo-heads", "4", "--num-kv-heads", "4", "--head-dim", "24",
                         "--json"]) == 0  # the CPU kernels take it


#: Options that do not fit the cache kind, and the config's reason each is refused with.
REFUSED = [
    (["--kv-lora-rank", "512", "--num-kv-heads", "1"], "MLA num_kv_heads (1) must equal num_qo_heads (32)"),
    (["--kv-lora-rank", "512", "--head-dim", "128"], "MLA head_dim (128) must be qk_nope_head_dim"),
    (["--kv-lora-rank", "512", "--rope-mode", "normal"], "MLA needs rope_mode 'none'"),
    (["--kv-lora-rank", "512", "--sliding-window", "64"], "MLA caches take no sliding_window"),
    (["--qk-rope-head-dim", "32"], "qk_rope_head_dim need MLA layers"),
]


def test_backends_honors_mla_options_or_refuses_them(capsys):
    for argv, fragment in REFUSED:
        with pytest.raises(SystemExit) as info:
            backends_cli(argv)
        assert info.value.code == 2 and fragment in capsys.readouterr().err, argv
    # options that fit are taken as given
    assert backends_cli(["--kv-lora-rank", "512", "--num-qo-heads", "16", "--num-kv-heads", "16", "--head-dim",
                         "192", "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["num_qo_heads"], config["num_kv_heads"], config["head_dim"]) == (16, 16, 192)
    assert (config["kv_lora_rank"], config["qk_nope_head_dim"], config["qk_rope_head_dim"]) == (512, 128, 64)
