"""The CPU attention kernels (MHA and MLA) on every run-time code path, and the structure that keeps the
paths right.

Same rules as ``test_kernels.py`` (whose helpers this reuses): fresh random inputs, NaN-filled outputs and
spare page slots, float64 reference, relative error below 1e-5 (float32) / 1e-2 (float16).

Run: ``.venv/bin/python -m pytest tests/cpu/test_kernel_paths.py -q``
"""

from __future__ import annotations

import pytest
from test_kernels import _fresh_rng, run_decode_paged, tk  # noqa: F401
from tvm import tirx


# ---------------------------------------------------------------------------------------------------
# loop structure
# ---------------------------------------------------------------------------------------------------
def _loops(stmt, out):
    """Every ``For`` under ``stmt`` (0.27 TIR: flat ``SeqStmt`` bodies, ``Bind`` statements)."""
    if isinstance(stmt, tirx.For):
        out.append(stmt)
    for attr in ("body", "then_case", "else_case"):
        child = getattr(stmt, attr, None)
        if child is not None:
            _loops(child, out)
    if isinstance(stmt, tirx.SeqStmt):
        for child in stmt.seq:
            _loops(child, out)
    return out


def shifted_loop_bounds(func) -> list[tuple[str, str]]:
    """``(outer, inner)`` loop pairs where ``outer`` starts at a non-zero value and the bounds of ``inner``,
    nested in it, read ``outer``'s variable.

    TVM 0.27's ``s_tir.CanonicalizeLoop`` shifts such an outer loop to start at 0 but leaves the nested
    loop's bounds reading the shifted variable unchanged: the inner loop then runs with the bounds of
    another iteration. Kernels must never contain such a pair (bind the value with ``T.let`` instead).
    """
    bad = []
    for outer in _loops(func.body, []):
        if isinstance(outer.min, tirx.IntImm) and outer.min.value == 0:
            continue
        for inner in _loops(outer.body, []):
            used = list(tirx.analysis.undefined_vars(inner.min, [])) + list(
                tirx.analysis.undefined_vars(inner.extent, []))
            if any(v.same_as(outer.loop_var) for v in used):
                bad.append((outer.loop_var.name, inner.loop_var.name))
    return bad


#: One config per CPU attention kernel variant: plain, window (prefill and decode start their key-tile
#: loop past tile 0), soft-cap, both; MLA.
STRUCTURE_CFGS = [
    tk.KernelConfig(16, 16, 64, 64, "float32", sliding_window=13),
    tk.KernelConfig(8, 2, 128, 64, "float16", sliding_window=40, logits_soft_cap=5.0),
    tk.KernelConfig(6, 2, 64, 64, "float32", logits_soft_cap=30.0),
    tk.KernelConfig(4, 4, 64, 64, "float16"),
    tk.KernelConfig(16, 16, 192, 128, "float16", kv_lora_rank=512, qk_rope_head_dim=64),
]


@pytest.mark.parametrize("cfg", STRUCTURE_CFGS, ids=lambda c: f"{c.num_qo_heads}x{c.num_kv_heads}x{c.head_dim}"
                         f"-w{c.sliding_window}-cap{c.logits_soft_cap:g}-mla{c.kv_lora_rank}")
def test_no_loop_bound_reads_a_shifted_loop_var(cfg):
    """Every CPU kernel of ``cfg`` is free of the nested-bound pattern CanonicalizeLoop miscompiles (the
    windowed decode had it: its key-tile loop started at a tile computed from the item index)."""
    with tk._common.fast_macro_expansion():
        funcs = tk.build_kernels(cfg, "llvm")
    assert {op: shifted_loop_bounds(f) for op, f in funcs.items() if shifted_loop_bounds(f)} == {}


# ---------------------------------------------------------------------------------------------------
# the windowed decode regression
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lens", [[67, 28], [28, 67]], ids=["long-first", "short-first"])
def test_decode_window_first_entry_past_first_tile(lens):
    """16 q / 16 kv heads (enough work for the thread pool), window 13: the 67-key entry's window starts in
    key tile 1. The old kernel returned the empty state for the entry after it."""
    run_decode_paged((16, 16, 64), "float32", 16, 0, lens, {"sliding_window": 13})
