"""The CPU model pipeline (``pagedkv.cpu_pipeline``): its matmul kernels against numpy for every row path
(one row, 2-4 padded rows, full 6-row tiles plus a padded tail) with and without the residual add, in float32
and in float16 / bfloat16 (half inputs, weights and outputs, float32 sums), the matcher on a half model's
``matmul``, ``cast``, ``add`` functions, and the pass's choices on a small Llama model per dtype (every
projection replaced, norms and elementwise functions scheduled, the cache's kernels untouched). End-to-end
numerics: ``test_relax_model.py`` and ``test_smollm2.py``."""

from __future__ import annotations

import ml_dtypes  # noqa: F401 (registers numpy's "bfloat16"; a dependency of apache-tvm)
import numpy as np
import pytest
import tvm
from tvm import te, tirx

from pagedkv.cpu_kernels import MatmulShape, matmul_kernel
from pagedkv.cpu_pipeline import SlowDtypeWarning, match_matmul, schedule_pass
from pagedkv.target import host_target

ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 64]
HALF = ["float16", "bfloat16"]
#: A half kernel's odd shape: K and N multiples of neither the 16 float32 lanes nor the 64-column strip.
HALF_K, HALF_N = 100, 48


@pytest.fixture(scope="module")
def kernels():
    """(with residual?) -> compiled kernel of a [1536, 576] projection whose rows are ``[b, 1, K]``."""
    b, one = tirx.Var("b", "int64"), tirx.IntImm("int64", 1)
    out = {}
    for res in (False, True):
        # The residual comes first in the parameters here: the kernel follows the original's order.
        params = ("res", "a", "w", "out") if res else ("a", "w", "out")
        shape = MatmulShape(params, (b, one, 1536), (b, one, 576), 1536, 576, "float32", "float32")
        mod = tvm.IRModule({"mm": matmul_kernel(shape).with_attr("global_symbol", "mm")})
        out[res] = tvm.compile(mod, target=host_target())["mm"]
    return out


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("res", [False, True])
def test_matmul_kernel_matches_numpy(kernels, rows, res):
    rng = np.random.default_rng(rows)
    a = rng.standard_normal((rows, 1, 1536), dtype=np.float32)
    w = rng.standard_normal((1536, 576), dtype=np.float32)
    r = rng.standard_normal((rows, 1, 576), dtype=np.float32)
    o = tvm.runtime.tensor(np.full((rows, 1, 576), np.nan, np.float32))
    t = [tvm.runtime.tensor(x) for x in (a, w, r)]
    kernels[res](*([t[2], t[0], t[1], o] if res else [t[0], t[1], o]))
    ref = a.astype(np.float64) @ w + (r if res else 0)
    np.testing.assert_allclose(o.numpy(), ref, rtol=1e-4, atol=1e-3)


@pytest.fixture(scope="module")
def half_kernels():
    """(dtype, with residual?) -> compiled half kernel of a [HALF_K, HALF_N] projection (rows ``[b, 1, K]``)."""
    b, one = tirx.Var("b", "int64"), tirx.IntImm("int64", 1)
    out = {}
    for dt in HALF:
        for res in (False, True):
            params = ("a", "w", "res", "out") if res else ("a", "w", "out")
            shape = MatmulShape(params, (b, one, HALF_K), (b, one, HALF_N), HALF_K, HALF_N, dt, dt, dt)
            mod = tvm.IRModule({"mm": matmul_kernel(shape).with_attr("global_symbol", "mm")})
            out[dt, res] = tvm.compile(mod, target=host_target())["mm"]
    return out


@pytest.mark.parametrize("rows", [1, 3, 13])  # the three paths: one row, padded rows, 6-row tiles + tail
@pytest.mark.parametrize("res", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_half_matmul_kernel_matches_float64(half_kernels, dtype, res, rows, seed):
    """Half in, half out, float32 sums: within 1e-2 of a float64 reference of the same (half) inputs, whose
    sum is rounded to the dtype before the residual is added, as the model's ``cast`` then ``add`` do."""
    rng = np.random.default_rng(seed)
    a, w, r = (rng.standard_normal(s).astype(dtype) for s in ((rows, 1, HALF_K), (HALF_K, HALF_N), (rows, 1, HALF_N)))
    o = tvm.runtime.tensor(np.full((rows, 1, HALF_N), np.nan, dtype))
    args = [tvm.runtime.tensor(x) for x in (a, w, r)] if res else [tvm.runtime.tensor(x) for x in (a, w)]
    half_kernels[dtype, res](*args, o)
    ref = (a.astype(np.float64) @ w.astype(np.float64)).astype(dtype).astype(np.float64)
    ref = ref + (r.astype(np.float64) if res else 0)
    # 1e-2 of each element, plus 1e-2 of the output's RMS where a residual cancels the sum (the rounding of
    # the sum, not of the small difference, bounds the error there).
    err = np.abs(o.numpy().astype(np.float64) - ref)
    bound = 1e-2 * (np.abs(ref) + np.sqrt(np.mean(ref * ref)))
    assert np.isfinite(o.numpy().astype(np.float64)).all() and (err <= bound).all(), float(np.max(err / bound))


def _projection(dtype: str, n: int, *, acc: str = "float32", cast: bool = True, res: bool = True):
    """A legalized half model's projection: ``matmul`` (sums in ``acc``), ``cast`` back, residual ``add``."""
    b = tirx.Var("b", "int64")
    a = te.placeholder((b, 1, 64), dtype, "a")
    w = te.placeholder((64, n), dtype, "w")
    k = te.reduce_axis((0, 64), "k")
    c = te.compute((b, 1, n), lambda i, j, m: te.sum(a[i, j, k].astype(acc) * w[k, m].astype(acc), axis=k),
                   "matmul")
    out = te.compute(c.shape, lambda *i: c(*i).astype(dtype), "compute") if cast else c
    if not res:
        return te.create_prim_func([a, w, out])
    r = te.placeholder(c.shape, out.dtype, "r")
    return te.create_prim_func([r, a, w, te.compute(c.shape, lambda *i: r(*i) + out(*i), "T_add")])


@pytest.mark.parametrize("dtype", HALF)
def test_matcher_takes_half_projections(dtype):
    """A half model's ``matmul`` + ``cast`` (+ residual ``add``) is a projection with a half output; a
    float16 accumulator (other sums than the kernels') or a width no kernel serves is left alone."""
    found = match_matmul(_projection(dtype, 64))
    assert found is not None and found.params == ("res", "a", "w", "out"), found
    assert (found.a_dtype, found.w_dtype, found.out_dtype, found.k, found.n) == (dtype, dtype, dtype, 64, 64)
    plain = match_matmul(_projection(dtype, 64, res=False))
    assert plain is not None and plain.params == ("a", "w", "out") and plain.out_dtype == dtype
    assert match_matmul(_projection(dtype, 64, acc=dtype, cast=False)) is None
    assert match_matmul(_projection(dtype, 40)) is None  # N not a multiple of 16: TVM's schedules serve it


def test_float16_without_f16c_warns_naming_faster_dtypes(recwarn):
    """float16 for an x86 CPU without F16C (software conversions, 4-20x slower projections) warns at compile
    time, naming bfloat16 and float32; bfloat16 there, and float16 with F16C, compile without a word."""
    from tvm.target import Target

    plain_x86, haswell = Target({"kind": "llvm", "mcpu": "x86-64"}), Target({"kind": "llvm", "mcpu": "haswell"})
    # (a model's functions have no global symbol: the pass keeps those that do)
    module = {dt: tvm.IRModule({"proj": _projection(dt, 64).without_attr("global_symbol")}) for dt in HALF}
    report: dict = {}
    with pytest.warns(SlowDtypeWarning, match=r"without F16C \(llvm mcpu=x86-64\).*bfloat16.*float32"):
        schedule_pass(plain_x86, report)(module["float16"])
    assert report == {"proj": "matmul"}  # still the kernel: the warning is all that differs
    schedule_pass(plain_x86)(module["bfloat16"])
    schedule_pass(haswell)(module["float16"])
    assert not [w for w in recwarn if issubclass(w.category, SlowDtypeWarning)]


@pytest.mark.parametrize("dtype", ["float32", *HALF])
def test_pass_schedules_every_model_function(dtype):
    from tvm.relax.backend.cpu_generic import pipeline as cp

    from pagedkv.compile import export_model
    from pagedkv.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    target = host_target()
    mod, named, _ = export_model(LlamaForCausalLM(cfg, dtype=dtype, target=target, backend="tir"))
    assert any(n.endswith(".weight_kn") for n, _ in named), "CPU models store [in, out] projection weights"
    report: dict = {}
    with target:
        mod = tvm.transform.Sequential(cp.library_dispatch_passes(target) + cp.legalize_passes(target)
                                       + [schedule_pass(target, report)])(mod)
    kinds = {name: kind for name, kind in report.items()}
    assert not any(name.startswith("pagedkv_") and kind != "kept" for name, kind in kinds.items())
    assert not any("transpose" in name for name in kinds), "no weight transposes with [in, out] weights"
    unscheduled = [n for n, k in kinds.items() if k == "kept" and not n.startswith(("pagedkv_", "reshape"))]
    assert not unscheduled, f"left unscheduled: {unscheduled}"
    # Every projection (q/k/v, o, gate/up, down per layer) and the logits head, whatever the dtype: a half
    # model's projections are `matmul` + `cast` (+ `add`) functions.
    assert sum(k == "matmul" for k in kinds.values()) >= 6, kinds
    assert all(k == "matmul" for n, k in kinds.items() if "matmul" in n), kinds
    assert any(k == "reduction" for n, k in kinds.items() if n.startswith("rms_norm")), kinds
