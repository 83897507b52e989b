"""The wgmma prefill tiles ("wg2t", "wg1t" of the path switch ``cuda_prefill_kernel``) on the build host: no GPU.

- They serve head dim 128 only (``kernel_spec.wg_prefill_limits``: head dim 64 gave wrong outputs on the H200 at
  GQA groups 3, 4 and 7); forcing one elsewhere raises naming the limit.
- They serve only a target arch of sm_90a (``KernelSpec.target_arch``, filled by ``tir_kernels.make`` from the
  target): forced for an sm_90 target one raises naming the arch; auto takes them there only
  (the selection table, ``pagedkv.kernel_table``).
- ``nvcc --cubin -arch=sm_90a`` compiles their ragged and paged kernels without register spills, in at most 255
  registers, with the expected wgmma count: per key tile ``D/16`` m64n64k16 for S and ``TK/16`` m64n{DV}k16 for
  P V, every one unrolled (in the CUDA source, then as HGMMA in the SASS when cuobjdump is there), each twice
  (the first tile's S and the last tile's P V are outside the loop), and, in the SASS, a ``wait_group 1`` with
  the softmax's exps (MUFU.EX2) before the next wait (P V in flight meanwhile). ptxas reports no serialized
  wgmma. The shared memory: three or four stages of K and V tiles, 128-byte swizzled, and their mbarriers.

The numerical checks: ``tests/cpu/test_prefill_tc_emulated.py`` (CPU emulation), ``tests/gpu/test_prefill_tc_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from _cuda_support import nvcc_all, ops_cuda_source, ptxas_usage
from test_prefill_tc_compile import _cuobjdump, _kernel_bodies, _sass_by_kernel

from pagedkv import tir_kernels as tk
from pagedkv.kernel_spec import WG_PREFILL_TILES
from pagedkv.tir_kernels import attention_cuda_prefill as pf
from pagedkv.tir_kernels.attention_cuda_prefill_tc import TC_TILES, tc_unserved

import tvm
from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)
SM90A = Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
SWITCH = "cuda_prefill_kernel"
OPS = ("attn_prefill_ragged", "attn_prefill_paged")
SHAPES = {
    "32x8x128-f16": tk.KernelSpec(32, 8, 128, 128, "float16"),
    "16x4x128-bf16-w100-cap30": tk.KernelSpec(16, 4, 128, 128, "bfloat16", sliding_window=100,
                                                logits_soft_cap=30.0),
}


WG_TILES = WG_PREFILL_TILES


def _wg(cfg, tile="wg1t"):
    return dataclasses.replace(cfg, paths={SWITCH: tile})


def test_wg_needs_sm90a_and_auto_takes_the_tma_tiles():
    """Forced wgmma tiles raise for sm_90 naming the arch; auto takes the TMA tiles, wg1t for the ragged op and
    wg2t for the paged one, on sm_90a at head dim 128 (on sm_90 or at head dim 64: tc3 ragged, tc2 paged)."""
    cfg = SHAPES["32x8x128-f16"]
    for op in OPS:
        with pytest.raises(NotImplementedError, match="sm_90a"):
            tk.FACTORIES[op](_wg(cfg), SM80)
    spec = dataclasses.replace(cfg, target_arch="sm_90a")
    assert pf.use_tensor_cores(OPS[0], spec) == "wg1t"
    assert pf.use_tensor_cores(OPS[1], spec) == "wg2t"
    assert pf.use_tensor_cores(OPS[1], cfg) == "tc2"  # no target arch: no wgmma; the paged op's first mma.sync tile
    assert pf.use_tensor_cores(OPS[0], cfg) == "tc3"
    d64 = dataclasses.replace(tk.KernelSpec(16, 4, 64, 64, "float16"), target_arch="sm_90a")
    assert pf.use_tensor_cores(OPS[0], d64) == "tc3"
    assert pf.use_tensor_cores(OPS[1], d64) == "tc2"
    assert pf.use_tensor_cores(OPS[1], _wg(spec)) == "wg1t"
    assert "target_arch" not in cfg.to_dict() and spec.to_dict()["target_arch"] == "sm_90a"


@pytest.mark.parametrize("cfg", [tk.KernelSpec(12, 4, 64, 64, "bfloat16"), tk.KernelSpec(16, 4, 64, 64, "float16"),
                                 tk.KernelSpec(21, 3, 64, 64, "float16")], ids=["g3", "g4", "g7"])
def test_wg_refuses_head_dim_64(cfg):
    from pagedkv.kernel_spec import wg_prefill_limits

    assert "head dims 64/64" in wg_prefill_limits(64, 64)[0]
    for op in OPS:
        with pytest.raises(NotImplementedError, match="head dims 64/64"):
            tk.FACTORIES[op](_wg(cfg), SM90A)
    assert wg_prefill_limits(128, 128) == []
    for g in (1, 3, 4, 7, 8):  # head dim 128 at every group the tensor-core prefill takes
        assert tc_unserved(tk.KernelSpec(8 * g, 8, 128, 128, "float16", target_arch="sm_90a"), 128,
                              "wg1t") is None


def test_wg_tile_shared_memory():
    t2t = TC_TILES["wg2t"]  # 128-byte swizzled rows (no padding), 1024 bytes of alignment slack, 4 mbarriers
    assert (t2t.stages, t2t.ahead, t2t.tma, t2t.row_elems(128)) == (4, 2, True, 128)
    assert t2t.smem_bytes(128, 128) == 4 * 64 * 256 * 2 + 1024 + 4 * 8 <= 227 * 1024
    assert t2t.bar_base(128, 128, 1) == 4 * 64 * 256 + 4
    t1t = TC_TILES["wg1t"]  # one warpgroup, 3 stages: two blocks an SM (228 KB, 1 KB reserved a block)
    assert (t1t.rows, t1t.threads, t1t.stages, t1t.ahead, t1t.tma) == (64, 128, 3, 1, True)
    assert t1t.smem_bytes(128, 128) == 3 * 64 * 256 * 2 + 1024 + 3 * 8
    assert 2 * (t1t.smem_bytes(128, 128) + 1024) <= 228 * 1024
    for tile in WG_TILES:
        with pytest.raises(NotImplementedError, match="sm_90a"):
            tk.FACTORIES[OPS[0]](_wg(SHAPES["32x8x128-f16"], tile), SM80)


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("wg")
    return workdir, nvcc_all([(name, tile) for name in SHAPES for tile in WG_TILES],
                             lambda key: ops_cuda_source(_wg(SHAPES[key[0]], key[1]), _ops(key[1]), SM90A), workdir,
                             "wg_")


def _ops(tile):
    """The op whose automatic choice the wgmma tile is (the selection table: wg1t ragged, wg2t paged): nvcc
    compiles that one (a covering set; the forced other op of each tile runs in the emulated tests)."""
    from pagedkv.kernel_table import variants

    return tuple(op for op in OPS if op in next(v for v in variants(op) if v.name == tile).priority)


@pytest.mark.parametrize("tile", WG_TILES)
@pytest.mark.parametrize("name", list(SHAPES))
def test_wg_nvcc_no_spills_and_wgmma(name, tile, nvcc_results):
    workdir, results = nvcc_results
    rc, log = results[(name, tile)]
    assert rc == 0, log[-3000:]
    usage = ptxas_usage(log)
    assert usage and all(max(u[1:]) == 0 for u in usage.values()), usage
    assert "instructions are serialized" not in log and "warpgroup.wait is injected" not in log, log[-3000:]
    print(name, tile, usage)  # registers, spill stores, spill loads per kernel (the report quotes them)
    d, t = SHAPES[name].head_dim, TC_TILES[tile]
    want = (d // 16 + t.tk // 16) * 2  # per kernel: S and P V of a key tile, unrolled, in and outside the loop
    source = (workdir / f"wg_{name}_{tile}.cu").read_text()
    calls = {k: len(re.findall(r"\bpagedkv_wgmma_n\d+_b?f16_t[01]\(", body)) for k, body in _kernel_bodies(source).items()}
    n_ops = len(_ops(tile))
    # Per op: the SIMT RoPE kernel, the tile's kernel, and its fallback (mma.sync: operands TMA cannot read).
    others = n_ops * 2
    assert sorted(calls.values()) == [0] * others + [want] * n_ops, calls
    bodies = _kernel_bodies(source).values()
    # mma.sync only in the fallback kernel, which has no wgmma
    assert all("pagedkv_wgmma_" not in b for b in bodies if "pagedkv_mma_" in b)
    assert sum("pagedkv_mma_" in b for b in bodies) == n_ops
    for body in bodies:
        if "pagedkv_wgmma_" in body:  # one block barrier a key tile, no named barriers
            assert "__syncthreads" in body and "pagedkv_bar_sync(" not in body, tile
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (the SASS check needs it; the source count passed)")
    sass = _sass_by_kernel(workdir / f"wg_{name}_{tile}.cubin")
    counts = {k: len(re.findall(r"\bHGMMA\.64x\d+x16\.F32", s)) for k, s in sass.items()}
    assert sorted(counts.values()) == [0] * others + [want] * n_ops, counts
    waits = {k: set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", s)) for k, s in sass.items() if "HGMMA" in s}
    assert all(w == {"0x0", "0x1"} for w in waits.values()), waits
    for k, s in sass.items():  # the softmax's exps run while P V is in flight: between wait_group 1 and the next wait
        if "HGMMA" in s:
            window = s.split("DEPBAR.LE gsb0, 0x1")[1].split("DEPBAR.LE gsb0, 0x0")[0]
            assert window.count("MUFU.EX2") >= t.tk // 2, (k, window.count("MUFU.EX2"))


def test_wg_tiles_are_declared_once():
    """``kernel_spec.WG_PREFILL_TILES`` (TVM-free) lists exactly the ``wgmma`` tiles (all ``tma``); each op's
    fallback tile is its first non-TMA default (mma.sync: it serves head dims 64 and 128, so every spec the TMA
    tile does)."""
    assert WG_TILES == tuple(t for t, c in TC_TILES.items() if c.wgmma)
    spec = dataclasses.replace(SHAPES["32x8x128-f16"], target_arch="sm_90a")
    assert [pf.tma_fallback(op, spec) for op in OPS] == ["tc3", "tc2"]
    for t in WG_TILES:
        assert TC_TILES[t].tma and TC_TILES[t].stages in (3, 4) and TC_TILES[t].tk == 64


def test_tma_primfuncs_test_their_operands_for_tma():
    """The PrimFuncs of a TMA tile: the tensors TMA reads declared element-aligned (the host's address tests are
    not folded by TVM's 64-byte assumption), their addresses tested with ``llvm.ptrmask`` (paged: and the page
    size, a multiple of 8), the tensor maps encoded in the TMA branch, the fallback kernel in the other."""
    spec = _wg(dataclasses.replace(SHAPES["32x8x128-f16"], target_arch="sm_90a"), "wg2t")
    ragged, paged = (tk.FACTORIES[op](spec, SM90A).script() for op in OPS)
    assert ragged.count("llvm.ptrmask") == 2 and ragged.count('"runtime.cuTensorMapEncodeTiled"') == 2
    for name in ("k", "v"):
        assert re.search(rf'\b{name}: T\.Buffer\([^)]*\), "float16", align=2', ragged)
    assert paged.count("llvm.ptrmask") == 1 and paged.count('"runtime.cuTensorMapEncodeTiled"') == 1
    assert re.search(r'\bpages: T\.Buffer\([^)]*\), "float16", align=2', paged) and "T.truncmod(ps, 8) == 0" in paged
    for script in (ragged, paged):
        assert "pagedkv_mma_f16" in script and "pagedkv_wgmma_" in script  # fallback and TMA kernels
    assert "align=2" not in tk.FACTORIES[OPS[0]](_wg(spec, "tc3"), SM90A).script()


def test_host_aligned16_on_element_aligned_views():
    """``_tma_cuda.host_aligned16`` in host (LLVM) code: 16-byte aligned torch views pass, others do not, on a
    buffer declared element-aligned as the TMA tile's k / v are."""
    import torch
    from tvm.script import tirx as T

    from pagedkv.tir_kernels._tma_cuda import host_aligned16

    @T.prim_func
    def probe(a_h: T.handle, r_h: T.handle, n: T.int32):
        a = T.match_buffer(a_h, (n,), "float16", elem_offset=T.int32(), align=2)
        r = T.match_buffer(r_h, (1,), "int32")
        if host_aligned16(T.address_of(a[0])):
            r[0] = 1
        else:
            r[0] = 0

    mod = tvm.compile(tvm.IRModule({"main": probe}), target="llvm")
    buf, res = torch.randn(64).half(), torch.full((1,), -1, dtype=torch.int32)
    for off in (0, 1, 3, 8, 9, 16):
        mod(buf[off:off + 16], res, 16)
        assert int(res[0]) == int(buf[off:].data_ptr() % 16 == 0), off
