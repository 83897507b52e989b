"""What TVM's early lowering makes of the CUDA kernels (build host, no GPU, no codegen).

- No kernel binds a constant to a TIR variable. A Python value assigned inside a ``@T.macro`` (``ML0 = 4 * 16 * D``) is parsed into a mutable TIR variable: a
``name: T.int32 = 4096`` declaration in the script, a one-element local array in the CUDA source. nvcc folds it
away, but TVM's ``s_tir.CompactBufferAllocation`` does not: one such declaration in each of the two tensor-core
decode kernels of a PrimFunc made that pass take ~60 s of the PrimFunc's 63 s lowering (0.6 s for either kernel
alone), in every build of the op. A constant belongs outside the macro (a closure value, substituted as a literal).
- ``s_tir.CompactBufferAllocation`` leaves every shared buffer at its declared size. The pass sizes a buffer by the
  elements it sees indexed; a ``cp.async`` / ``ldmatrix`` / wgmma chunk reached through ``T.address_of(buf[i])``
  spans 16 bytes from ``i``, so where it could bound the indices it cut the last chunk's tail: the MLA tc decode's
  dynamic buffer lost 16 bytes, and with the constant above folded the tc decode's lost 28
  (``_mma_cuda.keep_extent`` now pins each).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

import tvm
from tvm import s_tir

from pagedkv import tir_kernels as tk
from pagedkv.kernel_spec import WG_PREFILL_TILES
from pagedkv.tir_kernels.attention_cuda_prefill_tc import TC_TILES
from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)
SM90A = Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
#: TVM's passes before CompactBufferAllocation in its default pipeline (``s_tir`` part).
EARLY = tvm.transform.Sequential([
    s_tir.transform.CanonicalizeLoop(), s_tir.transform.LowerCrossThreadReduction(), s_tir.transform.LowerInitBlock(),
    s_tir.transform.PlanAndUpdateBufferAllocationLocation(), s_tir.transform.ConvertBlocksToOpaque(),
    s_tir.transform.LiftThreadBinding(), s_tir.transform.ManifestSharedMemoryLocalStage()])
#: A shared buffer's allocation as the script prints it: (name, shape, dtype or "").
SHARED_ALLOC = re.compile(r'(\w+) = T\.alloc_buffer\((\([^)]*\))(?:, "(\w+)")?, scope="shared(?:\.dyn)?"')
#: A scalar declaration bound to a literal, as ``PrimFunc.script()`` prints it.
CONST_DECL = re.compile(r"^\s+(\w+): T\.\w+ = (-?[\d.]+)$", re.M)

#: (id, config, paths, target): every decode kernel choice (plain and windowed + capped), every prefill tile at a
#: head dim it serves, the tensor-core MLA decodes.
CASES = (
    [(f"decode-{k}", tk.KernelSpec(8, 1, 64, 64, "bfloat16", sliding_window=90, logits_soft_cap=20.0),
      {"cuda_decode_kernel": k}, SM80) for k in ("tc", "staged", "lanes")]
    + [(f"prefill-{t}", tk.KernelSpec(32, 8, 128, 128, "float16"), {"cuda_prefill_kernel": t},
        SM90A if t in WG_PREFILL_TILES else SM80) for t in TC_TILES if 128 in TC_TILES[t].dims]
    # tcq at the head dim it serves; tc3 at 96 (copies in whole keys by 96 of its 128 threads)
    + [("prefill-tcq-d256", tk.KernelSpec(16, 8, 256, 256, "bfloat16"), {"cuda_prefill_kernel": "tcq"}, SM80),
       ("prefill-tc3-d96", tk.KernelSpec(12, 4, 96, 96, "float16"), {"cuda_prefill_kernel": "tc3"}, SM80)]
    # D 128 (the other decode cases take 64); bfloat16 is decode-tc's dtype above (its buffers' sizes do not
    # depend on the dtype: both are 16-bit)
    + [("decode-tc-float16", tk.KernelSpec(32, 8, 128, 128, "float16"), {"cuda_decode_kernel": "tc"}, SM80)]
    + [(f"prefill-{t}-d64", tk.KernelSpec(8, 2, 64, 64, "bfloat16"), {"cuda_prefill_kernel": t}, SM80)
       for t in TC_TILES if t not in WG_PREFILL_TILES and 64 in TC_TILES[t].dims]
    + [(f"mla-{k}-{h}", tk.KernelSpec(h, h, 64, 64, "float16", kv_lora_rank=512, qk_rope_head_dim=64),
        {"cuda_mla_decode_kernel": k}, SM90A if k != "tc" else SM80) for k in ("tc", "wgq") for h in (16, 128)]
)
IDS = [c[0] for c in CASES]


#: The ops a forced switch changes (the others build the same kernels as every other case: covered once, by the
#: auto cases of the other tests).
SWITCH_OPS = {"cuda_decode_kernel": ("attn_decode_paged",),
              "cuda_prefill_kernel": ("attn_prefill_ragged", "attn_prefill_paged"),
              "cuda_mla_decode_kernel": ("mla_attn_decode_paged",)}


@pytest.fixture(scope="module")
def kernels():
    """``get(i)``: {op: (PrimFunc, its script)} of the ops ``CASES[i]``'s switch changes, built once."""
    cache = {}

    def get(i):
        if i not in cache:
            _id, cfg, paths, target = CASES[i]
            ops = sorted({op for switch in paths for op in SWITCH_OPS[switch]})
            funcs = tk.build_kernels(dataclasses.replace(cfg, paths=paths), target, ops=ops)
            cache[i] = {op: (f, f.script()) for op, f in funcs.items()}
        return cache[i]

    return get


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_no_constant_bound_to_a_tir_variable(i, kernels):
    found = {}
    for op, (func, script) in kernels(i).items():
        for name, value in CONST_DECL.findall(script):
            found.setdefault(op, set()).add(f"{name} = {value}")
    assert not found, f"constants bound to TIR variables (move them out of the macro): {found}"


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_shared_buffers_keep_their_declared_size(i, kernels):
    target = CASES[i][3]
    changed = {}
    for op, (func, script) in kernels(i).items():
        declared = sorted(SHARED_ALLOC.findall(script))
        if not declared:
            continue
        with target:
            mod = EARLY(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
            mod = s_tir.transform.CompactBufferAllocation()(mod)
        after = sorted(SHARED_ALLOC.findall(mod["main"].script()))
        if after != declared:
            changed[op] = (declared, after)
    assert not changed, f"shared buffers resized by CompactBufferAllocation (pin them with keep_extent): {changed}"
