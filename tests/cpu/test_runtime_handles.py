"""Every raw ``pagedkv.*`` global survives a bad object argument: ``None`` or an object of the wrong type in
any slot raises a ``TypeError`` naming the global and the argument, and never crashes the process.

The globals are enumerated from tvm-ffi's registry (so a new global is covered without editing this file);
each publishes its argument names (metadata ``arg_names``) next to tvm-ffi's ``type_schema``, from which
plausible values for the other arguments are built. All calls run in one subprocess, which announces each
call before making it, so a crash names the call that caused it; the run is then repeated without that call
to find further crashes. Calls that are expected to raise run in subprocesses too: a regression must fail
the test, not kill pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pagedkv._lib import load_runtime

# The child process: a real cache (its kernels are no-op functions: no call gets past its arguments), then
# for every global, every argument slot and both bad values (None, a wrong object) one call, announced on
# stdout before it is made and reported after it.
_CHILD = textwrap.dedent(r"""
    import json, sys
    import torch, tvm, tvm_ffi  # tvm: the runtime globals the cache allocates with
    from pagedkv import KVCacheConfig, ops
    from pagedkv._lib import get_global, load_runtime

    load_runtime()
    cfg = KVCacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=8, dtype="float32",
                        page_size=4, max_batch_size=1, max_total_seq_len=16, prefill_chunk_size=8)
    noop = tvm_ffi.convert(lambda *args: None)
    table = [[op, "tir", noop] for op in ops.OPS_BY_KIND["mha"]]
    cache = get_global("pagedkv.create")(cfg.to_json(), (), table, tvm_ffi.from_dlpack(torch.zeros(1)))
    tensor = tvm_ffi.from_dlpack(torch.zeros(1, 2, 8))
    plausible = {"pagedkv.PagedKVCache": cache, "ffi.Tensor": tensor, "ffi.Shape": (0,), "ffi.Array": [],
                 "ffi.String": cfg.to_json(), "int": 0, "float": 1.0, "bool": False}

    def emit(**record):
        print(json.dumps(record), flush=True)

    skip = [tuple(case) for case in json.loads(sys.argv[2])]  # calls that crashed an earlier run
    for name in json.loads(sys.argv[1]):
        meta = tvm_ffi.get_global_func_metadata(name)
        params = [p["type"] for p in json.loads(meta["type_schema"])["named_args"]["params"]]
        arg_names = list(meta.get("arg_names", []))
        if len(arg_names) != len(params):
            emit(name=name, setup=f"metadata arg_names {arg_names} does not name the parameters {params}")
            arg_names = [f"#{i}" for i in range(len(params))]  # still called: it must not crash
        unknown = sorted({t for t in params if t not in plausible})
        if unknown:
            emit(name=name, setup=f"no plausible value for parameter types {unknown}: add them to the test")
            continue
        func = get_global(name)
        for slot, (arg, kind) in enumerate(zip(arg_names, params)):
            wrong = tensor if kind == "pagedkv.PagedKVCache" else cache
            for bad_name, bad in (("None", None), ("wrong", wrong)):
                if (name, arg, bad_name) in skip:
                    continue
                args = [plausible[t] for t in params]
                args[slot] = bad
                emit(start=[name, arg, bad_name])
                try:
                    func(*args)
                    emit(name=name, arg=arg, bad=bad_name, error=None, message="")
                except Exception as err:  # noqa: BLE001 (reported to the parent)
                    emit(name=name, arg=arg, bad=bad_name, error=type(err).__name__, message=str(err))
    emit(done=True)
""")


MAX_CRASHES = 5  # reported per run (each one costs a rerun of the child)


def _pagedkv_globals() -> list[str]:
    import tvm_ffi

    load_runtime()
    return sorted(n for n in tvm_ffi.registry.list_global_func_names() if n.startswith("pagedkv."))


def _run(code: str, *argv: str):
    """Runs ``code`` in a fresh interpreter; (records printed as JSON lines, return code, stderr)."""
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=180)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return records, proc.returncode, proc.stderr


def test_globals_are_enumerated():
    names = _pagedkv_globals()
    # the globals of docs/ARCHITECTURE.md exist (a sanity check that the enumeration sees the runtime)
    for expected in ("pagedkv.create", "pagedkv.add_sequence", "pagedkv.begin_forward", "pagedkv.config_json",
                     "pagedkv.attention_with_fused_qkv", "pagedkv.debug_set_mla_kv"):
        assert expected in names


def test_bad_object_arguments_raise_type_error_naming_them():
    names = _pagedkv_globals()
    crashes, skip = [], []
    while True:
        records, rc, stderr = _run(_CHILD, json.dumps(names), json.dumps(skip))
        if rc == 0 and records and records[-1].get("done"):
            break
        started = [r["start"] for r in records if "start" in r]
        if not started:
            pytest.fail(f"the child process died (return code {rc}) before its first call:\n{stderr[-3000:]}")
        crashes.append(f"{started[-1]} (return code {rc})")
        skip.append(started[-1])
        if len(crashes) == MAX_CRASHES:
            pytest.fail(f"crashes (stopped looking after {MAX_CRASHES}):\n" + "\n".join(crashes) +
                        f"\nthe last one's stderr:\n{stderr[-3000:]}")
    failures = [f"crash calling {c}" for c in crashes]
    failures += [f"{r['name']}: {r['setup']}" for r in records if "setup" in r]
    calls = [r for r in records if "bad" in r]
    for r in calls:
        arg, msg = r["arg"], r["message"]
        if r["error"] not in ("TypeError", "ValueError"):
            failures.append(f"{r['name']} with {r['bad']} as {arg!r}: {r['error'] or 'no error'}: {msg}")
        elif r["name"] not in msg or f"'{arg}'" not in msg:
            failures.append(f"{r['name']} with {r['bad']} as {arg!r}: message names neither: {msg}")
        elif r["bad"] == "None" and "None" not in msg:
            failures.append(f"{r['name']} with None as {arg!r}: message does not say None: {msg}")
    assert not failures, "\n".join(failures)
    # every global with an argument was called with both bad values in every slot
    import tvm_ffi

    takes_args = {n for n in names
                  if json.loads(tvm_ffi.get_global_func_metadata(n)["type_schema"])["named_args"]["params"]}
    assert {r["name"] for r in calls} == takes_args
    assert len(calls) == 2 * sum(1 for r in calls if r["bad"] == "None")


_MESSAGES_CHILD = textwrap.dedent(r"""
    import json
    import torch, tvm, tvm_ffi
    from pagedkv._lib import get_global

    tensor = tvm_ffi.from_dlpack(torch.zeros(1))
    calls = [("pagedkv.add_sequence", (None, 0)), ("pagedkv.add_sequence", (tensor, 0)),
             ("pagedkv.add_sequence", (None,)), ("pagedkv.create", ("{}", (), "x", tensor)),
             ("pagedkv.begin_forward", (None, (0,), (1,))), ("pagedkv.get_num_available_pages", (None,))]
    for name, args in calls:
        try:
            get_global(name)(*args)
            print(json.dumps({"error": None, "message": ""}), flush=True)
        except Exception as err:  # noqa: BLE001 (reported to the parent)
            print(json.dumps({"error": type(err).__name__, "message": str(err)}), flush=True)
""")


def test_messages():
    """The exact messages."""
    records, rc, stderr = _run(_MESSAGES_CHILD)
    assert rc == 0, f"the child process died (return code {rc}):\n{stderr[-3000:]}"
    assert [[r["error"], r["message"]] for r in records] == [
        ["TypeError", "pagedkv.add_sequence: argument 'cache' is None; expected a PagedKVCache"],
        ["TypeError", "pagedkv.add_sequence: argument 'cache' is of type ffi.Tensor; expected a PagedKVCache"],
        ["TypeError", "pagedkv.add_sequence takes 2 arguments (cache, seq_id), got 1"],
        ["TypeError", "pagedkv.create: argument 'op_table' is of type ffi.String; expected an array (list)"],
        ["TypeError", "pagedkv.begin_forward: argument 'cache' is None; expected a PagedKVCache"],
        ["TypeError", "pagedkv.get_num_available_pages: argument 'cache' is None; expected a PagedKVCache"],
    ]
