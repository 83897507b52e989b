"""Every bad call raises, names the offending value, and leaves the cache exactly as it was.

"Exactly as it was" is checked two ways: a snapshot (lengths, ``num_available_pages``,
``total_sequence_length`` and the ``debug_get_kv`` dump of every sequence) taken before the bad call equals
the one after it, and the cache keeps matching the reference (which never saw the bad call) through a
following forward. Calls that fail inside a forward are followed by the rest of that forward.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import pagedkv
from conftest import cpu_backends
from pagedkv import KVCacheConfig, ops
from pagedkv._lib import get_global
from pagedkv.cache import _to_ffi
from pagedkv.testing.scenarios import ScenarioRunner, add, assert_close, check, check_state, forward

# page size 8, max_total_seq_len 32, max_batch_size 2 -> 4 + 2 = 6 pages (48 tokens); a forward appends
# at most 24 tokens.
CFG = KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64, dtype="float32",
                    rope_mode="normal", page_size=8, max_batch_size=2, max_total_seq_len=32,
                    prefill_chunk_size=24)
NUM_PAGES = 6
WIDTH = CFG.num_qo_heads + 2 * CFG.num_kv_heads
BACKENDS = cpu_backends(CFG)


@pytest.fixture(params=BACKENDS)
def runner(request, make_cache, gen):
    """A cache holding sequence 0 (10 tokens) and 1 (3 tokens), mirrored by the reference."""
    r = ScenarioRunner(make_cache(CFG, request.param), gen, 0.11)
    r.run([add(0), add(1), forward({0: 10, 1: 3})], "setup")
    return r


def snapshot(cache, seqs):
    out = {"pages": cache.num_available_pages, "total": cache.total_sequence_length}
    for s in seqs:
        out[s] = (cache.get_sequence_length(s), *cache.debug_get_kv(s))
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], tuple):
            assert a[key][0] == b[key][0], f"length of {key} changed: {a[key][0]} -> {b[key][0]}"
            assert torch.equal(a[key][1], b[key][1]) and torch.equal(a[key][2], b[key][2]), f"k/v of {key} changed"
        else:
            assert a[key] == b[key], f"{key} changed: {a[key]} -> {b[key]}"


def rejects(r: ScenarioRunner, call, pattern: str, follow: bool = True):
    """``call()`` raises with ``pattern`` (a regex) in its message and changes nothing; then the cache
    still matches the reference, and (``follow``) also through one more forward of every sequence."""
    seqs = sorted(r.ref.seqs)
    before = snapshot(r.cache, seqs)
    with pytest.raises(Exception) as info:
        call()
    msg = str(info.value)
    assert re.search(pattern, msg, re.IGNORECASE), f"message does not name {pattern!r}: {msg!r}"
    assert_same(before, snapshot(r.cache, seqs))
    check_state(r.cache, r.ref, "after the rejected call")
    live = [s for s in seqs if s in r.ref.seqs][: CFG.max_batch_size]
    if follow and live and r.ref.num_available_pages >= len(live):
        r.run([forward({s: 1 for s in live}), check()], "forward after the rejected call")


def num(value: int) -> str:
    """A regex matching the integer ``value`` as a whole number."""
    return rf"(?<![\d.]){re.escape(str(value))}(?![\d.])"


# -- sequences ------------------------------------------------------------------------------------------
def test_unknown_seq_id(runner):
    c = runner.cache
    rejects(runner, lambda: c.remove_sequence(12345), num(12345))
    rejects(runner, lambda: c.fork_sequence(12345, 7, -1), num(12345))
    rejects(runner, lambda: c.popn(12345, 1), num(12345))
    rejects(runner, lambda: c.get_sequence_length(12345), num(12345))
    rejects(runner, lambda: c.begin_forward([0, 12345], [1, 1]), num(12345))
    rejects(runner, lambda: c.debug_get_kv(12345, 0, 0), num(12345))


def test_duplicate_seq_id(runner):
    c = runner.cache
    rejects(runner, lambda: c.add_sequence(1), r"\b1\b")
    runner.run([add(77)], "add 77")
    rejects(runner, lambda: c.add_sequence(77), num(77))
    rejects(runner, lambda: c.fork_sequence(0, 77, 4), num(77))
    rejects(runner, lambda: c.fork_sequence(0, 0, 4), r"\b0\b")


def test_fork_pos_out_of_range(runner):
    c = runner.cache
    for parent in (0, 1):
        past = runner.ref.get_sequence_length(parent) + 1
        rejects(runner, lambda: c.fork_sequence(parent, 5, past), num(past), follow=False)
    rejects(runner, lambda: c.fork_sequence(0, 5, -7), num(-7))


def test_popn_too_long(runner):
    c = runner.cache
    for seq in (0, 1):
        too_many = runner.ref.get_sequence_length(seq) + 1
        rejects(runner, lambda: c.popn(seq, too_many), num(too_many), follow=False)
    rejects(runner, lambda: c.popn(0, -2), num(-2))


def test_out_of_pages_begin_forward(runner):
    c = runner.cache
    runner.run([forward({0: 14}), check()], "fill")  # 0: 24 tokens (3 pages), 1: 3 (1 page); 2 left
    assert runner.ref.num_available_pages == 2
    rejects(runner, lambda: c.begin_forward([0], [17]), r"page", follow=False)  # 0 needs 3 more
    # the first sequence fits (its page must be given back), the second does not
    rejects(runner, lambda: c.begin_forward([1, 0], [6, 16]), r"page", follow=False)
    runner.run([forward({0: 16}), check()], "fill")  # 0: 40 tokens (5 pages); none left
    assert runner.ref.num_available_pages == 0
    runner.run([forward({1: 5}), check()], "fits in its last page")  # 1: 8 tokens, still 1 page
    rejects(runner, lambda: c.begin_forward([1], [1]), r"page", follow=False)


def test_out_of_pages_fork_midpage(runner):
    runner.run([forward({0: 22, 1: 2}), forward({1: 9}), check()], "fill")  # 0: 32 (4 pages), 1: 14 (2)
    assert runner.ref.num_available_pages == 0
    rejects(runner, lambda: runner.cache.fork_sequence(0, 2, 13), r"page", follow=False)
    rejects(runner, lambda: runner.cache.fork_sequence(1, 2, -1), r"page", follow=False)
    # forks at a page boundary share full pages only and need none
    for child, pos in ((2, 16), (3, -1)):
        runner.ref.fork_sequence(0, child, pos)
        runner.cache.fork_sequence(0, child, pos)
    check_state(runner.cache, runner.ref, "forks at a boundary with no free page")


def test_debug_kv_range(runner):
    c = runner.cache
    past = runner.ref.get_sequence_length(0) + 1
    rejects(runner, lambda: c.debug_get_kv(0, 0, past), num(past), follow=False)
    rejects(runner, lambda: c.debug_get_kv(0, 4, 2), num(4), follow=False)
    kv = torch.randn(CFG.num_layers, 3, CFG.num_kv_heads, CFG.head_dim)
    start = runner.ref.get_sequence_length(1) - 2  # 3 tokens from here run past the end
    rejects(runner, lambda: c.debug_set_kv(1, start, kv, kv), num(start + 3), follow=False)
    rejects(runner, lambda: c.debug_set_kv(0, 0, kv.half(), kv.half()), r"float16")


# -- forward ----------------------------------------------------------------------------------------------
def _qkv(n, width=WIDTH, d=CFG.head_dim, dtype=torch.float32):
    return torch.randn(n, width, d).to(dtype)


def in_forward_rejects(r: ScenarioRunner, batch: dict, bad, pattern: str):
    """Inside a forward: layer 0 valid, then the bad call, then layer 1; outputs must match the
    reference (which never saw the bad call) and so must the state afterwards."""
    seqs, lens = list(batch), list(batch.values())
    r.ref.begin_forward(seqs, lens)
    r.cache.begin_forward(seqs, lens)
    n = sum(lens)
    outs = []
    for layer in range(CFG.num_layers):
        qkv = _qkv(n)
        outs.append((r.cache.attention_with_fused_qkv(layer, qkv, 0.11),
                     r.ref.attention_with_fused_qkv(layer, qkv, 0.11)))
        if layer == 0:
            with pytest.raises(Exception) as info:
                bad()
            msg = str(info.value)
            assert re.search(pattern, msg, re.IGNORECASE), f"message does not name {pattern!r}: {msg!r}"
    r.cache.end_forward()
    r.ref.end_forward()
    for layer, (o, ref_o) in enumerate(outs):
        assert_close(o, ref_o, CFG.dtype, f"layer {layer} of the forward with a rejected call")
    check_state(r.cache, r.ref, "after the forward with a rejected call")
    r.run([forward({0: 1}), check()], "next forward")


def test_layer_out_of_range(runner):
    c = runner.cache
    in_forward_rejects(runner, {0: 2, 1: 1}, lambda: c.attention_with_fused_qkv(17, _qkv(3), 0.1), num(17))
    in_forward_rejects(runner, {0: 1, 1: 1}, lambda: c.attention_with_fused_qkv(2, _qkv(2), 0.1), num(2))
    in_forward_rejects(runner, {0: 1}, lambda: c.attention_with_fused_qkv(-1, _qkv(1), 0.1), num(-1))
    q = torch.randn(3, CFG.num_qo_heads, CFG.head_dim)
    in_forward_rejects(runner, {0: 2, 1: 1}, lambda: c.cross_attention(17, q, 0.1), num(17))
    kv = torch.randn(3, CFG.num_kv_heads, CFG.head_dim)
    in_forward_rejects(runner, {0: 2, 1: 1}, lambda: c.self_attention(17, q, kv, kv, 0.1), num(17))


def test_qkv_wrong_shape(runner):
    c = runner.cache
    # 11 heads instead of 4 + 2 * 2 = 8
    in_forward_rejects(runner, {0: 2, 1: 1}, lambda: c.attention_with_fused_qkv(1, _qkv(3, width=11), 0.1),
                       num(11))
    # 13 tokens in a forward of 3
    in_forward_rejects(runner, {0: 2, 1: 1}, lambda: c.attention_with_fused_qkv(1, _qkv(13), 0.1), num(13))
    # head dim 32 instead of 64
    in_forward_rejects(runner, {0: 2, 1: 1}, lambda: c.attention_with_fused_qkv(1, _qkv(3, d=32), 0.1), num(32))
    # a 2-d qkv
    in_forward_rejects(runner, {0: 2, 1: 1},
                       lambda: c.attention_with_fused_qkv(1, torch.randn(3, WIDTH * CFG.head_dim), 0.1),
                       r"qkv|shape|ndim|dimension")
    # cross_attention with a q of 5 tokens in a forward of 3
    in_forward_rejects(runner, {0: 2, 1: 1},
                       lambda: c.cross_attention(1, torch.randn(5, CFG.num_qo_heads, CFG.head_dim), 0.1), num(5))


def test_qkv_wrong_dtype(runner):
    c = runner.cache
    in_forward_rejects(runner, {0: 2, 1: 1},
                       lambda: c.attention_with_fused_qkv(1, _qkv(3, dtype=torch.float64), 0.1), r"float64")
    in_forward_rejects(runner, {0: 2, 1: 1},
                       lambda: c.attention_with_fused_qkv(1, _qkv(3, dtype=torch.float16), 0.1), r"float16")


def test_begin_forward_twice(runner):
    c = runner.cache
    in_forward_rejects(runner, {0: 2, 1: 1}, lambda: c.begin_forward([0], [1]), r"begin_forward|forward")


def test_attention_outside_forward(runner):
    c = runner.cache
    q = torch.randn(1, CFG.num_qo_heads, CFG.head_dim)
    kv = torch.randn(1, CFG.num_kv_heads, CFG.head_dim)
    pattern = r"begin_forward|forward"
    rejects(runner, lambda: c.attention_with_fused_qkv(0, _qkv(1), 0.1), pattern)
    rejects(runner, lambda: c.cross_attention(0, q, 0.1), pattern)
    rejects(runner, lambda: c.self_attention(0, q, kv, kv, 0.1), pattern)
    rejects(runner, lambda: c.get_query_positions(), pattern)
    rejects(runner, lambda: c.end_forward(), pattern)
    runner.run([forward({0: 1})], "one forward")
    rejects(runner, lambda: c.attention_with_fused_qkv(0, _qkv(1), 0.1), pattern)  # after end_forward


def test_sequence_ops_inside_forward(runner):
    """add / remove / fork / popn between begin_forward and end_forward are rejected."""
    c = runner.cache
    for bad in (lambda: c.add_sequence(9), lambda: c.remove_sequence(1), lambda: c.fork_sequence(0, 9, 4),
                lambda: c.popn(0, 1)):
        in_forward_rejects(runner, {0: 2, 1: 1}, bad, r"forward")


def test_over_prefill_chunk_size(runner):
    # chunk 24; the pages would suffice (0: 10 -> 35 tokens needs 3 more pages, 3 are left)
    rejects(runner, lambda: runner.cache.begin_forward([0, 1], [13, 12]), num(25))
    rejects(runner, lambda: runner.cache.begin_forward([0], [25]), num(25))


def test_over_max_batch_size(runner):
    runner.run([add(2)], "add 2")
    rejects(runner, lambda: runner.cache.begin_forward([0, 1, 2], [1, 1, 1]), num(3))


def test_bad_begin_forward_arguments(runner):
    c = runner.cache
    rejects(runner, lambda: c.begin_forward([0, 1], [1]), r"\b1\b|\b2\b|length")
    rejects(runner, lambda: c.begin_forward([0, 0], [1, 1]), r"\b0\b|duplicate|repeat|twice")


# -- numbers and the forward protocol -----------------------------------------------------------------------
SCALE_ERROR = r"sm_scale must be a finite number > 0"


def test_sm_scale_must_be_finite_and_positive(runner):
    """NaN, inf, zero or a negative sm_scale (which the kernels turn into finite, wrong numbers) is rejected
    by the Python methods before the runtime sees it, and changes nothing."""
    c = runner.cache
    q = torch.randn(2, CFG.num_qo_heads, CFG.head_dim)
    kv = torch.randn(2, CFG.num_kv_heads, CFG.head_dim)
    for bad in (math.nan, math.inf, 0.0, -0.125):
        in_forward_rejects(runner, {0: 1, 1: 1}, lambda: c.attention_with_fused_qkv(1, _qkv(2), bad), SCALE_ERROR)
    in_forward_rejects(runner, {0: 1, 1: 1}, lambda: c.cross_attention(1, q, math.nan), SCALE_ERROR)
    in_forward_rejects(runner, {0: 1, 1: 1}, lambda: c.self_attention(1, q, kv, kv, -math.inf), SCALE_ERROR)
    rejects(runner, lambda: c.attention_with_fused_qkv(0, _qkv(1), "0.1"), r"sm_scale must be a float")


def test_runtime_sm_scale_must_be_finite_and_positive(runner):
    """The runtime's attention entry points, called directly (as a compiled model does), check sm_scale
    themselves."""
    c = runner.cache
    q, kv = torch.randn(2, CFG.num_qo_heads, CFG.head_dim), torch.randn(2, CFG.num_kv_heads, CFG.head_dim)
    o, lse = torch.empty(2, CFG.num_qo_heads, CFG.head_dim), torch.empty(2, CFG.num_qo_heads)
    raw = {name: get_global(f"pagedkv.{name}") for name in ("attention_with_fused_qkv", "cross_attention",
                                                              "self_attention")}
    for bad in (math.nan, -math.inf, 0.0):
        in_forward_rejects(runner, {0: 1, 1: 1}, lambda: raw["attention_with_fused_qkv"](
            c.handle, 1, bad, _to_ffi(_qkv(2)), _to_ffi(o)), r"attention_with_fused_qkv: " + SCALE_ERROR)
    in_forward_rejects(runner, {0: 1, 1: 1}, lambda: raw["cross_attention"](
        c.handle, 1, math.inf, *map(_to_ffi, (q, o, lse))), r"cross_attention: " + SCALE_ERROR)
    in_forward_rejects(runner, {0: 1, 1: 1}, lambda: raw["self_attention"](
        c.handle, 1, -1.0, *map(_to_ffi, (q, kv, kv, o, lse))), r"self_attention: " + SCALE_ERROR)


def _forward_of_layers(c, batch: dict, layers) -> None:
    """One forward of ``batch`` that runs only ``layers``, then ``end_forward``."""
    c.begin_forward(list(batch), list(batch.values()))
    for layer in layers:
        c.attention_with_fused_qkv(layer, _qkv(sum(batch.values())), 0.11)
    c.end_forward()


def test_forward_that_skips_a_layer_is_rolled_back(runner):
    """A forward in which a layer wrote no k/v (its slots would keep what the pages held before, e.g. a removed
    sequence's k/v, for every later forward to read) is rejected by end_forward and taken back whole."""
    c = runner.cache
    rejects(runner, lambda: _forward_of_layers(c, {0: 2, 1: 1}, [0]),
            r"end_forward: layer 1 of 2 wrote no k/v in this forward.*rolled back: sequences \[0, 1\]")
    rejects(runner, lambda: _forward_of_layers(c, {1: 1}, [1]), r"layer 0 of 2 wrote no k/v")
    rejects(runner, lambda: _forward_of_layers(c, {0: 3}, []), r"layers \[0, 1\] of 2 wrote no k/v")
    # a sequence whose pages come from a removed one, the case that read stale k/v
    runner.run([forward({1: 13}), check()], "1 fills a page")
    c.remove_sequence(1)
    runner.ref.remove_sequence(1)
    runner.run([add(2), forward({2: 4})], "2 takes the freed pages")
    rejects(runner, lambda: _forward_of_layers(c, {2: 5}, [1]), r"layer 0 of 2 wrote no k/v")


def test_cross_attention_before_its_layer_wrote_the_new_tokens(runner):
    """A decode forward's paged pass covers its own new tokens: cross_attention of a layer whose k/v for them
    is not written yet would read stale slots, and is rejected."""
    q = torch.randn(2, CFG.num_qo_heads, CFG.head_dim)
    in_forward_rejects(runner, {0: 1, 1: 1}, lambda: runner.cache.cross_attention(1, q, 0.11),
                       r"cross_attention of layer 1 attends over this forward's new tokens.*has not written yet")


def test_abort_forward_takes_the_forward_back(runner):
    c = runner.cache
    before = snapshot(c, [0, 1])
    c.begin_forward([0, 1], [2, 1])
    c.attention_with_fused_qkv(0, _qkv(3), 0.11)
    c.abort_forward()
    assert_same(before, snapshot(c, [0, 1]))
    c.abort_forward()  # without an open forward: nothing to do (safe in an error handler)
    assert_same(before, snapshot(c, [0, 1]))
    runner.run([forward({0: 1, 1: 2}), check()], "a forward after abort_forward")


def test_check_append(runner):
    """check_append raises what begin_forward would for appends spread over several forwards (the page
    budget; not the per-forward batch and chunk limits) and changes nothing."""
    c = runner.cache
    c.check_append([0, 1], [14, 13])  # 27 tokens: more than one forward's 24, within the 3 free pages
    rejects(runner, lambda: c.check_append([0], [40]), r"out of pages.*5 new pages, 3 available")
    rejects(runner, lambda: c.check_append([0, 7], [1, 1]), num(7))
    rejects(runner, lambda: c.check_append([1], [0]), r"append length 0")


def test_debug_end_forward_unwritten_keeps_the_tokens(runner):
    """Benchmarks reserve long sequences without attention and write their k/v with debug_set_kv."""
    c = runner.cache
    c.add_sequence(5)
    c.begin_forward([5], [3])
    c.end_forward(debug_unwritten=True)
    assert c.get_sequence_length(5) == 3
    k = torch.randn(CFG.num_layers, 3, CFG.num_kv_heads, CFG.head_dim)
    c.debug_set_kv(5, 0, k, k)
    assert torch.equal(c.debug_get_kv(5)[0], k)
    c.remove_sequence(5)
    check_state(c, runner.ref, "after removing the reserved sequence")


def test_relax_attention_rejects_a_bad_constant_sm_scale():
    """The Relax constructor's attention methods check a constant sm_scale while the model is built."""
    from tvm.relax.frontend import nn

    from pagedkv.relax import PagedKVCache

    class Attention(nn.Module):
        def __init__(self, method: str, sm_scale: float):
            self.method, self.sm_scale = method, sm_scale

        def forward(self, x: nn.Tensor, cache: PagedKVCache):
            if self.method == "attention_with_fused_qkv":
                return cache.attention_with_fused_qkv(0, x, CFG.num_qo_heads, self.sm_scale)
            return cache.cross_attention(0, x, CFG.head_dim, self.sm_scale)[0]

    def export(method, sm_scale):
        width = WIDTH if method == "attention_with_fused_qkv" else CFG.num_qo_heads
        module = Attention(method, sm_scale)
        module.export_tvm(spec=nn.spec.ModuleSpec.from_raw({"forward": {
            "x": nn.spec.Tensor([1, "n", width, CFG.head_dim], "float32"),
            "cache": nn.spec.Object(object_type=PagedKVCache),
            "$": {"param_mode": "none", "effect_mode": "none"}}}, module))

    for method in ("attention_with_fused_qkv", "cross_attention"):
        export(method, 0.125)
        for bad in (math.nan, math.inf, 0.0, -0.125):
            with pytest.raises(ValueError, match=rf"PagedKVCache\.{method}: {SCALE_ERROR}"):
                export(method, bad)


@pytest.mark.parametrize("field,value", [("rope_theta", 0.0), ("rope_theta", -10000.0), ("rope_scale", 0.0),
                                         ("rope_scale", -2.0), ("rope_scale", math.inf), ("rope_theta", math.nan)])
def test_create_rejects_bad_rope_numbers(table, field, value):
    """The runtime's own config check (a library or a caller may hand it JSON that never was a KVCacheConfig)."""
    config = json.loads(CFG.to_json())
    config[field] = value
    with pytest.raises(ValueError, match=rf"pagedkv config: {field} must be a finite number > 0, got "):
        _create(json.dumps(config), table)


# -- create ---------------------------------------------------------------------------------------------
@pytest.fixture
def table():
    """The op table of CFG for ``tir``, as ``pagedkv.create`` builds it (a fresh list per test)."""
    from pagedkv import backends
    from pagedkv.cache import _compile_op_table

    resolution = backends.resolve(CFG, "llvm", "tir")
    _module, entries = _compile_op_table(CFG, "llvm", tuple(resolution.choice.items()))
    return [list(e) for e in entries]


def _create(config_json, table, runtime_values=()):
    import tvm_ffi

    device_ref = torch.empty((1,), dtype=torch.float32)
    return get_global("pagedkv.create")(config_json, runtime_values, table, tvm_ffi.from_dlpack(device_ref))


def test_create_full_table_works(table):
    cache = _create(CFG.to_json(), table)
    assert {str(k): str(v) for k, v in get_global("pagedkv.op_backends")(cache).items()} == \
        {op: "tir" for op in ops.ops_for(CFG)}


@pytest.mark.parametrize("missing", [ops.MERGE_STATE, ops.ATTN_DECODE_PAGED, ops.COPY_PAGE])
def test_create_missing_op(table, missing):
    partial = [e for e in table if e[0] != missing]
    with pytest.raises(Exception, match=re.escape(missing)):
        _create(CFG.to_json(), partial)


def test_create_unknown_op(table):
    table.append(["frobnicate_kv", "tir", table[0][2]])
    with pytest.raises(Exception, match="frobnicate_kv"):
        _create(CFG.to_json(), table)


def test_create_unknown_adapter_kind(table):
    assert table[0][2] == "adapter=direct"
    table[0][2] = "adapter=nosuchadapter"
    with pytest.raises(Exception, match="unknown adapter kind 'nosuchadapter'"):
        _create(CFG.to_json(), table)


def test_create_max_kv_len_adapter_needs_a_page_table(table):
    # direct_max_kv_len finds a call's pass by its page_indptr: an op without one is refused, naming both
    i = next(i for i, e in enumerate(table) if e[0] == "split_rotary")
    table[i][2] = "adapter=direct_max_kv_len"
    with pytest.raises(Exception, match="adapter 'direct_max_kv_len' serves ops with a page_indptr argument, "
                                        "not 'split_rotary'"):
        _create(CFG.to_json(), table)


def test_create_any_backend_tag_with_a_known_adapter(table):
    # the tag is the backend's name (reported by op_backends); how the runtime calls it is the adapter kind,
    # so a backend whose functions follow the kernel ABI needs no C++
    table[0][1] = "mybackend"
    cache = _create(CFG.to_json(), table)
    assert str(get_global("pagedkv.op_backends")(cache)[table[0][0]]) == "mybackend"


def test_create_legacy_entry_names_its_adapter_by_tag(table):
    # [op, tag, func]: the format of libraries compiled before adapter kinds; its tag names the adapter
    legacy = [[op, tag, *rest] for op, tag, _adapter, *rest in table]
    _create(CFG.to_json(), legacy)
    legacy[0][1] = "nosuchbackend"
    with pytest.raises(Exception, match="unknown adapter kind 'nosuchbackend'"):
        _create(CFG.to_json(), legacy)


def test_create_newer_schema(table):
    d = json.loads(CFG.to_json())
    d["schema_version"] = 99
    with pytest.raises(Exception, match=num(99)):
        _create(json.dumps(d), table)


def test_create_unknown_config_field(table):
    d = json.loads(CFG.to_json())
    d["bogus_field_xyz"] = 1
    with pytest.raises(Exception, match="bogus_field_xyz"):
        _create(json.dumps(d), table)


def test_create_bad_config_value(table):
    d = json.loads(CFG.to_json())
    d["rope_mode"] = "sideways"
    with pytest.raises(Exception, match="sideways"):
        _create(json.dumps(d), table)


def test_create_field_both_given_and_runtime(table):
    d = json.loads(CFG.to_json())
    d["runtime_fields"] = ["max_batch_size"]  # still present in the JSON as well
    with pytest.raises(Exception, match="max_batch_size"):
        _create(json.dumps(d), table, (2,))


def test_create_missing_runtime_value(table):
    with pytest.raises(Exception, match="max_batch_size"):
        _create(CFG.to_json(runtime_fields=("max_batch_size",)), table, ())


def test_create_python_unknown_backend():
    with pytest.raises(ValueError, match="nosuchbackend"):
        pagedkv.create(CFG, backend="nosuchbackend")


def test_clear_abandons_open_forward(runner):
    """clear is allowed inside a forward and abandons it (no forward is open afterwards)."""
    c = runner.cache
    runner.ref.begin_forward([0, 1], [2, 1])
    c.begin_forward([0, 1], [2, 1])
    runner.ref.clear()
    c.clear()
    check_state(c, runner.ref, "after clear inside a forward")
    assert c.num_available_pages == NUM_PAGES
    rejects(runner, lambda: c.attention_with_fused_qkv(0, _qkv(3), 0.1), r"forward")
    runner.run([add(4), forward({4: 9}), check()], "after clear")
