"""The tensor-core CUDA prefill (path switch ``cuda_prefill_kernel``) on the build host: no GPU.

- The default where it serves: without the switch and with "auto" the prefill PrimFuncs of an fp16 / bf16 spec
  are the tensor-core ones in the op's default tile (same ``script()`` as "tc3" for the ragged op, "tc2" for
  the paged one, with ``mma.sync`` calls), "simt" gives the FP32 kernel, every mma.sync tile its stages in
  ``shared.dyn``; a spec it does not serve (float32, head dim 512) gets the SIMT kernel under "auto",
  and any tile forced on it raises naming why.
- ``nvcc --cubin -arch=sm_90a`` compiles each tile's kernels for the op auto takes it for (``NVCC_OPS``,
  ``NVCC_CASES``: head dims 64, 96, 128 and 256 among them) without
  register spills, and the SASS holds the expected HMMA count (``cuobjdump -sass``; skipped when cuobjdump is
  missing): per kernel and key tile, ``mtiles * (D/16 * TK/8)`` MMAs for S and ``mtiles * TK/16 * D/8`` for P V,
  every one unrolled (also counted in the CUDA source, without cuobjdump).

The numerical check needs a GPU (``tests/gpu/test_prefill_tc_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess

import pytest
from _cuda_support import nvcc_all, ops_cuda_source, ptxas_usage

from pagedkv import tir_kernels as tk
from pagedkv.kernel_spec import WG_PREFILL_TILES
from pagedkv.testing.cuda_source import kernel_defs
from pagedkv.kernel_table import auto_order
from pagedkv.tir_kernels.attention_cuda_prefill_tc import TC_TILES

from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)
SWITCH = "cuda_prefill_kernel"
OPS = ("attn_prefill_ragged", "attn_prefill_paged")
#: The mma.sync tiles (switch values; the wgmma ones: ``test_prefill_wg_compile.py``).
TILES = tuple(t for t, cfg in TC_TILES.items() if not cfg.wgmma)
SHAPES = {
    "32x8x128-f16": tk.KernelSpec(32, 8, 128, 128, "float16"),
    "12x4x64-bf16-w100-cap30": tk.KernelSpec(12, 4, 64, 64, "bfloat16", sliding_window=100, logits_soft_cap=30.0),
    "16x4x96-bf16-w100-cap30": tk.KernelSpec(16, 4, 96, 96, "bfloat16", sliding_window=100, logits_soft_cap=30.0),
    "8x2x256-bf16": tk.KernelSpec(8, 2, 256, 256, "bfloat16"),
}



def _with(cfg, value):
    return dataclasses.replace(cfg, paths={SWITCH: value})


def _script(cfg, op):
    return tk.FACTORIES[op](cfg, SM80).script()


def test_switch_is_registered_and_on_by_default():
    assert tk.SWITCHES[SWITCH][1] == ("auto", "simt", *TILES, *WG_PREFILL_TILES)  # test_prefill_wg_compile.py
    assert [v.name for v in auto_order("attn_prefill_ragged")] == ["wg1t", "tc3", "tcq", "simt"]
    assert [v.name for v in auto_order("attn_prefill_paged")] == ["wg2t", "tc2", "tcq", "simt"]


@pytest.mark.parametrize("op", OPS)
def test_tc_is_the_default_where_it_serves(op):
    cfg = SHAPES["32x8x128-f16"]
    default = _script(cfg, op)
    assert "pagedkv_mma_f16" in default
    first = next(v.name for v in auto_order(op) if v.name not in WG_PREFILL_TILES)  # sm_80: no wgmma tile
    assert _script(_with(cfg, "auto"), op) == default == _script(_with(cfg, first), op)
    assert "pagedkv_mma" not in _script(_with(cfg, "simt"), op)
    for tile in TILES:  # 128 rows, two stages in dynamic shared memory
        script = _script(_with(cfg if tile != "tcq" else SHAPES["8x2x256-bf16"], tile), op)
        assert "pagedkv_mma_" in script and "shared.dyn" in script
    unserved = tk.KernelSpec(4, 4, 64, 64, "float32")
    assert "pagedkv_mma" not in _script(unserved, op)
    assert _script(unserved, op) == _script(_with(unserved, "simt"), op)


@pytest.mark.parametrize("cfg,why", [(tk.KernelSpec(4, 4, 64, 64, "float32"), "dtype float32"),
                                     (tk.KernelSpec(4, 4, 512, 512, "float16"), "head dims 512"),
                                     (tk.KernelSpec(64, 1, 64, 64, "float16"), "GQA group 64")])
def test_tc_refuses_what_it_does_not_serve(cfg, why):
    for op in OPS:
        for tile in TILES:
            with pytest.raises(NotImplementedError, match=f"{SWITCH}={tile}: .*{why}"):
                tk.FACTORIES[op](_with(cfg, tile), SM80)


def test_tile_shared_memory():
    """Bytes a block holds: "tc2" two K and two V tiles of 64 keys, "tc3" two of each of 32 keys and Q's 128 rows
    (one dynamic buffer each)."""
    tiles = TC_TILES
    assert (tiles["tc2"].rows, tiles["tc2"].threads, tiles["tc2"].stages) == (128, 256, 2)
    assert tiles["tc2"].smem_bytes(128, 128) == 69632
    assert tiles["tc2"].smem_bytes(64, 64) == 36864
    assert (tiles["tc3"].rows, tiles["tc3"].threads, tiles["tc3"].stages, tiles["tc3"].tk) == (128, 128, 2, 32)
    assert tiles["tc3"].smem_bytes(128, 128) == 2 * 32 * 272 * 2 + 128 * 136 * 2 == 69632
    assert (tiles["tcq"].rows, tiles["tcq"].threads, tiles["tcq"].tk, tiles["tcq"].q_in_smem) == (128, 256, 32, True)
    assert tiles["tcq"].smem_bytes(256, 256) == 2 * 32 * 528 * 2 + 128 * 264 * 2 == 135168


#: The op nvcc compiles a tile for: the one auto takes it for (``kernel_table``: tc3 ragged, tc2 paged, tcq both);
#: the other op of each runs in ``test_prefill_tc_emulated.py``.
NVCC_OPS = {"tc3": ("attn_prefill_ragged",), "tc2": ("attn_prefill_paged",),
            "tcq": ("attn_prefill_ragged", "attn_prefill_paged")}
#: (shape, tile) compiled: tc2 and tc3 at head dims 128 and 64 (fp16; bf16 windowed + capped) and 96 (copies with
#: idle threads; windowed + capped: the most registers), tcq at 256 (``test_cuda_compile.py`` leaves these prefill
#: kernels to this module).
NVCC_CASES = [(name, tile) for name in ("32x8x128-f16", "12x4x64-bf16-w100-cap30", "16x4x96-bf16-w100-cap30")
              for tile in ("tc2", "tc3")] + [("8x2x256-bf16", "tcq")]


def _source(key):
    return ops_cuda_source(_with(SHAPES[key[0]], key[1]), NVCC_OPS[key[1]], SM80)


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tc")
    return workdir, nvcc_all(NVCC_CASES, _source, workdir, "tc_")


def _cuobjdump() -> str | None:
    return shutil.which("cuobjdump") or next(
        (str(p) for p in sorted(pathlib.Path("/usr/local").glob("cuda*/bin/cuobjdump"))), None)


def _sass_by_kernel(cubin: pathlib.Path) -> dict:
    """``{kernel: SASS text}`` of a cubin."""
    out = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True,
                         env={**os.environ}).stdout
    parts = re.split(r"\n\s*Function : (\w+)\n", out)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("name,tile", NVCC_CASES, ids=[f"{n}-{t}" for n, t in NVCC_CASES])
def test_tc_nvcc_no_spills_and_hmma(name, tile, nvcc_results):
    workdir, results = nvcc_results
    rc, log = results[(name, tile)]
    assert rc == 0, log[-3000:]
    usage = ptxas_usage(log)
    assert usage and all(max(u[1:]) == 0 for u in usage.values()), usage  # no spill stores or loads
    d, t = SHAPES[name].head_dim, TC_TILES[tile]
    want = t.mtiles * (d // 16 * t.tk // 8 + t.tk // 16 * d // 8)  # per kernel: S and P V of a key tile, unrolled
    # Each op's PrimFunc: the tensor-core kernel (the plain one) and the SIMT RoPE kernel (no MMA). In the
    # CUDA source TVM emitted (its unrolling), then, when cuobjdump is there, in the SASS (ptxas' code).
    source = (workdir / f"tc_{name}_{tile}.cu").read_text()
    calls = {k: len(re.findall(r"\bpagedkv_mma_b?f16\(", body)) for k, body in _kernel_bodies(source).items()}
    expected = [0] * len(NVCC_OPS[tile]) + [want] * len(NVCC_OPS[tile])
    assert sorted(calls.values()) == expected, calls
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (the SASS check needs it; the source count passed)")
    sass = _sass_by_kernel(workdir / f"tc_{name}_{tile}.cubin")
    counts = {k: len(re.findall(r"\bHMMA\.16816\.F32", s)) for k, s in sass.items()}
    assert sorted(counts.values()) == expected, counts


def _kernel_bodies(source: str) -> dict:
    """``{kernel: its statements}`` of a CUDA source (the declarations TVM puts first are skipped)."""
    return {k.name: k.body(source) for k in kernel_defs(source)}
