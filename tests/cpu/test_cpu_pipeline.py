"""The CPU model pipeline (``pagedkv.cpu_pipeline``): its matmul kernels against numpy for every row path
(one row, 2-4 padded rows, full 6-row tiles plus a padded tail) with and without the residual add, and the
pass's choices on a small Llama model (every projection replaced, norms and elementwise functions scheduled,
the cache's kernels untouched). End-to-end numerics: ``test_relax_model.py`` and ``test_smollm2.py``."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import tirx

from pagedkv.cpu_kernels import MatmulShape, matmul_kernel
from pagedkv.cpu_pipeline import schedule_pass
from pagedkv.target import host_target

ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 64]


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


def test_pass_schedules_every_model_function():
    from tvm.relax.backend.cpu_generic import pipeline as cp

    from pagedkv.compile import export_model
    from pagedkv.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    target = host_target()
    mod, named, _ = export_model(LlamaForCausalLM(cfg, dtype="float32", target=target, backend="tir"))
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
    assert sum(k == "matmul" for k in kinds.values()) >= 4, kinds
    assert any(k == "reduction" for n, k in kinds.items() if n.startswith("rms_norm")), kinds
