"""Errors that used to mislead (a NaN-fill overflow, a RoPE complaint without RoPE, "out of pages" for a
forward over the chunk limit, a bare ``std::bad_alloc``), now naming the argument, the value and the limit.

Each message is pinned; each failed call leaves the cache as it was (lengths, free pages, total length and
the k/v of every sequence, against the reference that never saw the call) and a following forward works
(``rejects`` / ``in_forward_rejects`` of ``test_errors``).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import pagedkv
from pagedkv import KVCacheConfig, ops
from pagedkv.backends import NoBackendError, resolve
from pagedkv.cache import kernel_shape
from pagedkv.testing.scenarios import SCENARIOS, ScenarioRunner, add, check, forward
from test_errors import CFG, WIDTH, _qkv, assert_same, in_forward_rejects, rejects, runner, snapshot  # noqa: F401


def raises(kind, call):
    """``call`` wrapped so that an exception other than ``kind`` fails the test outright (``rejects`` then
    checks the message and the cache state)."""
    def run():
        try:
            call()
        except Exception as err:
            if not isinstance(err, kind):
                pytest.fail(f"{type(err).__name__} instead of {kind.__name__}: {err}")
            raise
    return run


def must_be(method: str, name: str, got: str, dtype: str = "float32", why: str = "the cache's dtype") -> str:
    return re.escape(f"{method}: '{name}' must be a torch.Tensor of dtype {dtype} ({why}) on cpu, got {got}")


def shaped(method: str, name: str, spec: str, got) -> str:
    return re.escape(f"{method}: '{name}' must have shape [{spec}], got {list(got)}")


# -- 1. tensor arguments of the Python wrapper --------------------------------------------------------------
QKV_SPEC = "n, num_qo_heads + 2 * num_kv_heads = 8, head_dim = 64"


# every call runs inside a decode forward of sequences 0 and 1 (2 tokens), followed by one more forward
FWD = {0: 1, 1: 1}


def test_fused_qkv_argument(runner):
    c, m = runner.cache, "attention_with_fused_qkv"
    bad = [(TypeError, _qkv(2).to(torch.int32), must_be(m, "qkv", "int32")),  # was: a NaN-fill overflow
           (TypeError, _qkv(2).numpy(), must_be(m, "qkv", "numpy.ndarray")),  # was: torch.full's TypeError
           (TypeError, None, must_be(m, "qkv", "None")),  # was: an AttributeError
           (TypeError, [[0.0]], must_be(m, "qkv", "list")),
           (ValueError, torch.empty(2, WIDTH, 64, device="meta"), must_be(m, "qkv", "a tensor on meta")),
           (ValueError, _qkv(2, width=11), shaped(m, "qkv", QKV_SPEC, (2, 11, 64))),
           (ValueError, torch.randn(2, WIDTH * 64), shaped(m, "qkv", QKV_SPEC, (2, WIDTH * 64)))]
    for kind, qkv, pattern in bad:
        in_forward_rejects(runner, FWD, raises(kind, lambda: c.attention_with_fused_qkv(1, qkv, 0.1)), pattern)


def test_self_attention_arguments(runner):
    c, m = runner.cache, "self_attention"
    q, kv = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    for kind, args, pattern in [
            (TypeError, (q.to(torch.int32), kv, kv), must_be(m, "q", "int32")),
            (TypeError, (q, kv.numpy(), kv), must_be(m, "k", "numpy.ndarray")),
            (TypeError, (q, kv, None), must_be(m, "v", "None")),
            (TypeError, (q, kv, kv.double()), must_be(m, "v", "float64")),
            (ValueError, (q, kv[:1], kv), shaped(m, "k", "n = 2, num_kv_heads = 2, head_dim = 64", (1, 2, 64))),
            (ValueError, (q, kv, torch.randn(2, 4, 64)),
             shaped(m, "v", "n = 2, num_kv_heads = 2, v_head_dim = 64", (2, 4, 64)))]:
        in_forward_rejects(runner, FWD, raises(kind, lambda: c.self_attention(0, *args, 0.1)), pattern)


def test_cross_attention_arguments(runner):
    c, m = runner.cache, "cross_attention"
    q = torch.randn(2, 4, 64)
    in_forward_rejects(runner, FWD, raises(TypeError, lambda: c.cross_attention(0, None, 0.1)), must_be(m, "q", "None"))
    in_forward_rejects(runner, FWD, raises(TypeError, lambda: c.cross_attention(0, q.half(), 0.1)),
                       must_be(m, "q", "float16"))
    in_forward_rejects(runner, FWD, raises(ValueError, lambda: c.cross_attention(0, q[:, :2], 0.1)),
                       shaped(m, "q", "n, num_qo_heads = 4, head_dim = 64", (2, 2, 64)))


def test_merge_and_debug_set_arguments(runner):
    c = runner.cache
    o, lse = torch.randn(3, 4, 64), torch.randn(3, 4)
    m = "merge_attn_output_inplace"
    lse_kind = dict(dtype="float32", why="lse is always float32")
    for kind, args, pattern in [
            (TypeError, (o, lse.half(), o, lse), must_be(m, "lse_a", "float16", **lse_kind)),
            (TypeError, (o, lse, None, lse), must_be(m, "o_b", "None")),
            (ValueError, (o, lse, o[:, :, :32], lse), shaped(m, "o_b", "n = 3, num_qo_heads = 4, Dv = 64", (3, 4, 32))),
            (ValueError, (o, lse, o, lse[:2]), shaped(m, "lse_b", "n = 3, num_qo_heads = 4", (2, 4)))]:
        before = [t.clone() for t in args if isinstance(t, torch.Tensor)]
        rejects(runner, raises(kind, lambda: c.merge_attn_output_inplace(*args)), pattern)
        assert all(torch.equal(a, b) for a, b in zip(before, [t for t in args if isinstance(t, torch.Tensor)]))
    kv = torch.randn(CFG.num_layers, 2, CFG.num_kv_heads, CFG.head_dim)
    m = "debug_set_kv"
    rejects(runner, raises(TypeError, lambda: c.debug_set_kv(0, 0, kv.numpy(), kv)), must_be(m, "k", "numpy.ndarray"))
    rejects(runner, raises(TypeError, lambda: c.debug_set_kv(0, 0, kv, None)), must_be(m, "v", "None"))
    rejects(runner, raises(ValueError, lambda: c.debug_set_kv(0, 0, kv, kv[:, :1])),
            shaped(m, "v", "num_layers = 2, m = 2, num_kv_heads = 2, head_dim = 64", (2, 1, 2, 64)))


# -- 2. odd head dims -----------------------------------------------------------------------------------------
ODD = KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=31, dtype="float32", rope_mode="none",
                    page_size=8, max_batch_size=8, max_total_seq_len=128, prefill_chunk_size=64)
PV_REASON = "needs an even value head dim (it accumulates P @ V in pairs of value columns), got"


def test_odd_head_dim_kernel_shape_keeps_the_rope_mode_out():
    # kernel_shape rebuilt the config with the default rope_mode ("normal") and so rejected every odd head dim
    assert kernel_shape(ODD).head_dim == 31
    even = ODD.replace(head_dim=32)
    assert {kernel_shape(even.replace(rope_mode=m)) for m in ("none", "normal", "inline")} == {kernel_shape(even)}


def test_odd_head_dim_mha_refused_for_the_real_reason():
    """The TIR CPU attention kernels accumulate P @ V in column pairs, so an odd MHA head dim (V has it too)
    cannot be served; the reason says so (not RoPE, which this config does not use)."""
    with pytest.raises(NoBackendError) as info:
        pagedkv.create(ODD, backend="tir")
    assert f"TIR CPU attn_prefill_ragged {PV_REASON} v_head_dim 31" in str(info.value)
    assert "RoPE" not in str(info.value)
    tir = pagedkv.backends.get_backend("tir")
    for op in (ops.ATTN_PREFILL_PAGED, ops.ATTN_DECODE_PAGED):
        assert tir.validate_configuration(op, ODD, "llvm") == [f"TIR CPU {op} {PV_REASON} head_dim 31"]
    for op in (ops.SPLIT_ROTARY, ops.APPEND_KV, ops.GATHER_KV, ops.COPY_PAGE, ops.MERGE_STATE):
        assert tir.validate_configuration(op, ODD, "llvm") == []  # these kernels take any head dim
    from pagedkv.tir_kernels import KernelSpec, make_attn_decode_paged

    spec = KernelSpec(4, 2, 31)  # the spec is target-neutral; the CPU kernel states its own limit
    with pytest.raises(ValueError, match=re.escape("value head dim 31 is odd; the CPU attention kernels "
                                                   "accumulate P @ V in pairs of value columns")):
        make_attn_decode_paged(spec, "llvm")


@pytest.mark.parametrize("mode", ["normal", "inline"])
def test_odd_head_dim_with_rope_is_a_config_error(mode):
    expected = (f"RoPE (rope_mode '{mode}') rotates the two halves of a head and needs an even head_dim, "
                "got 31; an odd head_dim takes rope_mode 'none'")
    with pytest.raises(ValueError, match=re.escape(expected)):
        ODD.replace(rope_mode=mode)
    d = ODD.to_dict()
    d["rope_mode"] = mode
    with pytest.raises(ValueError, match=re.escape("pagedkv config: " + expected)):
        _raw_create(json.dumps(d))


def test_odd_mla_qk_head_dim_is_served(make_cache, gen):
    """MLA's self-attention has no RoPE in the kernels and its value dims are even: an odd qk head dim
    (nope 31 + rope 32) used to be refused ("head_dim must be even for RoPE") and now matches the reference."""
    cfg = KVCacheConfig.mla(num_layers=1, num_heads=3, kv_lora_rank=64, qk_nope_head_dim=31, qk_rope_head_dim=32,
                            v_head_dim=48, dtype="float32", page_size=8, max_batch_size=8, max_total_seq_len=128,
                            prefill_chunk_size=64)
    r = ScenarioRunner(make_cache(cfg, "tir"), gen, 0.1)
    for name in ("mixed_prefill_decode", "shared_prefix_adjacent"):
        r.cache.clear()
        r.ref.clear()
        r.run(SCENARIOS[name](cfg.page_size), name)


@pytest.mark.parametrize("dims,reason", [
    (dict(kv_lora_rank=64, v_head_dim=47), f"TIR CPU attn_prefill_ragged {PV_REASON} v_head_dim 47"),
    (dict(kv_lora_rank=63, v_head_dim=48), f"TIR CPU mla_attn_prefill_paged {PV_REASON} kv_lora_rank 63")])
def test_odd_mla_value_dims_refused(dims, reason):
    """These used to build and write o = 0 (the PV loop covers no column of an odd value dim)."""
    cfg = KVCacheConfig.mla(num_layers=1, num_heads=3, qk_nope_head_dim=32, qk_rope_head_dim=32, dtype="float32",
                            **dims)
    with pytest.raises(NoBackendError, match=re.escape(reason)):
        resolve(cfg, "llvm", "tir")


# -- 3. the chunk limit before the page budget -------------------------------------------------------------
def chunk_message(total, limit: int) -> str:
    return re.escape(f"pagedkv: begin_forward appends {total} tokens in total (the sum of append_lengths), more "
                     f"than prefill_chunk_size={limit} (the most tokens one forward takes)")


def test_over_chunk_size_and_out_of_pages_reports_the_chunk(runner):
    c = runner.cache
    runner.run([forward({0: 14}), check()], "fill")  # 0: 24 tokens (3 pages), 1: 3 (1 page); 2 pages left
    assert runner.ref.num_available_pages == 2
    # 25 tokens: over prefill_chunk_size=24, and 0 would need 4 more pages
    rejects(runner, lambda: c.begin_forward([0], [25]), chunk_message(25, 24))
    rejects(runner, lambda: c.begin_forward([0, 1], [13, 12]), chunk_message(25, 24))
    rejects(runner, lambda: c.begin_forward([0, 1], [2**62, 2**62]), chunk_message(f"more than {2**63 - 1}", 24))
    # within the chunk, the page budget is what is reported
    left = runner.ref.num_available_pages
    rejects(runner, lambda: c.begin_forward([0], [24]), rf"out of pages: the forward needs \d+ new pages, {left} available",
            follow=False)


def test_129_tokens_over_a_chunk_of_128(make_cache, gen):
    cfg = CFG.replace(prefill_chunk_size=128, max_total_seq_len=64)  # 10 pages of 8: 129 tokens do not fit
    r = ScenarioRunner(make_cache(cfg, "tir"), gen, 0.11)
    r.run([add(0), add(1), forward({0: 5, 1: 2})], "setup")
    rejects(r, lambda: r.cache.begin_forward([0], [129]), chunk_message(129, 128))
    rejects(r, lambda: r.cache.begin_forward([0, 1], [100, 29]), chunk_message(129, 128))


# -- 4. sizes the device cannot hold ------------------------------------------------------------------------
def _raw_create(config_json: str):
    """``pagedkv.create`` with no-op kernels (nothing here runs one)."""
    import tvm_ffi

    from pagedkv._lib import get_global

    noop = tvm_ffi.convert(lambda *args: None)
    table = [[op, "tir", noop] for op in ops.OPS_BY_KIND["mha"]]
    return get_global("pagedkv.create")(config_json, (), table, tvm_ffi.from_dlpack(torch.zeros(1)))


def _cache_bytes(cfg: KVCacheConfig, max_total_seq_len: int) -> tuple[int, int, int, int]:
    """(pages, page bytes, pages of all layers, work buffers) as the runtime computes them."""
    elem = {"float32": 4, "float16": 2, "bfloat16": 2}[cfg.dtype]
    pages = -(-max_total_seq_len // cfg.page_size) + cfg.max_batch_size
    page = 2 * cfg.num_kv_heads * cfg.page_size * cfg.head_dim * elem
    n, hq = cfg.prefill_chunk_size, cfg.num_qo_heads
    work = (n * hq * cfg.head_dim + 2 * n * cfg.num_kv_heads * cfg.head_dim + n * hq * cfg.head_dim) * elem
    return pages, page, cfg.num_layers * pages * page, work + n * hq * 8


def test_absurd_max_total_seq_len(runner):
    before = snapshot(runner.cache, [0, 1])
    # Python: the int32 slot indices of the kernel ABI
    with pytest.raises(ValueError, match=re.escape(
            "max_total_seq_len=1099511627776 with page_size=8 and max_batch_size=2 needs 137438953474 pages = "
            "1099511627792 token slots; slot indices are int32 in the kernel ABI (at most 2147483647)")):
        CFG.replace(max_total_seq_len=2**40)
    # the runtime (a library's JSON is not validated by Python): the bytes, before anything is allocated
    d = CFG.to_dict()
    d["max_total_seq_len"] = 2**40
    pages, page, all_pages, work = _cache_bytes(CFG, 2**40)
    assert (pages, page, all_pages + work) == (137438953474, 8192, 2251799813792512)
    expected = (f"pagedkv: the cache needs {all_pages + work} bytes (2.0 PiB) of device memory, more than "
                f"device(1, 0) holds (")
    detail = (f": pages 2 layers x {pages} pages x 8192 bytes (8.0 KiB) = {all_pages} bytes (2.0 PiB) "
              f"(max_total_seq_len=1099511627776, page_size=8, max_batch_size=2), work buffers {work} bytes "
              "(72.8 KiB) (prefill_chunk_size=24)")
    with pytest.raises(ValueError) as info:
        _raw_create(json.dumps(d))
    msg = str(info.value)
    assert msg.startswith(expected) and msg.endswith(detail), msg
    assert "bad_alloc" not in msg
    d["max_total_seq_len"] = 2**62  # the sizes overflow 64 bits
    with pytest.raises(ValueError, match=r"needs over 2\^64 bytes of device memory, more than device\(1, 0\)"):
        _raw_create(json.dumps(d))
    # the cache in use is untouched and keeps working
    assert_same(before, snapshot(runner.cache, [0, 1]))
    runner.run([forward({0: 3, 1: 1}), forward({0: 1, 1: 1}), check()], "after the failed creates")


def test_bfloat16_cache_in_the_runtime():
    """A bf16 cache: its pages are 2-byte elements (the size check counts them so), its pages and work
    buffers are bf16 tensors, and a tensor of another dtype handed to a global is refused naming the
    argument, the dtype expected and the one given."""
    import tvm  # noqa: F401 (registers runtime.GetDeviceAttr: the size check reads the device's memory)

    from pagedkv._lib import get_global

    cfg = CFG.replace(dtype="bfloat16")
    d = cfg.to_dict()
    d["max_total_seq_len"] = 2**40
    pages, page, all_pages, work = _cache_bytes(cfg, 2**40)
    assert page == 4096  # half of the float32 page of test_absurd_max_total_seq_len
    with pytest.raises(ValueError, match=re.escape(f"x {pages} pages x 4096 bytes (4.0 KiB) = {all_pages} bytes")):
        _raw_create(json.dumps(d))
    cache = _raw_create(cfg.to_json())
    get_global("pagedkv.add_sequence")(cache, 0)
    get_global("pagedkv.begin_forward")(cache, (0,), (2,))
    qkv = torch.zeros(2, WIDTH, cfg.head_dim, dtype=torch.float16)
    o = torch.zeros(2, cfg.num_qo_heads, cfg.head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape(
            f"pagedkv: tensor 'qkv' expected [2, {WIDTH}, {cfg.head_dim}] bfloat16 on device(1, 0), given "
            f"[2, {WIDTH}, {cfg.head_dim}] float16 on device(1, 0)")):
        get_global("pagedkv.attention_with_fused_qkv")(cache, 0, 0.1, qkv, o)
    k = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float32)
    with pytest.raises(ValueError, match=re.escape("pagedkv: tensor 'k_out' expected") + ".* bfloat16 .* float32"):
        get_global("pagedkv.debug_get_kv")(cache, 0, 0, 2, k, k.clone())


def test_slots_beyond_int32_in_the_runtime():
    """Small pages in bytes, but more token slots than int32 indexes: refused before allocating."""
    import tvm

    small = KVCacheConfig(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=1, dtype="float16",
                          rope_mode="none", page_size=2**16, max_total_seq_len=2**16, prefill_chunk_size=1)
    d = small.to_dict()
    d["max_total_seq_len"] = 2**31 - 2**16 + 1  # 2**15 pages + 1 per sequence: 2**31 + 2**16 slots
    needed = sum(_cache_bytes(small, d["max_total_seq_len"])[2:])  # about 8.6 GB
    if tvm.cpu().total_global_memory < needed:
        pytest.skip(f"this host's memory is under the {needed} bytes the cache needs (the memory check comes first)")
    with pytest.raises(ValueError, match=re.escape(
            "pagedkv: max_total_seq_len=2147418113 with page_size=65536 and max_batch_size=1 needs 32769 pages of "
            "65536 token slots; slot indices are int32 in the kernel ABI, so a cache holds at most 2147483647 "
            "slots")):
        _raw_create(json.dumps(d))

