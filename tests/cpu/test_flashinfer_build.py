"""FlashInfer JIT modules build on a host without a GPU, link into a TVM-exported library, and take exactly
the arguments the runtime adapter passes (the flashinfer-python 0.7.4 lists pinned in
``pagedkv.flashinfer.abi``).

The test builds (or takes from ``$PAGEDKV_CACHE_DIR/flashinfer``) the decode module for sm_90 (bf16, head dim
128), links it with a trivial TIR function into one library through ``external_mods`` as
the model library would be, loads that library here (only ``libcudart`` is needed to load it; nothing runs
on a GPU) and calls each function the adapter uses: with no arguments tvm-ffi refuses the call before
touching anything and names the signature, which must equal the pinned one; with the pinned count it gets
past the count check (and fails converting the first ``None``).

Skipped, with the reason, when flashinfer-python 0.7.4, nvcc or binutils are missing.
The fp16 decode, prefill (fa2, fa3) and MLA modules are checked the same way when ``PAGEDKV_FLASHINFER_ALL=1``
(minutes).
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess

import numpy as np
import pytest

from pagedkv.flashinfer import abi
from pagedkv.flashinfer.build import build_module, isolate_objects, unavailable_reasons
from pagedkv.flashinfer.spec import ModuleSpec

_WHY = unavailable_reasons()
pytestmark = pytest.mark.skipif(bool(_WHY), reason="FlashInfer JIT build unavailable: " + "; ".join(_WHY))

#: The decode module in bf16 (Llama 3 / Qwen / DeepSeek-V3 checkpoints; the module test_flashinfer_backend's link
#: test builds too, so a clean host compiles it once): fp16's differs in its template dtypes only, with the same
#: pinned signatures, and costs another ~25 s of nvcc on a cold cache; it builds with ``PAGEDKV_FLASHINFER_ALL=1``
#: (``OTHERS``) and on the GPU host (``tools/fi_gpu_bundle.py``).
DECODES = [ModuleSpec("decode", "bfloat16", "bfloat16", "bfloat16", 128, 128)]
OTHERS = [ModuleSpec("decode", "float16", "float16", "float16", 128, 128)] + [
    ModuleSpec(kind, dt, dt, dt, *dims)
    for dt in ("float16", "bfloat16")
    for kind, dims in (("mla", (512, 64)), ("mla_fa3", (512, 64)), ("prefill_fa2", (128, 128)),
                       ("prefill_fa3", (128, 128)))
]
_SIG = re.compile(r"when calling: `(.*)`\. Expected (\d+) but got (\d+) arguments")


def _load_cudart() -> None:
    from pagedkv.cuda_build import cudart_path

    # The library's NEEDED libcudart.so.13 is then satisfied by soname; LD_LIBRARY_PATH is not needed.
    ctypes.CDLL(str(cudart_path()), mode=ctypes.RTLD_GLOBAL)


def _export_with_tir(modules, path):
    """A Relax module with one TIR function and the FlashInfer objects in ``external_mods``, compiled for
    the CPU and exported: the FlashInfer symbols end up in the same library as TVM's code."""
    import tvm
    from tvm import relax as rx
    from tvm.script import tirx as T

    from pagedkv.flashinfer.link import attach, export_options

    @T.prim_func
    def add_one(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
        for i in range(4):
            b[i] = a[i] + T.float32(1)

    bb = rx.BlockBuilder()
    x = rx.Var("x", rx.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        gv = bb.add_func(add_one.with_attr("global_symbol", "add_one"), "add_one")
        out = bb.emit(rx.call_tir(gv, [x], rx.TensorType((4,), "float32")))
        bb.emit_func_output(out)
    # The FlashInfer functions as values of the VM, the way the op table hands them to pagedkv.create.
    with bb.function("op_table", []):
        bb.emit_func_output(rx.Tuple([rx.ExternFunc(name) for m in modules for name in m.functions.values()]))
    mod = attach(bb.get(), modules)
    ex = tvm.compile(mod, target="llvm")
    ex.export_library(str(path), options=export_options())
    return path


def _check_abi(lookup, built) -> None:
    for fabi in abi.functions(built.spec.kind):
        f = lookup(built.symbol(fabi.func))
        with pytest.raises(Exception) as err:
            f()
        m = _SIG.search(str(err.value))
        assert m, f"{fabi.kind}.{fabi.func}: unexpected error {err.value}"
        assert m.group(1) == fabi.signature(), (
            f"{fabi.kind}.{fabi.func}: the module's signature\n  {m.group(1)}\nis not the pinned one\n"
            f"  {fabi.signature()}")
        assert int(m.group(2)) == fabi.num_args
        # The pinned count passes the count check: the failure is then about the first argument's type.
        with pytest.raises(Exception) as err:
            f(*([None] * fabi.num_args))
        assert "Mismatched type on argument" in str(err.value), str(err.value)


@pytest.fixture(scope="module", params=DECODES, ids=[s.dtype_q for s in DECODES])
def decode_module(request):
    return build_module(request.param)


def test_decode_module_links_and_matches_pinned_abi(decode_module, tmp_path):
    import tvm

    built = decode_module
    assert built.spec in DECODES and built.object_path.exists()
    # Only the module's prefixed exports are global in its object.
    out = subprocess.run(["nm", "-g", "--defined-only", str(built.object_path)], capture_output=True,
                         text=True, check=True).stdout
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert names == sorted("__tvm_ffi_" + s for s in built.functions.values())
    assert all(s.startswith(built.spec.symbol_prefix(built.key)) for s in built.functions.values())

    lib_path = _export_with_tir([built], tmp_path / "model.so")
    _load_cudart()
    lib = tvm.runtime.load_module(str(lib_path))
    # TVM's own function is there and runs on the CPU ...
    a = tvm.runtime.tensor(np.array([1, 2, 3, 4], dtype="float32"))
    vm = tvm.relax.VirtualMachine(lib, tvm.cpu())
    assert vm["main"](a).numpy().tolist() == [2.0, 3.0, 4.0, 5.0]
    # ... and so are FlashInfer's, with the argument lists the adapter passes: looked up in the library ...
    _check_abi(lambda name: lib.get_function(name, query_imports=True), built)
    # ... and as the VM resolves the op table's ExternFuncs.
    funcs = dict(zip(built.functions.values(), vm["op_table"]()))
    _check_abi(funcs.__getitem__, built)


def test_two_modules_link_into_one_library(decode_module, tmp_path):
    """Two isolated copies of one module's objects (different export prefixes, as two configurations would
    have) link into one library: no duplicate host function, COMDAT or GNU-unique symbol."""
    import tvm

    objs = decode_module.source_objects()
    a = isolate_objects(objs, tmp_path / "a.o", "pagedkv_fi_test_a_")
    b = isolate_objects(objs, tmp_path / "b.o", "pagedkv_fi_test_b_")
    lib_path = tmp_path / "two.so"
    from pagedkv.flashinfer.link import export_options

    subprocess.run(["g++", "-shared", "-o", str(lib_path), str(tmp_path / "a.o"), str(tmp_path / "b.o"),
                    *export_options()], check=True)
    _load_cudart()
    lib = tvm.runtime.load_module(str(lib_path))
    for names in (a, b):
        with pytest.raises(Exception, match="Expected 15 but got 0 arguments"):
            lib[names["plan"]]()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PAGEDKV_FLASHINFER_ALL") != "1",
                    reason="the fp16 decode, prefill and MLA modules (minutes): set PAGEDKV_FLASHINFER_ALL=1")
@pytest.mark.parametrize("spec", OTHERS, ids=lambda s: f"{s.kind}-{s.dtype_q}")
def test_other_modules_match_pinned_abi(spec, tmp_path):
    import tvm

    built = build_module(spec)
    lib_path = tmp_path / "lib.so"
    from pagedkv.flashinfer.link import export_options

    subprocess.run(["g++", "-shared", "-o", str(lib_path), str(built.object_path), *export_options()], check=True)
    _load_cudart()
    _check_abi(tvm.runtime.load_module(str(lib_path)).__getitem__, built)
