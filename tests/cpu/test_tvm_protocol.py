"""TVM's KV-state protocol on a pagedkv cache: the ``vm.builtin.kv_state_*`` / ``attention_kv_cache_*`` globals of
libtvm_runtime drive it unchanged (README, "Drop-in for TVM's KV-state protocol").

- Conformance: the scenarios of apache-tvm 0.27's CPU paged-KV-cache test (``pagedkv.testing.tvm_protocol``:
  add / fork / popn / remove, chunked and batched prefill, decode, token chains with commits), every call through
  ``vm.builtin.*``, every layer's output and every cached K / V against a PyTorch reference, on four kernel
  shapes of the scenario suite (float32 / float16, RoPE none / normal / inline, head dims 64 / 128: kernels shared).
  The scenarios pagedkv refuses are listed as skips with the reason.
- Refusals: each unsupported method raises NotImplementedError "not supported by pagedkv: <what>" and leaves the
  cache as it was.
- Misuse: every protocol global called with a wrong or None argument in a subprocess (no crash);
  test_tvm_protocol_misuse.py runs test_misuse_property.py's state machine through the protocol.
- Models: a Relax module written for TVM's cache (spec object type and method calls TVM's) compiles with only its
  constructor changed to pagedkv's and runs through ``vm.builtin.*``; SmolLM2 greedy generation by an engine that
  calls only ``vm.builtin.*`` equals transformers' (the library ``test_smollm2.py`` compiles, shared).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedkv.testing.shapes import SHAPES
from pagedkv.testing.tvm_protocol import (TVM_SCENARIOS, UNSUPPORTED_SCENARIOS, Builtins, ConformanceDriver,
                                          conformance_capacity, refused_calls, shape)

#: h4x4-d64-f32-p16-none, h6x2-d64-f16-p8-normal, h7x1-d128-f32-p8-normal, h4x4-d128-f16-p8-inline
CONFORMANCE_SHAPES = [SHAPES[0], SHAPES[2], SHAPES[7], SHAPES[1]]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The reference's tensors are small: torch's worker threads only contend with the TVM runtime's thread pool,
    which spins after each kernel (this module took 50 s on two cores with two torch threads, 5 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def conformance_cache():
    """One cache per shape for the module (TVM's tests also share one per config, clearing it first)."""
    import pagedkv

    made = {}

    def get(s):
        if s not in made:
            made[s] = pagedkv.create(conformance_capacity(s.config()), backend="tir", target="llvm", poison=True)
        return made[s]

    return get


@pytest.mark.parametrize("scenario", list(TVM_SCENARIOS))
@pytest.mark.parametrize("s", CONFORMANCE_SHAPES, ids=[s.id for s in CONFORMANCE_SHAPES])
def test_tvm_scenario(s, scenario, conformance_cache, gen):
    cache = conformance_cache(s)
    driver = ConformanceDriver(cache.handle, cache.config, gen)
    driver.clear()
    TVM_SCENARIOS[scenario](driver)


@pytest.mark.parametrize("scenario", list(UNSUPPORTED_SCENARIOS))
def test_tvm_scenario_not_supported(scenario):
    pytest.skip(f"not supported by pagedkv: {UNSUPPORTED_SCENARIOS[scenario]}")


# -------------------------------------------------------------------------------------------------------------
# Refusals
# -------------------------------------------------------------------------------------------------------------


def test_refused_features_raise_and_change_nothing(conformance_cache, gen):
    """Each feature pagedkv does not implement raises NotImplementedError "not supported by pagedkv: <what>"
    (naming the protocol method) before changing anything: the cache then runs on as if the call had not been
    made."""
    cache = conformance_cache(CONFORMANCE_SHAPES[1])
    d = ConformanceDriver(cache.handle, cache.config, gen)
    d.clear()
    d.apply([(0, 11), (1, 3)])
    pages = d.f.get_num_available_pages(cache.handle)
    tensor = torch.zeros(1)
    import tvm_ffi

    for what, call in refused_calls(d.f, cache.handle, 0, tvm_ffi.from_dlpack(tensor)).items():
        with pytest.raises(NotImplementedError, match="not supported by pagedkv: " + what.replace("(", r"\(")
                           .replace(")", r"\)")):
            call()
        assert d.f.get_num_available_pages(cache.handle) == pages, what
    d.verify()
    d.apply([(0, 1), (1, 4)])  # no forward was left open, no length changed


def test_sliding_window_request_for_the_configs_window(make_cache, gen):
    """A windowed cache (the config's ``sliding_window``, Mistral's) takes an engine's request for exactly its window
    without a sink as a no-op (with the config's sink_size, exactly those sink tokens); another window or any other
    attention sink is refused naming it."""
    f = Builtins.load()
    cache = make_cache(SHAPES[8].config())  # h4x1-d64-f32-p8-normal-w13
    h = cache.handle
    f.add_sequence(h, 5)
    f.enable_sliding_window_for_seq(h, 5, 13, 0)
    with pytest.raises(NotImplementedError, match="attention sinks .*4.*pagedkv's window keeps no sink"):
        f.enable_sliding_window_for_seq(h, 5, 13, 4)
    with pytest.raises(NotImplementedError, match="a sliding window of 12 on a cache compiled with sliding_window=13"):
        f.enable_sliding_window_for_seq(h, 5, 12, 0)
    with pytest.raises(ValueError, match="unknown sequence id 6"):
        f.enable_sliding_window_for_seq(h, 6, 13, 0)
    # with the config's sink tokens (sink_size, the same kernels): exactly them, and no other sink
    h = make_cache(SHAPES[8].config().replace(sink_size=4)).handle
    f.add_sequence(h, 5)
    f.enable_sliding_window_for_seq(h, 5, 13, 4)
    with pytest.raises(NotImplementedError, match=r"sink of 0\): pagedkv's window keeps the config's sink_size=4"):
        f.enable_sliding_window_for_seq(h, 5, 13, 0)


# -------------------------------------------------------------------------------------------------------------
# Misuse through the protocol (the state machine is test_tvm_protocol_misuse.py)
# -------------------------------------------------------------------------------------------------------------

#: TVM's wrappers that take the cache as a nullable reference and call it without a check (src/runtime/vm/
#: kv_state.cc: the `.def` lambdas and begin_forward's packed function): None as their cache dereferences null
#: inside libtvm_runtime, with TVM's own cache too, before pagedkv is reached. Left out of the battery; listed in
#: the README.
TVM_NONE_CACHE_CRASHES = frozenset({
    "vm.builtin.kv_state_begin_forward", "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
    "vm.builtin.attention_kv_cache_self_attention", "vm.builtin.attention_kv_cache_cross_attention",
    "vm.builtin.attention_kv_cache_attention_with_shared_kv", "vm.builtin.attention_kv_cache_append_mla_kv",
    "vm.builtin.attention_kv_cache_merge_attn_output_inplace"})

# The child: a cache whose kernels are no-ops (nothing compiled), then every protocol global (those whose first
# parameter is a KVState or an AttentionKVCache, and begin_forward by hand) called with each argument in turn
# None or an object of the wrong type, outside and inside an open forward; each call announced before it is made.
_BATTERY_CHILD = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    import tvm_ffi
    from pagedkv import KVCacheConfig, ops
    from pagedkv._lib import get_global, load_runtime
    from pagedkv.runtime import load_tvm_runtime

    # pagedkv's runtime first, then TVM's alone (no compiler, no torch), as load_library(host_only=True) does: the
    # protocol's type keys are registered by pagedkv's library, and libtvm_runtime's globals accept its cache
    load_runtime()
    load_tvm_runtime()
    tvm_ffi.register_error("InternalError", type("InternalError", (RuntimeError,), {}))  # TVM's ICHECKs
    cfg = KVCacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=8, dtype="float32",
                        page_size=4, max_batch_size=2, max_total_seq_len=16, prefill_chunk_size=8)
    noop = tvm_ffi.convert(lambda *args: None)
    cache = get_global("pagedkv.create")(cfg.to_json(), (), [[op, "tir", noop] for op in ops.OPS_BY_KIND["mha"]],
                                         tvm_ffi.from_dlpack(np.zeros(1, "float32")))
    g = tvm_ffi.get_global_func
    g("vm.builtin.kv_state_add_sequence")(cache, 0)
    tensor = tvm_ffi.from_dlpack(np.zeros((1, 2, 8), "float32"))
    plausible = {"relax.vm.KVState": cache, "relax.vm.AttentionKVCache": cache, "int": 0, "float": 1.0,
                 "ffi.Tensor": tensor, "ffi.Shape": tvm_ffi.Shape((0,)), "ffi.String": "{}"}
    skip_none_cache = set(json.loads(sys.argv[1]))

    def emit(**record):
        print(json.dumps(record), flush=True)

    def call(name, args, what):
        emit(start=[name, what])
        try:
            g(name)(*args)
            emit(name=name, what=what, error=None, message="")
        except Exception as err:  # noqa: BLE001 (reported to the parent)
            emit(name=name, what=what, error=type(err).__name__, message=str(err))

    names = sorted(n for n in tvm_ffi.registry.list_global_func_names() if n.startswith("vm.builtin."))
    for forward in (False, True):
        if forward:
            g("vm.builtin.kv_state_begin_forward")(cache, tvm_ffi.Shape((0,)), tvm_ffi.Shape((1,)))
        for name in names:
            schema = json.loads((tvm_ffi.get_global_func_metadata(name) or {}).get("type_schema") or "{}")
            params = [a["type"] for a in schema.get("args", [])[1:]]
            if not params or params[0] not in ("relax.vm.KVState", "relax.vm.AttentionKVCache"):
                continue
            for slot, kind in enumerate(params):
                wrong = tensor if slot == 0 else cache
                for bad_name, bad in (("None", None), ("wrong", wrong)):
                    if slot == 0 and bad is None and name in skip_none_cache:
                        continue
                    args = [plausible[t] for t in params]
                    args[slot] = bad
                    call(name, args, f"{bad_name} as #{slot} ({kind}), forward={forward}")
        s = tvm_ffi.Shape
        for what, args in [("None seq_ids", (cache, None, s((1,)))), ("None lengths", (cache, s((0,)), None)),
                           ("a tensor as the tree", (cache, s((0,)), s((1,)), tensor)),
                           ("two arguments", (cache, s((0,)))), ("five arguments", (cache, s((0,)), s((1,)), None, 0))]:
            call("vm.builtin.kv_state_begin_forward", args, f"{what}, forward={forward}")
        get_global("pagedkv.abort_forward")(cache)
    emit(done=True)
""")


def test_bad_arguments_through_the_protocol_never_crash():
    """Every protocol global with None or a wrong object in each argument slot raises a typed error (TVM's own
    conversion's TypeError, or pagedkv's check: None where a tensor is due is a TypeError naming it) and never
    crashes the process, outside and inside a forward. A crash fails the test naming the call."""
    proc = subprocess.run([sys.executable, "-c", _BATTERY_CHILD, json.dumps(sorted(TVM_NONE_CACHE_CRASHES))],
                          capture_output=True, text=True, timeout=180)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    started = [r["start"] for r in records if "start" in r]
    assert proc.returncode == 0 and records and records[-1].get("done"), (
        f"the child died (return code {proc.returncode}) at {started[-1:] or 'start'}:\n{proc.stderr[-3000:]}")
    calls = [r for r in records if "what" in r]
    # InternalError: TVM's own argument-count check of begin_forward (an ICHECK), a RuntimeError under `import tvm`
    typed = {"TypeError", "ValueError", "RuntimeError", "NotImplementedError", "IndexError", "KeyError",
             "InternalError"}
    untyped = [f"{r['name']} with {r['what']}: {r['error']}: {r['message']}" for r in calls
               if r["error"] is not None and r["error"] not in typed]
    assert not untyped, "\n".join(untyped)
    # None in a tensor slot inside the forward reaches pagedkv's check, which names the tensor
    nones = [r for r in calls if r["what"].startswith("None") and "ffi.Tensor" in r["what"] and "True" in r["what"]
             and r["error"] == "TypeError" and "is None; expected a tensor" in r["message"]]
    assert len(nones) >= 5, [r for r in calls if "ffi.Tensor" in r["what"] and "True" in r["what"]]
    assert len(calls) > 150


# -------------------------------------------------------------------------------------------------------------
# Models
# -------------------------------------------------------------------------------------------------------------

#: The module below: one attention layer on test_errors.py's kernel shape (4 / 2 heads of 64, float32, normal RoPE).
TINY = dict(hq=4, hkv=2, d=64, hidden=16)


def _tvm_style_module():
    """An ``nn.Module`` written for TVM's cache: its spec's object type and its attention call are
    ``tvm.relax.frontend.nn.llm.PagedKVCache``'s (so the compiled function calls
    ``vm.builtin.attention_kv_cache_attention_with_fused_qkv``), ``create_paged_kv_cache`` has TVM's / MLC's five
    arguments; only the constructor in it is pagedkv's."""
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op
    from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache as TVMPagedKVCache

    import pagedkv.relax
    from pagedkv import KVCacheConfig

    hq, hkv, d, hidden = TINY["hq"], TINY["hkv"], TINY["d"], TINY["hidden"]

    class OneAttentionLayer(nn.Module):
        def __init__(self):
            self.w_qkv = nn.Parameter(((hq + 2 * hkv) * d, hidden), "float32")

        def create_paged_kv_cache(self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
                                  support_sliding_window) -> TVMPagedKVCache:
            config = KVCacheConfig(num_layers=1, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype="float32",
                                   rope_mode="normal")
            return pagedkv.relax.PagedKVCache(  # the one changed line
                config, target="llvm", backend="tir",
                runtime_values={"max_batch_size": max_batch_size, "max_total_seq_len": max_total_seq_len,
                                "prefill_chunk_size": prefill_chunk_size, "page_size": page_size})

        def forward(self, x, paged_kv_cache: TVMPagedKVCache):
            b, s, _ = x.shape
            qkv = op.reshape(op.matmul(x, op.permute_dims(self.w_qkv)), (b, s, hq + 2 * hkv, d))
            return paged_kv_cache.attention_with_fused_qkv(0, qkv, hq, d ** -0.5), paged_kv_cache

        def get_default_spec(self):
            return nn.spec.ModuleSpec.from_raw({
                "forward": {"x": nn.spec.Tensor(["b", "s", hidden], "float32"),
                            "paged_kv_cache": nn.spec.Object(object_type=TVMPagedKVCache),
                            "$": {"param_mode": "packed", "effect_mode": "none"}},
                "create_paged_kv_cache": {"max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int,
                                          "page_size": int, "support_sliding_window": int,
                                          "$": {"param_mode": "none", "effect_mode": "none"}}}, self)

    return OneAttentionLayer()


def test_module_written_for_tvms_cache_runs_on_pagedkv(gen):
    """The module above compiles with ``tvm.compile`` and runs a batched prefill (two sequences) and a decode step
    with its cache managed through ``vm.builtin.*`` alone; outputs equal the reference attention."""
    import tvm
    import tvm_ffi
    from tvm import relax

    from pagedkv.testing.tvm_protocol import causal_attention, rope

    model = _tvm_style_module()
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    assert "vm.builtin.attention_kv_cache_attention_with_fused_qkv" in mod.script()
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    f = Builtins.load()
    cache = vm["create_paged_kv_cache"](*[tvm_ffi.Shape((v,)) for v in (4, 256, 64, 16, 0)])  # MLC's call
    hq, hkv, d, hidden = TINY["hq"], TINY["hkv"], TINY["d"], TINY["hidden"]
    w = torch.randn(((hq + 2 * hkv) * d, hidden), generator=gen) * 0.2
    params = tvm_ffi.convert([tvm.runtime.tensor(w.numpy())])
    history = {0: [], 1: []}  # per sequence, its inputs so far

    def step(batch: dict[int, int], rows_cols: tuple[int, int]):
        x = torch.randn((*rows_cols, hidden), generator=gen)
        f.begin_forward(cache, shape(list(batch)), shape(list(batch.values())))
        out, _ = vm["forward"](tvm.runtime.tensor(x.numpy()), cache, params)
        f.end_forward(cache)
        rows, got = x.reshape(-1, hidden), torch.from_numpy(out.numpy()).reshape(-1, hq, d)
        start = 0
        for seq, n in batch.items():
            history[seq].append(rows[start:start + n])
            qkv = (torch.cat(history[seq]) @ w.T).reshape(-1, hq + 2 * hkv, d).double()
            pos = torch.arange(qkv.shape[0])
            q, k = rope(qkv[:, :hq], pos, 10000.0, 1.0), rope(qkv[:, hq:hq + hkv], pos, 10000.0, 1.0)
            want = causal_attention(q[-n:], k, qkv[:, hq + hkv:], d ** -0.5)
            torch.testing.assert_close(got[start:start + n].double(), want, rtol=1e-4, atol=1e-4)
            start += n

    f.add_sequence(cache, 0)
    f.add_sequence(cache, 1)
    step({0: 5, 1: 9}, (1, 14))  # prefill: two sequences flattened into one row
    step({0: 1, 1: 1}, (2, 1))   # decode: a row per sequence
    assert f.get_total_sequence_length(cache) == 16
