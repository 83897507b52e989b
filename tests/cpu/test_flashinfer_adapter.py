"""The runtime's "flashinfer" adapters (src/flashinfer_adapter.cc) on the CPU, with stand-in plan/run functions
(``_flashinfer_standin``) that check the pinned 0.7.4 argument lists and compute attention from the tensors
as FlashInfer's kernels read them, writing FlashInfer's empty state (lse = -inf). The real TIR
``pagedkv_empty_rows`` helper turns that into pagedkv's (o = 0, lse = -1e30).

- plan once per forward and pass (begin_forward), run per layer with that pass's plan info;
- ragged: one causal plan per prefill forward; a decode forward's self_attention (no keys) never reaches
  FlashInfer;
- the scenario suite, fine-grained (self/cross/merge, empty rows checked), through the adapters for MHA
  (fa2 and fa3 argument lists) and MLA, against the PyTorch reference, in float32 and (a subset) bfloat16;
- every tensor FlashInfer gets has byte_offset 0 (its bindings ignore byte_offset) and strides (read unchecked);
- the MLA plan's staged metadata reaches the device int workspace;
- learnable sinks merged by TIR's sink ops into the states FlashInfer's ops return, MHA and MLA.
Numerics of FlashInfer itself need the GPU (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from _flashinfer_standin import FakeFlashInfer
from pagedkv import KVCacheConfig, ops
from pagedkv._lib import get_global
from pagedkv.cache import KVCache, _compile_op_table, _to_ffi
from pagedkv.flashinfer import abi
from pagedkv.testing.scenarios import SCENARIOS, ScenarioRunner, clear, random_sm_scale

MHA_CFG = KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
                        page_size=4, max_batch_size=4, max_total_seq_len=96, prefill_chunk_size=32,
                        rope_scale=2.0, rope_theta=5000.0)
MLA_CFG = KVCacheConfig.mla(num_layers=2, num_heads=3, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                            v_head_dim=16, dtype="float32", page_size=4, max_batch_size=4, max_total_seq_len=96,
                            prefill_chunk_size=32)
# the scenario suite's capacity (pagedkv.testing.shapes)
SCENARIO_CAPACITY = dict(page_size=8, max_batch_size=8, max_total_seq_len=128, prefill_chunk_size=64)
MHA_FI_OPS = ("attn_decode_paged", "attn_prefill_ragged", "attn_prefill_paged")
MLA_FI_OPS = ("mla_attn_decode_paged", "mla_attn_prefill_paged")


def _empty_rows(dtype: str):
    """The TIR ``pagedkv_empty_rows`` helper for ``dtype`` compiled for the CPU: (library, function)."""
    import tvm

    from pagedkv.tir_kernels import host_target, make_empty_rows

    lib = tvm.compile(tvm.IRModule({"pagedkv_empty_rows": make_empty_rows(dtype, host_target())}),
                      target=host_target())
    return lib, lib["pagedkv_empty_rows"]


@pytest.fixture(scope="module")
def empty_rows():
    return _empty_rows("float32")


@pytest.fixture(scope="module")
def empty_rows_bf16():
    return _empty_rows("bfloat16")


def make_cache(cfg, empty_rows, kinds: dict[str, str], *, partial: bool = False):
    """A CPU cache whose ops in ``kinds`` (op -> module kind) run through the flashinfer adapter. Without
    ``partial`` its table leaves out the partial-state ops (as a library compiled before them), so every pass of a
    multi-pass forward runs through the adapters too; with them (fp16 / bf16: what automatic selection builds, TIR
    serving them) such forwards run on TIR's float32 partial states."""
    from pagedkv import ops as O

    # TIR compiles the other ops only (the attention kernels are most of a library's compile time)
    tir_ops = tuple(op for op in O.ops_for(cfg) if (partial or op not in O.PARTIAL_OPS) and op not in kinds)
    module, table = _compile_op_table(cfg, "llvm", tuple((op, "tir") for op in tir_ops))
    # the config's attention options in FlashInfer's terms: every plan and run must be given exactly these
    fake = FakeFlashInfer(window_left=cfg.sliding_window - 1 if cfg.sliding_window else -1,
                          soft_cap=cfg.logits_soft_cap, cuda_graph=bool(cfg.cuda_graph_batch))
    table = table + [fake.entry(op, kind, empty_rows[1]) for op, kind in kinds.items()]
    ref = torch.empty((1,), dtype=torch.float32)
    handle = get_global("pagedkv.create")(cfg.to_json(), (), table, _to_ffi(ref))
    cache = KVCache(handle, cfg, torch.device("cpu"), None, keepalive=(module, empty_rows[0]))
    get_global("pagedkv.debug_poison_pages")(handle, True)
    for op in kinds:
        assert cache.op_backends[op] == "flashinfer"
    return cache, fake


def _step(cache, cfg, ids, lengths, sm_scale):
    cache.begin_forward(ids, lengths)
    n = sum(lengths)
    for layer in range(cfg.num_layers):
        qkv = torch.randn(n, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        cache.attention_with_fused_qkv(layer, qkv, sm_scale)
    cache.end_forward()


def _prefill_each(cache, cfg, lengths: dict[int, int]) -> None:
    """Adds each sequence and prefills it with its own forward of ``lengths[seq]`` tokens."""
    for seq, n in lengths.items():
        cache.add_sequence(seq)
        _step(cache, cfg, [seq], [n], 0.25)


MHA_KINDS = {
    "fa2": {"attn_decode_paged": "decode", "attn_prefill_ragged": "prefill_fa2", "attn_prefill_paged": "prefill_fa2"},
    "fa3": {"attn_decode_paged": "decode", "attn_prefill_ragged": "prefill_fa3", "attn_prefill_paged": "prefill_fa3"},
    # tensor-core decode: attn_decode_paged on the paged prefill kernel
    "tc-fa2": {"attn_decode_paged": "prefill_fa2", "attn_prefill_ragged": "prefill_fa3",
               "attn_prefill_paged": "prefill_fa3"},
    "tc-fa3": {"attn_decode_paged": "prefill_fa3", "attn_prefill_ragged": "prefill_fa2",
               "attn_prefill_paged": "prefill_fa2"},
    # both decode kernels, chosen per forward by the lengths' skew
    "choose": {"attn_decode_paged": "decode|prefill_fa2", "attn_prefill_ragged": "prefill_fa3",
               "attn_prefill_paged": "prefill_fa3"},
}
MLA_KINDS = ("mla", "mla_fa3")


def test_plan_per_forward_and_pass_run_per_layer(empty_rows):
    cfg = MHA_CFG
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS["fa2"])
    cache.add_sequence(0)
    _step(cache, cfg, [0], [6], 0.25)  # prefill of a fresh sequence: ragged only (its paged pass is empty)
    assert fake.count("prefill_fa2.plan") == 1 and fake.count("prefill_fa2.ragged_run") == cfg.num_layers
    assert fake.count("prefill_fa2.paged_run") == 0 and fake.count("decode.plan") == 0
    cache.add_sequence(1)
    _step(cache, cfg, [1], [3], 0.25)
    fake.calls.clear()
    for step in range(2):
        _step(cache, cfg, [0, 1], [1, 1], 0.125)  # decode: one pass, two entries
    assert fake.count("decode.plan") == 2, "plan once per forward, not per layer"
    assert fake.count("decode.run") == 2 * cfg.num_layers
    assert fake.count("prefill_fa2.plan") == 0, "a decode forward plans no ragged call"
    plans = [c for n, c in fake.calls if n == "decode.plan"]
    # page_indptr per step: 7 and 4 tokens at page size 4 are 2 + 1 pages, then 8 and 5 tokens 2 + 2
    for named, indptr in zip(plans, ([0, 2, 3], [0, 2, 4])):
        assert named["batch_size"] == 2 and named["indptr"] == indptr
        assert (named["num_qo_heads"], named["num_kv_heads"], named["page_size"]) == (4, 2, 4)
        assert (named["head_dim_qk"], named["head_dim_vo"]) == (16, 16)
    runs = [c for n, c in fake.calls if n == "decode.run"]
    plan_ids = sorted(fake.plans)[-2:]
    for i, named in enumerate(runs):
        assert named["plan_info_vec"] == [plan_ids[i // cfg.num_layers]]
        assert named["sm_scale"] == 0.125
        # pagedkv's angle p * rope_scale / theta^(2i/D) is flashinfer's p * rcp_scale * rcp_theta^(2i/D)
        assert named["rope_rcp_scale"] == 2.0 and named["rope_rcp_theta"] == pytest.approx(1 / 5000.0)
        (k_shape, k_stride, k_ptr), (v_shape, v_stride, v_ptr) = named["paged_k_cache"], named["paged_v_cache"]
        assert k_shape == v_shape and k_shape[1:] == (2, 4, 16)  # HND: [pages, Hkv, page_size, D]
        assert k_stride == v_stride == (2 * 2 * 4 * 16, 4 * 16, 16, 1)  # K and V interleaved per page
        assert v_ptr - k_ptr == 2 * 4 * 16 * 4  # V follows K inside each page (float32)
    assert not fake.offsets, f"tensor arguments FlashInfer would misread (byte_offset or NULL strides): {fake.offsets[:4]}"


def test_ragged_and_paged_plans(empty_rows):
    cfg = MHA_CFG
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS["fa2"])
    cache.add_sequence(0)
    _step(cache, cfg, [0], [9], 0.25)
    cache.fork_sequence(0, 1)  # 9 tokens: 8 shared (two full pages), 1 copied
    cache.add_sequence(2)
    fake.calls.clear()
    _step(cache, cfg, [0, 1, 2], [3, 2, 5], 0.25)
    ragged = [c for n, c in fake.calls if n == "prefill_fa2.plan" and c["page_size"] == 1]
    paged = [c for n, c in fake.calls if n == "prefill_fa2.plan" and c["page_size"] == 4]
    assert len(ragged) == 1 and ragged[0]["causal"] is True
    assert ragged[0]["qo_indptr"] == ragged[0]["kv_indptr"] == [0, 3, 5, 10]
    assert ragged[0]["kv_len_arr"] == [3, 2, 5] and ragged[0]["total_num_rows"] == 10
    # a prefix pass (sequences 0 and 1 share 8 tokens; 2 has none) and the own pass
    assert len(paged) == 2 and all(c["causal"] is False for c in paged)
    prefix, own = paged
    assert prefix["qo_indptr"] == [0, 5, 10] and prefix["kv_indptr"] == [0, 2, 2]
    assert prefix["kv_len_arr"] == [8, 0] and prefix["batch_size"] == 2
    assert own["qo_indptr"] == [0, 3, 5, 10] and own["kv_len_arr"] == [1, 1, 0]
    assert fake.count("prefill_fa2.paged_run") == 2 * cfg.num_layers
    assert fake.count("prefill_fa2.ragged_run") == cfg.num_layers
    assert not fake.offsets, f"tensor arguments FlashInfer would misread (byte_offset or NULL strides): {fake.offsets[:4]}"


def test_all_empty_calls_never_reach_flashinfer(empty_rows):
    cfg = MHA_CFG
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS["fa2"])
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    q = torch.randn(3, cfg.num_qo_heads, cfg.head_dim)
    o, lse = cache.cross_attention(0, q, 0.3)  # a fresh sequence: its cache view is empty
    assert torch.all(o == 0) and torch.all(lse == -1e30)
    cache.abort_forward()  # no layer wrote k/v, which end_forward rejects
    assert fake.count("prefill_fa2.paged_run") == 0 and fake.count("prefill_fa2.plan") == 1  # the ragged plan
    _step(cache, cfg, [0], [1], 0.3)  # decode: self_attention covers no key
    cache.begin_forward([0], [1])
    k = torch.randn(1, cfg.num_kv_heads, cfg.head_dim)
    o, lse = cache.self_attention(0, torch.randn(1, cfg.num_qo_heads, cfg.head_dim), k, k.clone(), 0.3)
    assert torch.all(o == 0) and torch.all(lse == -1e30)
    cache.abort_forward()
    assert fake.count("prefill_fa2.ragged_run") == 0


@pytest.mark.parametrize("kinds", list(MHA_KINDS), ids=list(MHA_KINDS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenarios_through_the_adapters(empty_rows, kinds, scenario, gen):
    cfg = MHA_CFG.replace(**SCENARIO_CAPACITY)
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS[kinds])
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, cfg.head_dim), fine_grained=True)
    runner.run(SCENARIOS[scenario](cfg.page_size), scenario)
    ragged = fake.count(f"{MHA_KINDS[kinds]['attn_prefill_ragged']}.ragged_run")
    if scenario == "decode_only":
        # its one prefill continues sequences that hold tokens: a through forward, one causal paged pass
        assert ragged == 0 and fake.count(f"{MHA_KINDS[kinds]['attn_prefill_paged']}.paged_run") > 0
    else:
        assert ragged > 0
    if MHA_KINDS[kinds]["attn_decode_paged"] in ("prefill_fa2", "prefill_fa3"):
        assert fake.count("decode.run") == 0
    assert not fake.offsets, f"tensor arguments FlashInfer would misread (byte_offset or NULL strides): {fake.offsets[:4]}"


#: attention options (window shorter than the scenarios' sequences, a cap that bends random scores)
OPTIONS = {"window": dict(sliding_window=7), "cap": dict(logits_soft_cap=1.5),
           "window+cap": dict(sliding_window=12, logits_soft_cap=2.0)}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_option_scenarios_through_the_adapters(empty_rows, options, scenario, gen):
    """Window and soft-cap reach FlashInfer as its window_left / logits_soft_cap (the stand-in asserts the
    values on every plan and run and applies FlashInfer's definitions), against the reference."""
    cfg = MHA_CFG.replace(**SCENARIO_CAPACITY, **OPTIONS[options])
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS["fa2"])
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, cfg.head_dim), fine_grained=True)
    runner.run(SCENARIOS[scenario](cfg.page_size), scenario)
    assert fake.count("prefill_fa2.paged_run") + fake.count("decode.run") > 0
    assert not fake.offsets, f"tensor arguments FlashInfer would misread (byte_offset or NULL strides): {fake.offsets[:4]}"


#: bfloat16 through the adapters (2-byte elements: the K/V and ckv/kpe pointers and strides, the bf16
#: empty_rows helper), on scenarios that reach every plan: prefill with and without cached tokens, forks
#: mid-page, shared-prefix passes and popn.
BF16_SCENARIOS = ("mixed_prefill_decode", "fork_boundary_midpage", "shared_prefix_adjacent", "popn")


@pytest.mark.parametrize("kinds", list(MHA_KINDS) + list(MLA_KINDS))
@pytest.mark.parametrize("scenario", BF16_SCENARIOS)
def test_bf16_scenarios_through_the_adapters(empty_rows_bf16, kinds, scenario, gen):
    mla = kinds in MLA_KINDS
    cfg = (MLA_CFG if mla else MHA_CFG).replace(dtype="bfloat16", **SCENARIO_CAPACITY)
    cache, fake = make_cache(cfg, empty_rows_bf16, {op: kinds for op in MLA_FI_OPS} if mla else MHA_KINDS[kinds])
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, cfg.head_dim), fine_grained=not mla)
    runner.run(SCENARIOS[scenario](cfg.page_size), scenario)
    assert fake.count(f"{kinds}.run" if mla else f"{MHA_KINDS[kinds]['attn_prefill_ragged']}.ragged_run") > 0
    assert not fake.offsets, f"tensor arguments FlashInfer would misread (byte_offset or NULL strides): {fake.offsets[:4]}"


@pytest.mark.parametrize("kinds", ["fa2", "mla"])
def test_bf16_partial_states_beside_the_adapters(empty_rows_bf16, kinds, gen):
    """With the partial-state ops in the table (TIR's: FlashInfer does not serve them), a shared-prefix forward
    runs its passes on TIR in float32 and a single-pass one on FlashInfer: both against the reference."""
    mla = kinds in MLA_KINDS
    cfg = (MLA_CFG if mla else MHA_CFG).replace(dtype="bfloat16", **SCENARIO_CAPACITY)
    cache, fake = make_cache(cfg, empty_rows_bf16, {op: kinds for op in MLA_FI_OPS} if mla else MHA_KINDS[kinds],
                             partial=True)
    partial_ops = [op for op in ops.ops_for(cfg) if op in ops.PARTIAL_OPS]
    assert partial_ops and all(cache.op_backends[op] == "tir" for op in partial_ops)
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, cfg.head_dim), fine_grained=not mla)
    runner.run(SCENARIOS["shared_prefix_adjacent"](cfg.page_size), "shared_prefix_adjacent")
    runs = "mla.run" if mla else "decode.run"
    shared_runs = fake.count(runs)
    runner.run([clear()] + SCENARIOS["mixed_prefill_decode"](cfg.page_size), "mixed_prefill_decode")
    assert fake.count(runs) > shared_runs  # no shared prefix: one pass, on FlashInfer
    assert not fake.offsets, f"tensor arguments FlashInfer would misread (byte_offset or NULL strides): {fake.offsets[:4]}"


def test_windowed_forward_is_one_causal_pass(empty_rows):
    """A windowed cache plans each prefill as one causal paged pass over the whole chain, new tokens included
    (FlashInfer places the window by the entry's key count), never a shared-prefix pass or a ragged call."""
    cfg = MHA_CFG.replace(sliding_window=6)
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS["fa2"])
    cache.add_sequence(0)
    _step(cache, cfg, [0], [9], 0.25)
    cache.fork_sequence(0, 1)  # 8 tokens shared, as in test_ragged_and_paged_plans
    cache.add_sequence(2)
    fake.calls.clear()
    _step(cache, cfg, [0, 1, 2], [3, 2, 5], 0.25)
    plans = [c for n, c in fake.calls if n == "prefill_fa2.plan"]
    assert len(plans) == 1 and plans[0]["causal"] is True and plans[0]["window_left"] == 5
    assert plans[0]["qo_indptr"] == [0, 3, 5, 10] and plans[0]["kv_len_arr"] == [12, 11, 5]
    assert fake.count("prefill_fa2.ragged_run") == 0 and fake.count("prefill_fa2.paged_run") == cfg.num_layers
    runs = [c for n, c in fake.calls if n == "prefill_fa2.paged_run"]
    assert all(r["mask_mode_code"] == 1 and r["window_left"] == 5 for r in runs)  # causal


def test_tensor_core_decode_plans(empty_rows):
    """attn_decode_paged on the prefill kernel: one non-causal plan per decode pass with q_indptr 0..B (the
    stand-in checks uniform_q_len 1 as FlashInfer's decode wrapper plans it), run per layer with paged_run."""
    cfg = MHA_CFG
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS["tc-fa2"])
    _prefill_each(cache, cfg, {0: 6, 1: 3, 2: 9})
    fake.calls.clear()
    _step(cache, cfg, [0, 1, 2], [1, 1, 1], 0.125)
    plans = [c for n, c in fake.calls if n == "prefill_fa2.plan"]
    assert len(plans) == 1 and plans[0]["qo_indptr"] == [0, 1, 2, 3] and plans[0]["kv_len_arr"] == [7, 4, 10]
    assert fake.count("prefill_fa2.paged_run") == cfg.num_layers and fake.count("decode.run") == 0
    assert not fake.offsets


def test_decode_kernel_chosen_per_forward(empty_rows):
    """"decode|prefill_fa2": a forward whose longest sequence has at least twice the mean keys runs on the
    CUDA-core decode kernel, any other on the tensor-core path; each plans and runs only its own module."""
    cfg = MHA_CFG
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS["choose"])
    _prefill_each(cache, cfg, {0: 20, 1: 19, 2: 21})
    fake.calls.clear()
    _step(cache, cfg, [0, 1, 2], [1, 1, 1], 0.125)  # 21, 20, 22 keys: uniform
    assert fake.count("prefill_fa2.plan") == 1 and fake.count("prefill_fa2.paged_run") == cfg.num_layers
    assert fake.count("decode.plan") == 0 and fake.count("decode.run") == 0
    _prefill_each(cache, cfg, {3: 2, 4: 2})
    fake.calls.clear()
    _step(cache, cfg, [0, 3, 4], [1, 1, 1], 0.125)  # 23, 3, 3 keys: the longest is 23 >= 2 * 29 / 3
    assert fake.count("decode.plan") == 1 and fake.count("decode.run") == cfg.num_layers
    assert fake.count("prefill_fa2.plan") == 0 and fake.count("prefill_fa2.paged_run") == 0
    assert not fake.offsets


def test_decode_kernel_choice_skewed_and_large(empty_rows):
    """A skewed decode of more than 256 entries x kv heads (``kMaxCudaCoreRows``) stays on tensor cores, where
    the CUDA-core kernel lost on the H200 (64 x 8 of 128 ... 16K keys); 4 x 64 = 256 still takes CUDA cores."""
    cfg = MHA_CFG.replace(num_qo_heads=256, num_kv_heads=64, max_batch_size=6)
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS["choose"])
    _prefill_each(cache, cfg, {0: 22, 1: 2, 2: 2, 3: 2, 4: 2})
    for ids, kernel in (([0, 1, 2, 3], "decode"), ([0, 1, 2, 3, 4], "prefill_fa2")):
        fake.calls.clear()
        _step(cache, cfg, ids, [1] * len(ids), 0.125)  # the longest has >= 2x the mean keys both times
        other = "prefill_fa2" if kernel == "decode" else "decode"
        assert fake.count(f"{kernel}.plan") == 1 and fake.count(f"{other}.plan") == 0, (ids, fake.calls[:3])


@pytest.mark.parametrize("kind", MLA_KINDS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_mla_scenarios_through_the_adapters(empty_rows, kind, scenario, gen):
    cfg = MLA_CFG.replace(**SCENARIO_CAPACITY)
    cache, fake = make_cache(cfg, empty_rows, {op: kind for op in MLA_FI_OPS})
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, cfg.head_dim))
    runner.run(SCENARIOS[scenario](cfg.page_size), scenario)
    assert fake.count(f"{kind}.run") > 0
    assert not fake.offsets, f"tensor arguments FlashInfer would misread (byte_offset or NULL strides): {fake.offsets[:4]}"


def test_mla_plan_and_views(empty_rows):
    cfg = MLA_CFG
    cache, fake = make_cache(cfg, empty_rows, {op: "mla" for op in MLA_FI_OPS})
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.begin_forward([0, 1], [5, 2])
    for layer in range(cfg.num_layers):
        cache.append_mla_kv(layer, torch.randn(7, cfg.latent_dim))
    cache.end_forward()
    fake.calls.clear()
    cache.begin_forward([0, 1], [1, 1])  # decode: mla_attn_decode_paged, one plan
    for layer in range(cfg.num_layers):
        cache.append_mla_kv(layer, torch.randn(2, cfg.latent_dim))
        cache.cross_attention(layer, torch.randn(2, cfg.num_qo_heads, cfg.latent_dim), 0.2)
    cache.end_forward()
    (name, plan), *rest = fake.calls
    assert name == "mla.plan" and len(rest) == cfg.num_layers
    assert plan["qo_indptr"] == [0, 1, 2] and plan["kv_indptr"] == [0, 2, 3] and plan["kv_len"] == [6, 3]
    assert (plan["num_heads"], plan["head_dim_o"], plan["causal"]) == (3, 32, False)
    dl, ps = cfg.latent_dim, cfg.page_size
    for _, run in rest:
        (cs, cst, cptr), (ks, kst, kptr) = run["ckv_cache"], run["kpe_cache"]
        assert cs[1:] == (ps, 32) and ks[1:] == (ps, 16) and cst == kst == (ps * dl, dl, 1)
        assert kptr - cptr == 32 * 4  # kpe follows ckv inside each latent row (float32)
        (qs, qst, qptr), (ps_, pst, pptr) = run["q_nope"], run["q_pe"]
        assert qs == (2, 3, 32) and ps_ == (2, 3, 16) and qst == pst == (3 * dl, dl, 1) and pptr - qptr == 128
        assert run["sm_scale"] == pytest.approx(0.2) and run["page_size"] == ps and run["num_heads"] == 3


def test_mla_pass_larger_than_the_planner_is_split(empty_rows, gen):
    """128 heads x 8000 queries are 16000 query tiles, more than FlashInfer's MLA planner holds (16384 work
    items less the KV splits): the adapter plans the pass as sub-plans that fit (the stand-in asserts the
    limit), splitting an entry by queries, and the result equals one exact attention over the cache."""
    heads, n_new, n_old = 128, 8000, 37
    cfg = KVCacheConfig.mla(num_layers=1, num_heads=heads, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=16, v_head_dim=16, dtype="float32", page_size=16, max_batch_size=2,
                            max_total_seq_len=8192, prefill_chunk_size=8192)
    cache, fake = make_cache(cfg, empty_rows, {op: "mla_fa3" for op in MLA_FI_OPS})
    for seq in (0, 1):
        cache.add_sequence(seq)
    kv_old = torch.randn(n_old + 5, cfg.latent_dim, generator=gen)
    cache.begin_forward([0, 1], [n_old, 5])
    cache.append_mla_kv(0, kv_old)
    cache.end_forward()
    fake.calls.clear()
    cache.begin_forward([0, 1], [n_new, 3])
    cache.append_mla_kv(0, torch.randn(n_new + 3, cfg.latent_dim, generator=gen))
    q = torch.randn(n_new + 3, heads, cfg.latent_dim, generator=gen)
    o, lse = cache.cross_attention(0, q, 0.15)
    cache.end_forward()
    plans = [c for n, c in fake.calls if n == "mla_fa3.plan"]
    assert len(plans) == 2 and [p["qo_indptr"][-1] for p in plans] == [7680, n_new + 3 - 7680]
    assert plans[0]["kv_len"] == [n_old] and plans[1]["kv_len"] == [n_old, 5]  # entry 0 split by queries
    r = cfg.kv_lora_rank
    for rows, keys in ((slice(0, n_new), kv_old[:n_old]), (slice(n_new, None), kv_old[n_old:])):
        s = torch.einsum("nhd,ld->nhl", q[rows].double(), keys.double()) * 0.15
        ref = torch.einsum("nhl,ld->nhd", torch.softmax(s, -1), keys[:, :r].double())
        err = (o[rows].double() - ref).norm() / ref.norm()
        assert err < 1e-5, err
        assert torch.allclose(lse[rows].double(), torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0)),
                              atol=1e-4)


def test_op_table_entry_is_checked(empty_rows):
    cfg = MHA_CFG
    from pagedkv import ops as O

    module, table = _compile_op_table(cfg, "llvm", tuple((op, "tir") for op in O.ops_for(cfg)))
    fake = FakeFlashInfer()
    ref = _to_ffi(torch.empty((1,)))

    def create(entry):
        t = [entry if e[0] == entry[0] else e for e in table]
        return get_global("pagedkv.create")(cfg.to_json(), (), t, ref)

    good = fake.entry("attn_decode_paged", "decode", empty_rows[1])
    with pytest.raises(ValueError, match=r"takes \[module_kind, empty_rows, plan, run\]"):
        create(good[:2] + good[4:])
    with pytest.raises(ValueError, match="takes a FlashInfer decode, prefill_fa2, prefill_fa3, decode.prefill_fa2 "
                                         "module, got 'mla'"):
        create(good[:2] + ["mla"] + good[3:])
    with pytest.raises(ValueError, match="takes a FlashInfer prefill_fa2, prefill_fa3 module"):
        create(["attn_prefill_paged", "flashinfer", "mla"] + good[3:])
    assert abi.DECODE_RUN.num_args == 19


def test_failed_plan_leaves_the_cache_unchanged(empty_rows):
    """A plan that fails inside begin_forward (a device failure) takes the appended tokens back: lengths
    and free pages are as before, no forward is open, and the next forward works."""
    cache, fake = make_cache(MHA_CFG, empty_rows, {"attn_decode_paged": "decode"})
    for seq in (0, 1):
        cache.add_sequence(seq)
    _step(cache, MHA_CFG, [0, 1], [5, 4], 0.25)  # prefill: the decode op plans nothing
    before = ([cache.get_sequence_length(s) for s in (0, 1)], cache.num_available_pages)
    fake.fail_next_plan = True
    with pytest.raises(Exception, match="stand-in plan failure"):
        cache.begin_forward([0, 1], [1, 1])
    assert ([cache.get_sequence_length(s) for s in (0, 1)], cache.num_available_pages) == before
    _step(cache, MHA_CFG, [0, 1], [1, 1], 0.25)  # no forward left open; planning works again
    assert [cache.get_sequence_length(s) for s in (0, 1)] == [6, 5]


#: CUDA-graph caches: decode plans take enable_cuda_graph (the stand-in asserts it and returns one plan info
#: per batch size, as FlashInfer's graph plans do); prefill plans do not.
GRAPH_KINDS = ("fa2", "tc-fa2", "choose")


@pytest.mark.parametrize("kinds", GRAPH_KINDS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_graph_scenarios_through_the_adapters(empty_rows, kinds, scenario, gen):
    cfg = MHA_CFG.replace(**SCENARIO_CAPACITY, cuda_graph_batch=SCENARIO_CAPACITY["max_batch_size"])
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS[kinds])
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, cfg.head_dim), fine_grained=True)
    runner.run(SCENARIOS[scenario](cfg.page_size), scenario)
    if kinds == "choose":  # a graph decode replays one kernel choice: tensor cores, whatever the skew
        assert fake.count("decode.plan") == 0
    assert not fake.offsets


def test_graph_plan_that_changes_is_refused(empty_rows):
    """A decode plan of a batch size already seen must keep its plan info (the captured launches); one that
    changes fails begin_forward naming the reason, and leaves the cache as it was."""
    cfg = MHA_CFG.replace(cuda_graph_batch=4)
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS["tc-fa2"])
    _prefill_each(cache, cfg, {0: 6, 1: 3, 2: 9})
    _step(cache, cfg, [0, 1, 2], [1, 1, 1], 0.125)
    _step(cache, cfg, [0, 1, 2], [1, 1, 1], 0.125)  # same info: fine
    fake.perturb_next_graph_plan = True
    with pytest.raises(Exception, match="launch configuration other than the first forward of that batch size"):
        cache.begin_forward([0, 1, 2], [1, 1, 1])
    assert [cache.get_sequence_length(s) for s in (0, 1, 2)] == [8, 5, 11]
    _step(cache, cfg, [0, 1, 2], [1, 1, 1], 0.125)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_sinks_after_flashinfer_runs(mla, empty_rows, gen):
    """Learnable sinks with the attention ops on the FlashInfer adapters: FlashInfer's ops return their lse (its
    empty rows' -inf floored to -1e30 by ``empty_rows``), so TIR's sink ops merge the sinks into their states and
    FlashInfer needs no sink variant. Every output is within tolerance of the reference with the sinks and far from
    it without them and with them doubled (``pagedkv.testing.sinks``): one-pass and prefix-shared forwards, a split
    prefill, an MLA view of an empty sequence."""
    from pagedkv.testing.sinks import SinkRun

    cfg = (MLA_CFG if mla else MHA_CFG).replace(attention_sinks=True)
    cache, fake = make_cache(cfg, empty_rows, {op: "mla" for op in MLA_FI_OPS} if mla else MHA_KINDS["fa2"])
    run = SinkRun(cache, gen)
    step = run.mla if mla else run.fused
    run.each("add_sequence", 0)
    step({0: 6})
    step({0: 1})
    for child in (1, 2):
        run.each("fork_sequence", 0, child, 4)
    step({1: 1, 2: 1})
    run.each("add_sequence", 3)
    step({3: 3, 1: 2, 2: 2})
    assert fake.count("mla.run" if mla else "prefill_fa2.paged_run") > 0


@pytest.mark.parametrize("scenario", ["mixed_prefill_decode"])  # (forks: test_sinks.py, test_sinks_runtime.py)
def test_sink_token_scenarios_through_the_adapters(empty_rows, scenario, gen):
    """StreamingLLM sink tokens (sink_size 3 beside a window of 7) on FlashInfer's window kernels: the runtime's sink
    passes read each chain's first pages, every entry inside one window, so FlashInfer's window serves them as it
    is (a prefill's non-causal sink pass among its plans); against the reference."""
    cfg = MHA_CFG.replace(**SCENARIO_CAPACITY, **OPTIONS["window"], sink_size=3)
    cache, fake = make_cache(cfg, empty_rows, MHA_KINDS["fa2"])
    runner = ScenarioRunner(cache, gen, random_sm_scale(gen, cfg.head_dim), fine_grained=True)
    runner.run(SCENARIOS[scenario](cfg.page_size), scenario)
    plans = [c for n, c in fake.calls if n == "prefill_fa2.plan"]
    assert any(p["causal"] is False for p in plans) and all(p["window_left"] == 6 for p in plans)
