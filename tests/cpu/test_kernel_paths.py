"""The CPU attention kernels (MHA and MLA) on every run-time code path, and the structure that keeps the
paths right.

Same rules as ``test_kernels.py`` (whose helpers this reuses): fresh random inputs, NaN-filled outputs and
spare page slots, float64 reference, relative error below 1e-5 (float32) / 1e-2 (float16).

Run: ``.venv/bin/python -m pytest tests/cpu/test_kernel_paths.py -q``
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import pytest
from test_kernels import _fresh_rng, run_decode_paged, run_prefill_paged, run_prefill_ragged, tk  # noqa: F401
from tvm import tirx

#: The forced thread paths every numerical test here runs (``auto`` picks one of them per call).
THREAD_PATHS = ("serial", "parallel")


def _stmts(stmt, out=None):
    """Every statement under ``stmt``, pre-order (0.27 TIR: flat ``SeqStmt`` bodies, ``Bind`` statements)."""
    out = [] if out is None else out
    out.append(stmt)
    for attr in ("body", "then_case", "else_case"):
        child = getattr(stmt, attr, None)
        if child is not None:
            _stmts(child, out)
    if isinstance(stmt, tirx.SeqStmt):
        for child in stmt.seq:
            _stmts(child, out)
    return out


def _loops(stmt) -> list:
    """Every ``For`` under ``stmt`` (itself included)."""
    return [s for s in _stmts(stmt) if isinstance(s, tirx.For)]


def _has_parallel_loop(stmt) -> bool:
    return any(f.kind == tirx.ForKind.PARALLEL for f in _loops(stmt))


# ---------------------------------------------------------------------------------------------------
# auto builds the default kernel; forced paths build exactly one path
# ---------------------------------------------------------------------------------------------------
#: Per CPU attention kernel: the family factory called directly with a spec (``family_cpu``), the op and
#: KernelSpec of the same kernel (the path through ``FACTORIES``), and its work threshold.
def _direct(factory, cfg):
    """The family factory called with ``cfg`` updated by the keyword options (paths, masking)."""
    return lambda **kw: factory(dataclasses.replace(cfg, **kw))


_CFGS = {"decode": tk.KernelSpec(8, 2, 64, 64, "float16"), "paged": tk.KernelSpec(4, 4, 128, 128, "float32"),
         "ragged": tk.KernelSpec(7, 1, 128, 64, "float32"),
         "mla_decode": tk.KernelSpec(16, 16, 192, 128, "float16", kv_lora_rank=512, qk_rope_head_dim=64),
         "mla_prefill": tk.KernelSpec(3, 3, 96, 64, "float32", kv_lora_rank=64, qk_rope_head_dim=32)}
_OPS = {"decode": ("attn_decode_paged", "_SERIAL_DECODE_WORK"), "paged": ("attn_prefill_paged", "_SERIAL_PREFILL_WORK"),
        "ragged": ("attn_prefill_ragged", "_SERIAL_PREFILL_WORK"),
        "mla_decode": ("mla_attn_decode_paged", "_SERIAL_DECODE_WORK"),
        "mla_prefill": ("mla_attn_prefill_paged", "_SERIAL_PREFILL_WORK")}
BUILDERS = {name: (_direct(tk.family_cpu.FACTORIES[op], _CFGS[name]), op, _CFGS[name], thr)
            for name, (op, thr) in _OPS.items()}


@functools.lru_cache(maxsize=None)
def built(name: str, threads: str | None = None, masking: tuple = ()):
    """``BUILDERS[name]``'s factory called with ``paths={"cpu_threads": threads}`` (None: no ``paths``
    argument) and the ``masking`` keyword pairs; parsed once per session."""
    kwargs = dict(masking) if threads is None else {**dict(masking), "paths": {"cpu_threads": threads}}
    with tk._common.fast_macro_expansion():  # as the factories parse (several times faster)
        return BUILDERS[name][0](**kwargs)


def _sha(func) -> str:
    return hashlib.sha256(func.script().encode()).hexdigest()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_options_off_and_auto_paths_build_the_default_kernel(name):
    """sliding_window = 0, logits_soft_cap = 0 and paths empty / "auto" build exactly the kernel of a call
    without them (same script), directly and through KernelSpec / FACTORIES; turning an option on or
    forcing a path changes it, and FACTORIES threads a forced path through."""
    _, op, cfg, _ = BUILDERS[name]
    default = _sha(built(name))
    forced = {th: _sha(built(name, th)) for th in THREAD_PATHS}
    assert _sha(built(name, "auto")) == default
    assert len({default, *forced.values()}) == 3
    for paths, want in (((), default), ({"cpu_threads": "auto"}, default),
                        ({"cpu_threads": "parallel"}, forced["parallel"])):
        assert _sha(tk.FACTORIES[op](dataclasses.replace(cfg, paths=paths), "llvm")) == want, paths
    if not name.startswith("mla"):
        assert _sha(built(name, None, (("sliding_window", 0), ("logits_soft_cap", 0.0)))) == default
        assert _sha(built(name, None, (("sliding_window", 17), ("logits_soft_cap", 5.0)))) != default


def _estimate_branches(func, threshold: int) -> list:
    """The ``if work < threshold`` statements choosing between the serial and the parallel path."""
    out = []
    for s in _stmts(func.body):
        cond = getattr(s, "condition", None)
        # a buffer load (0.27: a TensorLoad whose ``source`` is the buffer), read by duck type
        loaded = getattr(getattr(cond, "a", None), "source", None)
        if (isinstance(s, tirx.IfThenElse) and isinstance(cond, tirx.LT) and getattr(loaded, "name", "") == "work"
                and isinstance(cond.b, tirx.IntImm) and cond.b.value == threshold):
            out.append(s)
    return out


@pytest.mark.parametrize("name", list(BUILDERS))
def test_thread_paths_structure(name):
    """auto: the run-time work-estimate branch, serial items on the calling thread, else the pool;
    serial / parallel: only that path, and no work estimate at all. No path has the loop nest that
    CanonicalizeLoop miscompiles (``shifted_loop_bounds``)."""
    threshold = getattr(tk.attention_cpu, BUILDERS[name][3])
    funcs = {th: built(name, th) for th in ("auto",) + THREAD_PATHS}
    (branch,) = _estimate_branches(funcs["auto"], threshold)
    assert not _has_parallel_loop(branch.then_case) and _has_parallel_loop(branch.else_case)
    assert {th: shifted_loop_bounds(f) for th, f in funcs.items()} == {th: [] for th in funcs}
    for th in THREAD_PATHS:
        body = funcs[th].body
        assert _estimate_branches(funcs[th], threshold) == []
        assert not any(isinstance(s, tirx.BufferStore) and s.buffer.name == "work" for s in _stmts(body))
        assert _has_parallel_loop(body) == (th == "parallel")


def shifted_loop_bounds(func) -> list[tuple[str, str]]:
    """``(outer, inner)`` loop pairs where ``outer`` starts at a non-zero value and the bounds of ``inner``,
    nested in it, read ``outer``'s variable.

    TVM 0.27's ``s_tir.CanonicalizeLoop`` shifts such an outer loop to start at 0 but leaves the nested
    loop's bounds reading the shifted variable unchanged: the inner loop then runs with the bounds of
    another iteration. Kernels must never contain such a pair (bind the value with ``T.let`` instead).
    """
    bad = []
    for outer in _loops(func.body):
        if isinstance(outer.min, tirx.IntImm) and outer.min.value == 0:
            continue
        for inner in _loops(outer.body):
            used = list(tirx.analysis.undefined_vars(inner.min, [])) + list(
                tirx.analysis.undefined_vars(inner.extent, []))
            if any(v.same_as(outer.loop_var) for v in used):
                bad.append((outer.loop_var.name, inner.loop_var.name))
    return bad


#: One config per CPU attention kernel variant: plain, window (prefill and decode start their key-tile
#: loop past tile 0), soft-cap, both (on the forced parallel path); MLA.
STRUCTURE_CFGS = [
    tk.KernelSpec(16, 16, 64, 64, "float32", sliding_window=13),
    tk.KernelSpec(8, 2, 128, 64, "float16", sliding_window=40, logits_soft_cap=5.0,
                    paths={"cpu_threads": "parallel"}),
    tk.KernelSpec(6, 2, 64, 64, "float32", logits_soft_cap=30.0),
    tk.KernelSpec(4, 4, 64, 64, "float16"),
    tk.KernelSpec(16, 16, 192, 128, "float16", kv_lora_rank=512, qk_rope_head_dim=64),
]


def _structure_id(c) -> str:
    paths = "-".join(v for _, v in c.paths) or "auto"
    return (f"{c.num_qo_heads}x{c.num_kv_heads}x{c.head_dim}-w{c.sliding_window}-cap{c.logits_soft_cap:g}"
            f"-mla{c.kv_lora_rank}-{paths}")


@pytest.mark.parametrize("cfg", STRUCTURE_CFGS, ids=_structure_id)
def test_no_loop_bound_reads_a_shifted_loop_var(cfg):
    """Every CPU kernel of ``cfg`` is free of the nested-bound pattern CanonicalizeLoop miscompiles (the
    windowed decode had it: its key-tile loop started at a tile computed from the item index)."""
    with tk._common.fast_macro_expansion():
        funcs = tk.build_kernels(cfg, "llvm")
    found = {op: shifted_loop_bounds(f) for op, f in funcs.items()}
    assert {op: pairs for op, pairs in found.items() if pairs} == {}


# ---------------------------------------------------------------------------------------------------
# the windowed decode regression
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", ("auto",) + THREAD_PATHS)
@pytest.mark.parametrize("lens", [[67, 28], [28, 67]], ids=["long-first", "short-first"])
def test_decode_window_first_entry_past_first_tile(lens, threads):
    """16 q / 16 kv heads (auto: enough work for the thread pool), window 13: the 67-key entry's window
    starts in key tile 1. The old kernel returned the empty state for the entry after it (on the pool)."""
    run_decode_paged((16, 16, 64), "float32", 16, 0, lens, {"sliding_window": 13},
                     paths={"cpu_threads": threads})


# ---------------------------------------------------------------------------------------------------
# every path on mixed batches
# ---------------------------------------------------------------------------------------------------
#: ((Hq, Hkv, D), dtype, sliding_window, logits_soft_cap): plain, window, and soft-cap with a window over a
#: key tile, with 4 and 16 kv heads and GQA groups 4, 1, 3. D = 40 takes the 8-lane dot product with an odd
#: vector count (every other shape: 16 lanes, even), a shape-made compile-time choice no other kernel test
#: reaches. (Soft-cap alone on every path: the scenario suite's capped shape.)
PATH_CASES = [
    ((16, 4, 40), "float32", 0, 0.0),
    ((16, 16, 64), "float32", 13, 0.0),
    ((12, 4, 64), "float16", 40, 5.0),
]


def _case_id(case):
    shape, dtype, window, cap = case
    return f"{'x'.join(map(str, shape))}-{dtype}-w{window}-cap{cap:g}"


#: 20 decode lengths (20 x 4 kv heads = 80 work items: more than the 64 parallel chunks, so chunks run
#: several items and reuse their scratch), long and short interleaved, starting with an entry whose
#: window (13 or 40) starts past key tile 0; and the same sorted short to long.
DECODE_LENS = [150, 3, 67, 28, 0, 1, 90, 16, 33, 5, 200, 12, 64, 41, 7, 130, 2, 48, 100, 9]


@pytest.mark.parametrize("reverse", [False, True], ids=["long-first", "short-first"])
@pytest.mark.parametrize("threads", THREAD_PATHS)
@pytest.mark.parametrize("case", PATH_CASES, ids=_case_id)
def test_attn_decode_paged_paths(case, threads, reverse):
    """Page size 16 without RoPE / 8 (buffers as views) with inline RoPE, one per order."""
    shape, dtype, window, cap = case
    lens = sorted(DECODE_LENS) if reverse else DECODE_LENS
    run_decode_paged(shape, dtype, 8 if reverse else 16, int(reverse), lens,
                     {"sliding_window": window, "logits_soft_cap": cap}, paths={"cpu_threads": threads})


#: 18 (qlen, kvlen) entries, long first: empty kv, qlen 0, several query tiles, long kv with few queries.
PREFILL_ENTRIES = [(40, 150), (1, 1), (3, 0), (5, 70), (0, 7), (17, 17), (33, 90), (2, 40), (9, 9), (1, 130),
                   (25, 25), (6, 64), (12, 200), (4, 4), (31, 31), (1, 16), (20, 45), (7, 100)]
#: The ragged entries add qlen > kvlen (causal rows with no key).
RAGGED_ENTRIES = [(70, 70), (1, 1), (3, 0), (0, 4), (40, 40), (6, 20), (20, 6), (33, 33), (2, 2), (1, 90),
                  (25, 25), (9, 64), (64, 64), (4, 4), (31, 31), (1, 16), (15, 45), (90, 40)]


@pytest.mark.parametrize("reverse", [False, True], ids=["long-first", "short-first"])
@pytest.mark.parametrize("threads", THREAD_PATHS)
@pytest.mark.parametrize("case", PATH_CASES, ids=_case_id)
def test_attn_prefill_paged_paths(case, threads, reverse):
    """Long first: causal (a windowed cache's through forward), page size 16, inline RoPE; short first:
    non-causal, page size 8 (buffers as views), no RoPE."""
    shape, dtype, window, cap = case
    entries = PREFILL_ENTRIES[::-1] if reverse else PREFILL_ENTRIES
    run_prefill_paged(shape, dtype, 8 if reverse else 16, int(not reverse), int(not reverse), entries,
                      {"sliding_window": window, "logits_soft_cap": cap}, paths={"cpu_threads": threads})


@pytest.mark.parametrize("reverse", [False, True], ids=["long-first", "short-first"])
@pytest.mark.parametrize("threads", THREAD_PATHS)
@pytest.mark.parametrize("case", PATH_CASES, ids=_case_id)
def test_attn_prefill_ragged_paths(case, threads, reverse):
    """Long first: causal without RoPE; short first: non-causal with inline RoPE."""
    shape, dtype, window, cap = case
    entries = RAGGED_ENTRIES[::-1] if reverse else RAGGED_ENTRIES
    run_prefill_ragged(shape + shape[2:], dtype, int(not reverse), int(reverse), entries,
                       {"sliding_window": window, "logits_soft_cap": cap}, paths={"cpu_threads": threads})


#: Long paged prefill entries: every GQA group's 64-row query tiles (64 tokens at group 1 ... 8 at group 8)
#: come several per entry, with a partial last tile (150 = 64 + 64 + 22 at group 1, 129 = 2 x 64 + 1), beside
#: short and empty entries; kv lengths up to 400 cross many pages.
LONG_PAGED_ENTRIES = [(150, 300), (1, 33), (70, 70), (0, 5), (3, 0), (65, 81), (129, 129), (20, 400)]
#: ((Hq, Hkv, D), dtype, masking): groups 1, 3, 4, 7, 8, 8 and head dims 64, 96, 128, 256 over the three
#: storage dtypes; the group-3 case with a window shorter than a query tile's keys and a soft-cap.
LONG_PAGED_CASES = [
    ((4, 4, 64), "float32", {}),
    ((6, 2, 96), "bfloat16", {"sliding_window": 70, "logits_soft_cap": 5.0}),
    ((8, 2, 128), "float32", {}),
    ((14, 2, 64), "float16", {}),
    ((16, 2, 128), "float32", {}),
    ((8, 1, 256), "float16", {}),
]


def _long_id(case):
    shape, dtype, masking = case
    return f"{'x'.join(map(str, shape))}-{dtype}" + "".join(f"-{k}{v:g}" for k, v in masking.items())


@pytest.mark.parametrize("threads", THREAD_PATHS)
@pytest.mark.parametrize("case", LONG_PAGED_CASES, ids=_long_id)
def test_attn_prefill_paged_long_entries(case, threads):
    """Several query tiles per entry on both thread paths: causal with inline RoPE (page size 16), then
    non-causal without (page size 8, buffers as views), both against the float64 reference."""
    shape, dtype, masking = case
    for ps, causal in ((16, 1), (8, 0)):
        run_prefill_paged(shape, dtype, ps, causal, causal, LONG_PAGED_ENTRIES, masking,
                          paths={"cpu_threads": threads})
