"""No CUDA kernel binds a constant to a TIR variable (build host, no lowering).

A Python value assigned inside a ``@T.macro`` (``ML0 = 4 * 16 * D``) is parsed into a mutable TIR variable: a
``name: T.int32 = 4096`` declaration in the script, a one-element local array in the CUDA source. nvcc folds it
away, but TVM's ``s_tir.CompactBufferAllocation`` does not: one such declaration in each of the two tensor-core
decode kernels of a PrimFunc made that pass take ~60 s of the PrimFunc's 63 s lowering (0.6 s for either kernel
alone), in every build of the op. A constant belongs outside the macro (a closure value, substituted as a literal).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from pagedkv import tir_kernels as tk
from pagedkv.kernel_spec import WG_PREFILL_TILES
from pagedkv.tir_kernels.attention_cuda_prefill_tc import TC_TILES

from tvm.target import Target

SM90 = Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
SM90A = Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
#: A scalar declaration bound to a literal, as ``PrimFunc.script()`` prints it.
CONST_DECL = re.compile(r"^\s+(\w+): T\.\w+ = (-?[\d.]+)$", re.M)

#: (id, config, paths, target): every decode kernel choice (plain and windowed + capped), every prefill tile at a
#: head dim it serves, both tensor-core MLA decodes.
CASES = (
    [(f"decode-{k}", tk.KernelConfig(8, 1, 64, 64, "bfloat16", sliding_window=90, logits_soft_cap=20.0),
      {"cuda_decode_kernel": k}, SM90) for k in ("tc", "staged", "lanes")]
    + [(f"prefill-{t}", tk.KernelConfig(32, 8, 128, 128, "float16"), {"cuda_prefill_kernel": t},
        SM90A if t in WG_PREFILL_TILES else SM90) for t in TC_TILES]
    + [(f"mla-{k}", tk.KernelConfig(16, 16, 64, 64, "float16", kv_lora_rank=512, qk_rope_head_dim=64),
        {"cuda_mla_decode_kernel": k}, SM90A if k == "wg" else SM90) for k in ("tc", "wg")]
)


@pytest.mark.parametrize("cfg,paths,target", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_no_constant_bound_to_a_tir_variable(cfg, paths, target):
    cfg = dataclasses.replace(cfg, paths=paths)
    found = {}
    for op, func in tk.build_kernels(cfg, target).items():
        for name, value in CONST_DECL.findall(func.script()):
            found.setdefault(op, set()).add(f"{name} = {value}")
    assert not found, f"constants bound to TIR variables (move them out of the macro): {found}"
