"""The op table (``pagedkv.ops.OP_SPECS``) is the one source of the op vocabulary and the kernel ABI: the
generated header and docs are current, the compiled runtime reports the same vocabulary, no C++ file reads
an argument by an integer position, and every TIR PrimFunc's parameters and buffer shapes match the table
(CPU and CUDA, MHA with and without options, MLA)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedkv import ops
from pagedkv._ops_gen import cpp_header, docs_block, markdown_table

_REPO = Path(__file__).resolve().parents[2]


def test_header_is_generated_from_the_table():
    assert (_REPO / "src" / "ops.h").read_text() == cpp_header(), (
        "src/ops.h is stale: python -m pagedkv._ops_gen --header > src/ops.h")


def test_docs_table_is_generated_from_the_table():
    assert docs_block((_REPO / "docs" / "ARCHITECTURE.md").read_text()) == markdown_table(), (
        "docs/ARCHITECTURE.md's op table is stale: paste `python -m pagedkv._ops_gen --markdown` between its markers")


def test_runtime_vocabulary_equals_python():
    from pagedkv._lib import get_global

    v = get_global("pagedkv.op_vocabulary")()
    assert list(v["ops"]) == list(ops.OPS)
    for kind in ops.LAYER_KINDS:
        assert list(v[kind]) == list(ops.OPS_BY_KIND[kind])
        assert list(v[f"required_{kind}"]) == list(ops.REQUIRED_BY_KIND[kind])
    assert {k: list(a) for k, a in v["args"].items()} == {s.name: [a.name for a in s.args] for s in ops.OP_SPECS}


def test_kernels_package_uses_the_same_vocabulary():
    from pagedkv import tir_kernels

    assert tir_kernels.OPS == ops.OPS
    assert tir_kernels.OPS_BY_KIND == ops.OPS_BY_KIND


def test_no_integer_argument_positions_in_src():
    # adapters index a call's arguments through src/ops.h (`in[K::kQ]`), never `in[3]` or `in[b + 2]`
    bad = []
    for path in sorted((_REPO / "src").glob("*.cc")) + sorted((_REPO / "src").glob("*.h")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bin\[\s*(\d|[a-z_]+\s*[-+])", line):
                bad.append(f"{path.name}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_ops_lists_are_consistent():
    assert len(set(ops.OPS)) == len(ops.OPS)
    for kind, required in ops.REQUIRED_BY_KIND.items():
        assert set(required) <= set(ops.OPS_BY_KIND[kind])
    for spec in ops.OP_SPECS:
        assert len({a.name for a in spec.args}) == len(spec.args), spec.name
        assert ops.check_op(spec.name) == spec.name
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        ops.check_op("nope")
    assert ops.SPECS["attn_decode_paged"].index("sm_scale") == 12


# -- PrimFuncs against the table --------------------------------------------------------------------------
def _kernel_configs():
    from pagedkv.tir_kernels import KernelSpec

    return {
        "mha_f16_gqa4_sinks": KernelSpec(8, 2, 64, 64, "float16", attention_sinks=True),
        "mha_f32_gqa3_window_cap": KernelSpec(6, 2, 32, 32, "float32", sliding_window=7, logits_soft_cap=2.0),
        "mla_f32_sinks": KernelSpec(4, 4, 96, 64, "float32", kv_lora_rank=64, qk_rope_head_dim=32,
                                    attention_sinks=True),
    }


def _resolve(symbol: str, values: dict[str, int]):
    """A compile-time symbol ("Hq+2*Hkv", "D") -> int, or None for a run-time symbol."""
    if symbol[0].islower():
        return None
    return eval(symbol, {}, dict(values))  # noqa: S307 (our own table's arithmetic)


def _check_shape(op: str, arg, param, values, runtime_vars: dict) -> None:
    shape = list(param.shape)
    assert len(shape) == len(arg.shape), f"{op}.{arg.name}: rank {len(shape)} != table {arg.shape}"
    for dim, (sym, expr) in enumerate(zip(arg.shape, shape)):
        want = _resolve(sym, values)
        where = f"{op}.{arg.name} dim {dim} ({sym})"
        if want is not None:
            assert int(expr) == want, f"{where}: {expr} != {want}"
            continue
        base, plus = (sym[:-2], 1) if sym.endswith("+1") else (sym, 0)
        text = str(expr)
        var = text.removesuffix(" + 1") if plus else text
        assert (text.endswith(" + 1") if plus else re.fullmatch(r"\w+", text)), f"{where}: {text}"
        # one symbol is one variable within a function, and two symbols are two variables
        assert runtime_vars.setdefault(base, var) == var, f"{where}: {var} != {runtime_vars[base]}"


@pytest.mark.parametrize("target", ["llvm", "cuda"])
@pytest.mark.parametrize("name", list(_kernel_configs()))
def test_prim_funcs_match_the_table(name, target):
    from tvm.tirx.buffer import is_buffer_var

    from pagedkv.tir_kernels import adapter_of, build_kernels

    cfg = _kernel_configs()[name]
    values = ops.shape_values(cfg)
    tgt = "llvm" if target == "llvm" else {"kind": "cuda", "arch": "sm_90"}
    funcs = build_kernels(cfg, tgt)
    # every op of the layer kind; a float32 spec leaves out the partial-state ops (its kernels write float32), a
    # spec without attention_sinks the sink ops
    assert tuple(funcs) == ops.ops_for(cfg)
    kind = set(ops.OPS_BY_KIND[ops.MLA if cfg.is_mla else ops.MHA])
    left_out = set() if cfg.attention_sinks else set(ops.SINK_OPS)
    if cfg.dtype == "float32":
        left_out |= (kind & set(ops.PARTIAL_OPS)) | {ops.MERGE_STATE_PARTIAL_SINKS}
    assert kind - set(funcs) == left_out
    for op, func in funcs.items():
        spec = ops.SPECS[op]
        assert func.attrs["global_symbol"] == spec.symbol
        params = list(func.params)
        # the op's arguments, then those of the runtime adapter kind the function declares
        args = ops.call_args(op, adapter_of(func))
        assert [str(p.name) for p in params] == [a.name for a in args], op
        runtime_vars: dict[str, str] = {}
        for arg, param in zip(args, params):
            assert is_buffer_var(param) == arg.is_tensor, f"{op}.{arg.name}"
            want_dtype = cfg.dtype if arg.dtype == "cache" else arg.dtype
            got = str(param.dtype) if arg.is_tensor else str(param.ty)
            assert got == want_dtype, f"{op}.{arg.name}: dtype {got} != {want_dtype}"
            if arg.is_tensor:
                _check_shape(op, arg, param, values, runtime_vars)
        assert len(set(runtime_vars.values())) == len(runtime_vars), f"{op}: {runtime_vars}"
