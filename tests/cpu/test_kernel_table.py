"""The kernel-selection table (``pagedkv.kernel_table``, issue 43 item 2): one table per op chooses, the docs
table is generated from it, ``pagedkv backends`` prints its choice, forcing stays possible and a forced variant
that does not serve raises."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import pagedkv
from pagedkv import kernel_table as kt
from pagedkv import ops
from pagedkv.backends import get_backend
from pagedkv.kernel_spec import SWITCHES, KernelSpec

_REPO = Path(__file__).resolve().parents[2]
MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def _spec(hq=32, hkv=8, d=128, dtype="float16", arch="sm_90a", paths=(), **kw):
    return KernelSpec(hq, hkv, d, dtype=dtype, paths=paths, target_arch=arch, **kw)


def _mla(heads=128, dtype="bfloat16", arch="sm_90a", paths=()):
    return KernelSpec(heads, heads, 192, v_head_dim=128, dtype=dtype, paths=paths, target_arch=arch, **MLA)


def test_docs_table_is_generated():
    doc = (_REPO / "docs" / "ARCHITECTURE.md").read_text()
    assert kt.with_table(doc) == doc, ("docs/ARCHITECTURE.md's kernel table is stale: run "
                                       "`python -m pagedkv.kernel_table --write docs/ARCHITECTURE.md`")


def test_switch_values_are_the_table_rows():
    """Every variant value of a kernel switch has a row, and every row a switch value (no orphan)."""
    for switch, rows in kt.TABLE.items():
        assert set(SWITCHES[switch][1]) - {"auto"} == {v.name for v in rows}, switch
    assert set(kt.SWITCH_OF_OP) <= set(ops.ATTENTION_OPS)


@pytest.mark.parametrize("op,spec,want", [
    (ops.ATTN_PREFILL_RAGGED, _spec(), "wg1t"),
    (ops.ATTN_PREFILL_PAGED, _spec(), "wg2t"),
    (ops.ATTN_PREFILL_RAGGED, _spec(d=64), "tc3"),          # wg1t takes head dim 128 only
    (ops.ATTN_PREFILL_PAGED, _spec(arch="sm_80"), "tc2"),   # no wgmma before Hopper
    (ops.ATTN_PREFILL_RAGGED, _spec(dtype="float32"), "simt"),
    (ops.ATTN_DECODE_PAGED, _spec(), "tc"),
    (ops.ATTN_DECODE_PAGED, _spec(hq=56, hkv=2), "staged"),  # group 28 > the tensor-core decode's 16
    (ops.ATTN_DECODE_PAGED, _spec(d=96, dtype="float32"), "staged"),
    (ops.MLA_ATTN_DECODE_PAGED, _mla(), "wgq"),
    (ops.MLA_ATTN_DECODE_PAGED, _mla(heads=8), "tc"),        # wgq from 16 heads
    (ops.MLA_ATTN_PREFILL_PAGED, _mla(arch="sm_80"), "tc"),
    (ops.MLA_ATTN_PREFILL_PAGED, _mla(dtype="float32"), "simt"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_auto_choices(op, spec, want):
    choice = kt.choose(op, spec)
    assert choice.name == want and not choice.forced
    ranked = [v.name for v in kt.auto_order(op)]
    assert [v.name for v, _ in choice.skipped] == ranked[:ranked.index(want)]  # each faster one, with reasons
    assert all(why for _, why in choice.skipped)


def test_sm90_and_sm90a_take_the_same_kernels():
    """The canonical arch reaches the factories: a Target spelled sm_90 builds the Hopper kernels."""
    from pagedkv import tir_kernels as tk

    spec = _spec(arch="")
    for spelling in ({"kind": "cuda", "arch": "sm_90"}, {"kind": "cuda", "arch": "sm_90a"}, "nvidia/nvidia-h100"):
        seen = {}
        real = tk.FAMILIES["cuda"].FACTORIES[ops.ATTN_PREFILL_PAGED]
        tk.FAMILIES["cuda"].FACTORIES[ops.ATTN_PREFILL_PAGED] = lambda s: seen.setdefault("arch", s.target_arch)
        try:
            tk.make(ops.ATTN_PREFILL_PAGED, spec, spelling)
        finally:
            tk.FAMILIES["cuda"].FACTORIES[ops.ATTN_PREFILL_PAGED] = real
        assert seen["arch"] == "sm_90a", spelling


def test_forced_variant_is_taken_or_raises_with_reasons():
    # tc2: a row auto never takes for this op ("forced only"), and wg1t would serve the spec
    forced = kt.choose(ops.ATTN_PREFILL_RAGGED, _spec(paths={"cuda_prefill_kernel": "tc2"}))
    assert forced.name == "tc2" and forced.forced
    with pytest.raises(NotImplementedError, match="cuda_prefill_kernel=wg1t.*head dims 64/64"):
        kt.choose(ops.ATTN_PREFILL_RAGGED, _spec(d=64, paths={"cuda_prefill_kernel": "wg1t"}))
    with pytest.raises(NotImplementedError, match="target arch sm_80"):
        kt.choose(ops.MLA_ATTN_DECODE_PAGED, _mla(arch="sm_80", paths={"cuda_mla_decode_kernel": "wgq"}))
    # forced below auto's head-count bar: served (the bar is auto's, not the kernel's)
    assert kt.choose(ops.MLA_ATTN_DECODE_PAGED, _mla(heads=8, paths={"cuda_mla_decode_kernel": "wgq"})).name == "wgq"


def test_inline_rope_decode_has_its_own_limits():
    spec = _spec(hq=8, hkv=1, d=256, dtype="float32")  # staged's RoPE tables do not fit at group 8 x D 256
    assert kt.choose(ops.ATTN_DECODE_PAGED, spec).name == "staged"
    rope = kt.choose(ops.ATTN_DECODE_PAGED, spec, rope=True)
    assert rope.name == "lanes" and "staged" in [v.name for v, _ in rope.skipped]


def test_backends_cli_names_the_variant(capsys):
    cfg = pagedkv.KVCacheConfig(num_layers=1, num_qo_heads=32, num_kv_heads=8, head_dim=64, dtype="float16",
                                max_batch_size=2, max_total_seq_len=256, prefill_chunk_size=64)
    text = get_backend("tir").describe(ops.ATTN_PREFILL_RAGGED, cfg, "cuda -arch=sm_90a")
    assert "tc3" in text and "not taken: wg1t: head dims 64/64" in text
    assert get_backend("tir").describe(ops.ATTN_PREFILL_RAGGED, cfg, "llvm") == \
        "TIR llvm kernel pagedkv_attn_prefill_ragged"
    from pagedkv.support import main

    main(["--target", "nvidia/nvidia-h100", "--num-qo-heads", "32", "--num-kv-heads", "8"])
    out = capsys.readouterr().out
    assert "pagedkv_attn_prefill_ragged: wg1t" in out and "pagedkv_attn_decode_paged: tc" in out


def test_every_variant_row_is_well_formed():
    for rows in kt.TABLE.values():
        names = [v.name for v in rows]
        assert len(names) == len(set(names))
        for v in rows:
            assert v.arch in (kt.HOPPER, "sm_80+", "any") and v.what and v.priority
            assert dataclasses.is_dataclass(v)
