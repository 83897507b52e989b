"""The tensor-core prefill's generated CUDA, run on the CPU (no GPU): TVM's source of the kernel, compiled with g++
against ``_cuda_emu.h`` (one fiber per CUDA thread, run in a random order between waits; barriers, ``cp.async``
completing as late as its waits allow, and the warp-collective ``shfl_xor`` / ``ldmatrix`` / ``mma.sync`` emulated
from the PTX ISA's definitions), checked against the float64 reference on ragged and paged batches of odd lengths
(tile, page and 128-row block edges, entries with no keys or no queries; pages of 16, 24, 40 and 5 keys), causal and
not, fp16 and bf16, windowed + soft-capped, ragged k / v also unaligned (the element-load path), ragged with a value
head dim other than the qk one (128 / 64, 64 / 128: separate K and V copy loops). Tiles
(``TC_TILES``): "tc2" and "tc3" on GQA groups 1, 3, 4, 7, 8 and head dims 64 / 96 / 128 for the op auto takes each
for (the other op on two configs: a covering set, ``CASES``), "tcq" at head dim 256 on both ops, the wgmma tiles "wg1t", "wg2t" (built for sm_90a; TMA boxes and mbarriers emulated; the emulator's wgmma is
a warpgroup collective performed at the ``wait_group`` that completes its group, B read through the descriptor's
strides then) on what they serve (head dim 128, groups 1, 7, 8), fp16 and bf16, windowed + capped. Fresh random inputs each run
(the messages name the seed). NaN runs (issue 44, ``NAN_RUNS``; the SIMT prefill's too, on ``_decode_emu``'s
harness): a NaN q row and NaN keys give NaN rows, and only where a row sees them. This checks the kernel's own logic (tiles, entry search, masks, online softmax,
pipeline order and waits, K / V copies: full tiles and the last one, stores) as TVM lowered it; the GPU run
(``tests/gpu/test_prefill_tc_gpu.py``) checks the hardware side (real MMA rounding, timing). Skips without g++.

The kernel is the ``apply_rope = 0`` one (the PrimFunc's host code picks it); its launch is the tile's threads
(``__launch_bounds__``) x ``(max(n // TQ + B, 1), Hkv)`` blocks as TVM's host code launches it; the dynamic
shared memory of the multi-stage tiles becomes a static array.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from _cuda_support import cuda_source_of
from _decode_emu import build as emu_build
from _decode_emu import launches, run_launches, tensor_map

from pagedkv import tir_kernels as tk
from pagedkv.testing import nan_rows
from pagedkv.testing import reference as R
from pagedkv.testing.cuda_source import hide_params, static_shared, tensor_core_kernel, unused_params
from pagedkv.tir_kernels.attention_cuda_prefill_tc import TC_TILES, tma_maps

import tvm
from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)
#: The wgmma tiles' target (their instructions need sm_90a; the tiles refuse other archs).
SM90A = Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
HERE = pathlib.Path(__file__).resolve().parent
LOG2E = math.log2(math.e)
#: (queries, keys) per entry: tile edges (64 and 128 rows of a block are 64 / G and 128 / G tokens; key tiles of
#: 64, pages of PAGE_SIZES), more and fewer keys than queries, empty sides.
ENTRIES = [(1, 1), (17, 17), (65, 65), (70, 130), (20, 6), (5, 0), (0, 3), (64, 64), (150, 150), (33, 200),
           (120, 0)]
CONFIGS = {
    "8x2x64-f16": tk.KernelSpec(8, 2, 64, 64, "float16"),
    "6x2x64-bf16-w40-cap20": tk.KernelSpec(6, 2, 64, 64, "bfloat16", sliding_window=40, logits_soft_cap=20.0),
    "4x1x128-f16": tk.KernelSpec(4, 1, 128, 128, "float16"),
    "2x2x128-f16": tk.KernelSpec(2, 2, 128, 128, "float16"),
    "7x1x128-bf16": tk.KernelSpec(7, 1, 128, 128, "bfloat16"),
    "8x1x64-bf16": tk.KernelSpec(8, 1, 64, 64, "bfloat16"),
    # Head dim 96: 12 16-byte chunks a key, which 256 / 128 threads do not divide (idle copy threads).
    "7x1x96-bf16": tk.KernelSpec(7, 1, 96, 96, "bfloat16"),
    # Head dim 256: the "tcq" tile's.
    "8x2x256-bf16-w40-cap20": tk.KernelSpec(8, 2, 256, 256, "bfloat16", sliding_window=40, logits_soft_cap=20.0),
    "2x2x256-f16": tk.KernelSpec(2, 2, 256, 256, "float16"),
}
#: Ragged-only configs with a value head dim other than the qk one (``attn_prefill_ragged`` alone takes
#: ``Dv != D``): K and V tiles are copied by separate loops (``_prefill_tc_copy``'s pair loop needs the same dims).
DV_CONFIGS = {
    "4x2x128v64-f16": tk.KernelSpec(4, 2, 128, 64, "float16"),
    "3x1x64v128-bf16-w40-cap20": tk.KernelSpec(3, 1, 64, 128, "bfloat16", sliding_window=40,
                                                 logits_soft_cap=20.0),
}
#: Configs of the wgmma tiles' runs only (windowed + capped at D 128, which the tiles serve).
WG_CONFIGS = {
    "16x2x128-bf16-w40-cap20": tk.KernelSpec(16, 2, 128, 128, "bfloat16", sliding_window=40, logits_soft_cap=20.0),
}
ALL_CONFIGS = {**CONFIGS, **DV_CONFIGS, **WG_CONFIGS}
#: Page size of each config's paged runs: 16 divides the 64-key tiles, the others do not (24, 40, 5: a chunk's
#: page offset wraps past the page end, the carry of ``_prefill_tc_copy``'s one-division-a-tile page lookup).
PAGE_SIZES = {"8x2x64-f16": 16, "6x2x64-bf16-w40-cap20": 24, "4x1x128-f16": 5, "2x2x128-f16": 16,
              "7x1x128-bf16": 40, "8x1x64-bf16": 16, "16x2x128-bf16-w40-cap20": 24, "7x1x96-bf16": 40,
              "8x2x256-bf16-w40-cap20": 16, "2x2x256-f16": 5}
OPS = ("attn_prefill_ragged", "attn_prefill_paged")
#: (config, tile, op) runs, a covering set: each mma.sync tile on four configs for the op auto takes it for (tc3:
#: ragged, on GQA groups 3, 1, 7, 8; tc2: paged, on groups 4, 4, 3, 7 with pages of 16, 5, 24, 40 keys; between
#: them head dims 64, 96 and 128, fp16 and bf16, windowed + capped; ``kernel_table``), and on two configs for the
#: other op (the stages are shared; the op changes only the K / V copy: ragged rows or pages, a wrapping page size
#: among them). Each op runs groups 4 and 3 at D 64 (tc2 ragged and paged on 8x2x64-f16; tc3 ragged, tc2 and tc3
#: paged on the windowed + capped 6x2x64-bf16). "tcq" (auto's tile for both ops at head dim 256) on one config an
#: op: ragged windowed + capped bf16 (group 4), paged fp16 (group 1, pages of 5 keys).
TC3_CONFIGS = ["6x2x64-bf16-w40-cap20", "2x2x128-f16", "7x1x96-bf16", "8x1x64-bf16"]
TC2_CONFIGS = ["8x2x64-f16", "4x1x128-f16", "6x2x64-bf16-w40-cap20", "7x1x96-bf16"]
OTHER_OP = {"tc3": ("attn_prefill_paged", ["4x1x128-f16", "6x2x64-bf16-w40-cap20"]),
            "tc2": ("attn_prefill_ragged", ["8x2x64-f16", "7x1x128-bf16"])}
TCQ_CASES = [("8x2x256-bf16-w40-cap20", "tcq", "attn_prefill_ragged"), ("2x2x256-f16", "tcq", "attn_prefill_paged")]
CASES = ([(name, "tc3", "attn_prefill_ragged") for name in TC3_CONFIGS]
         + [(name, "tc2", "attn_prefill_paged") for name in TC2_CONFIGS]
         + [(name, tile, op) for tile, (op, names) in OTHER_OP.items() for name in names] + TCQ_CASES)
#: The unaligned-view (element-load) runs, ragged, on built kernels: two configs on "tc2", three on "tc3" (auto's
#: ragged tile; head dim 96: idle threads in the element loads), one on "tcq"; groups 1, 3, 4, 7, 8 among them.
UNALIGNED = ([(n, "tc2") for n in OTHER_OP["tc2"][1]]
             + [(n, "tc3") for n in ("6x2x64-bf16-w40-cap20", "7x1x96-bf16", "8x1x64-bf16")]
             + [("8x2x256-bf16-w40-cap20", "tcq")])
#: The ``Dv != D`` runs (ragged): both configs on every mma.sync tile; unaligned on "tc3" (auto's ragged tile).
DV_CASES = [(name, t) for t in ("tc2", "tc3") for name in DV_CONFIGS]
DV_UNALIGNED = [(name, "tc3") for name in DV_CONFIGS]
#: The wgmma tiles' runs (config, op, causal), few (each emulates 128 threads for minutes), on what they serve
#: (``kernel_spec.wg_prefill_limits``: D 128): GQA groups 7 (bf16), 1 (fp16), 8 (bf16, windowed + capped);
#: ragged and paged, causal and not.
WG_RUNS = [("7x1x128-bf16", "attn_prefill_ragged", 1), ("7x1x128-bf16", "attn_prefill_paged", 0),
           ("2x2x128-f16", "attn_prefill_ragged", 0), ("2x2x128-f16", "attn_prefill_paged", 1),
           ("16x2x128-bf16-w40-cap20", "attn_prefill_ragged", 1), ("16x2x128-bf16-w40-cap20", "attn_prefill_paged", 1)]
#: The ragged ones and one paged on "wg1t" (auto's ragged tile on sm_90a: one warpgroup, 3 stages, TMA, paged boxes
#: from two groups a warp); the paged ones and one ragged on "wg2t" (auto's paged tile on sm_90a: wg1t's code on two warpgroups,
#: 4 stages, P V overlapping the softmax in both: the waits' order matters; paged boxes from one group a warp).
#: Unaligned views are not run on them: the PrimFunc's host code hands those to the mma.sync fallback tile.
WG_TILE_RUNS = ([("wg1t", *r) for r in WG_RUNS if r[1] == "attn_prefill_ragged" or r == WG_RUNS[1]]
                + [("wg2t", *r) for r in WG_RUNS if r[1] == "attn_prefill_paged" or r == WG_RUNS[2]])
#: NaN rows after the last entry's keys in ragged k / v (TMA boxes read past an entry's end).
TAIL_ROWS = 70
#: Bytes of the static array standing in for a kernel's dynamic shared memory.
DYN_SMEM_BYTES = 256 * 1024


def _kernel_source(src: str) -> tuple[str, str, list, int, frozenset]:
    """(kernel name, its definition for g++, [(type, name)] params, threads a block, unused param indices) of
    the tensor-core kernel in a module's source."""
    k = tensor_core_kernel(src)
    unused = unused_params(k, src)
    return k.name, static_shared(hide_params(k.text(src), k, unused), DYN_SMEM_BYTES), k.params, k.threads, unused


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``get(name, tile, op)``: (library, params, unused param indices) of the config's kernel for ``op`` on
    ``tile``, built once."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    out = {}
    workdir = tmp_path_factory.mktemp("emu")

    def get(name, tile, op):
        if (name, tile, op) not in out:
            out[(name, tile, op)] = _build(ALL_CONFIGS[name], tile, op, workdir / f"{name}-{tile}-{op}")
        return out[(name, tile, op)]

    return get


def _build(cfg, tile, op, stem):
    cfg = dataclasses.replace(cfg, paths={"cuda_prefill_kernel": tile})
    target = SM90A if TC_TILES[tile].wgmma else SM80
    func = tk.build_kernels(cfg, target, ops=(op,))[op]
    with target:
        exe = tvm.compile(tvm.IRModule({f"pagedkv_{op}": func}), target=target)
    kname, body, params, threads, unused = _kernel_source(cuda_source_of(exe))
    assert threads == TC_TILES[tile].threads, (threads, tile)
    assert "extern __shared__" in cuda_source_of(exe)  # every tile: its stages in dynamic shared memory
    args = []
    for i, (ty, pname) in enumerate(params):
        if "CUtensorMap" in ty:  # a TMA tile's tensor map: the struct _decode_emu.tensor_map fills, by value
            args.append(f"*(const CUtensorMap*)ptrs[{i}]")
        elif i in unused:
            args.append("0")  # a value the host code computes for the launch only (e.g. a grid size)
        else:
            args.append(f"({ty})ptrs[{i}]" if ty.endswith("*") else f"(({ty})nums[{i}])")
    cpp = stem.with_suffix(".cpp")
    cpp.write_text(f'#define PAGEDKV_EMU_THREADS {threads}\n#include "{HERE / "_cuda_emu.h"}"\n{body}\n'
                   f'extern "C" void run(void** ptrs, double* nums, int gx, int gy) {{\n'
                   f'  launch(gx, gy, [=]() {{ {kname}({", ".join(args)}); }});\n}}\n')
    lib = stem.with_suffix(".so")
    proc = subprocess.run(["g++", "-O1", "-std=c++20", "-shared", "-fPIC", "-pthread", "-w", "-o", str(lib),
                           str(cpp)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(lib)), params, unused


def _to_storage(x: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return x.to(torch.float16).numpy().copy()
    return x.to(torch.bfloat16).view(torch.int16).numpy().copy()


def _from_storage(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(a.copy())
    return (t if dtype == "float16" else t.view(torch.bfloat16)).double()


def _run(built, arrays: dict, scalars: dict, grid, maps=None):
    lib, params, unused = built
    ptrs = (ctypes.c_void_p * len(params))()
    nums = (ctypes.c_double * len(params))()
    keep = []
    for i, (ty, pname) in enumerate(params):
        if "CUtensorMap" in ty:
            tensor, tmap = maps[pname]
            keep.append(tensor_map(arrays[tensor], tmap))
            ptrs[i] = ctypes.addressof(keep[-1])
        elif i in unused:
            continue  # passed as 0 by the launcher (_build)
        elif ty.endswith("*"):
            ptrs[i] = arrays[pname.removesuffix("_ptr")].ctypes.data
        elif pname in scalars:
            nums[i] = scalars[pname]
        elif re.fullmatch(r"v(_\d+)?", pname):
            nums[i] = 0  # element offsets: every view starts at its buffer
        elif ty == "float":
            nums[i] = scalars["scale2"]  # the one float: sm_scale * log2(e), hoisted by TVM
        else:
            raise AssertionError(f"unknown kernel parameter {ty} {pname}")
    lib.run(ptrs, nums, grid[0], grid[1])


def _misaligned(a: np.ndarray) -> np.ndarray:
    """``a`` copied into a buffer one element in: not 16-byte aligned (the kernel's element-load path)."""
    buf = np.empty(a.size + 1, a.dtype)
    out = buf[1:].reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 16
    return out


#: The runs of ``CASES``, causal and not alternating over each (tile, op)'s configs, so that each tile runs each
#: op causal and not without the product of the two.
CASE_RUNS = [(name, tile, op, 1 - [c[1:] for c in CASES[:i]].count((tile, op)) % 2)
             for i, (name, tile, op) in enumerate(CASES)]


@pytest.mark.parametrize("name,tile,op,causal", CASE_RUNS,
                         ids=[f"{t}-{n}-{o.removeprefix('attn_prefill_')}-{c}" for n, t, o, c in CASE_RUNS])
def test_emulated_kernel_matches_reference(name, tile, op, causal, built):
    _check(name, tile, op, causal, built, misalign=False)


#: 45 entries (new tokens, keys), empty ones included: the kernels' entry search takes two rounds of 32 probes;
#: one entry: none (``ENTRIES``' 10 take one). On tc2's 8x2x64-f16 kernels, built for both ops by ``CASES`` (the
#: search is the tiles' shared stage code).
SEARCH_ENTRIES = {"45": [(i % 6, i % 6 + i % 4) for i in range(45)], "1": [(37, 80)]}


@pytest.mark.parametrize("op", ["attn_prefill_ragged", "attn_prefill_paged"])
@pytest.mark.parametrize("entries", list(SEARCH_ENTRIES))
def test_emulated_entry_search_rounds(entries, op, built):
    _check("8x2x64-f16", "tc2", op, 1, built, misalign=False, entries=SEARCH_ENTRIES[entries])


@pytest.mark.parametrize("name,tile", UNALIGNED, ids=[f"{t}-{n}" for n, t in UNALIGNED])
def test_emulated_unaligned_ragged_views(name, tile, built):
    _check(name, tile, "attn_prefill_ragged", 1, built, misalign=True)


@pytest.mark.parametrize("name,tile", DV_CASES, ids=[f"{t}-{n}" for n, t in DV_CASES])
def test_emulated_value_dim_differs(name, tile, built):
    """Causal on one config, not on the other, per tile (the unaligned runs below are causal on both)."""
    _check(name, tile, "attn_prefill_ragged", int(name == list(DV_CONFIGS)[0]), built, misalign=False)


@pytest.mark.parametrize("name,tile", DV_UNALIGNED, ids=[f"{t}-{n}" for n, t in DV_UNALIGNED])
def test_emulated_value_dim_differs_unaligned(name, tile, built):
    _check(name, tile, "attn_prefill_ragged", 1, built, misalign=True)


@pytest.mark.parametrize("tile,name,op,causal", WG_TILE_RUNS,
                         ids=[f"{t}-{n}-{o.removeprefix('attn_prefill_')}-{c}" for t, n, o, c in WG_TILE_RUNS])
def test_emulated_wg_kernel_matches_reference(tile, name, op, causal, built):
    _check(name, tile, op, causal, built, misalign=False)


#: The partial-state variants (``*_partial``: o in float32, a multi-pass forward's passes): the multi-stage tiles
#: write their float32 o from the fragments instead of through the storage-dtype stage buffer. A covering set:
#: one mma.sync tile and one wgmma tile (the store is per fragment layout: tc2 / tc3 share one, wg1t / wg2t the
#: other), both ops, both dtypes, causal and not.
PARTIAL_RUNS = [("tc3", "7x1x128-bf16", "attn_prefill_ragged_partial", 1),
                ("wg2t", "2x2x128-f16", "attn_prefill_paged_partial", 0)]


@pytest.mark.parametrize("tile,name,op,causal", PARTIAL_RUNS,
                         ids=[f"{t}-{n}-{o.removeprefix('attn_prefill_')}-{c}" for t, n, o, c in PARTIAL_RUNS])
def test_emulated_partial_kernel_matches_reference(tile, name, op, causal, built):
    _check(name, tile, op, causal, built, misalign=False)


#: The NaN runs' poisoned elements on ``ENTRIES``: (entry, "q" or "k", row, head); entry 3 is (70, 130): its query
#: i sits at key 60 + i, so causal rows 40.. see key 100, a window of 40 rows 40 .. 69; entry 8 is (150, 150).
NAN_AT = [(3, "q", 10, 0), (3, "k", 100, 0), (8, "k", 3, -1)]
#: The NaN runs (issue 44): a NaN q row and NaN keys give NaN rows, the rows that do not see a NaN key match the
#: reference (on main the NaN rows came out as the empty state). The empty-row test is one store predicate
#: (``_common.no_keys`` in ``_prefill_tc_store``) per fragment layout: one mma.sync tile (tc3: ragged, causal,
#: windowed + capped) and one wgmma tile (wg2t: paged) on builds the runs above make anyway.
NAN_RUNS = [("tc3", "6x2x64-bf16-w40-cap20", "attn_prefill_ragged", 1),
            ("wg2t", "2x2x128-f16", "attn_prefill_paged", 1)]


@pytest.mark.parametrize("tile,name,op,causal", NAN_RUNS,
                         ids=[f"{t}-{n}-{o.removeprefix('attn_prefill_')}-{c}" for t, n, o, c in NAN_RUNS])
def test_emulated_nan_propagates(tile, name, op, causal, built):
    _check(name, tile, op, causal, built, misalign=False, nan=True)


def _check(name, tile, op, causal, built, misalign, entries=None, nan=False):
    entries = entries or ENTRIES
    cfg = ALL_CONFIGS[name]
    kernel = built(name, tile, op)
    partial = op.endswith("_partial")  # o in float32
    op = op.removesuffix("_partial")
    hq, hkv, d, dt = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
    dv = cfg.v_head_dim or d
    seed = int(torch.randint(0, 2**31 - 1, (1,)))  # fresh inputs each run; the failure messages name the seed
    gen = torch.Generator().manual_seed(seed)
    rnd = getattr(torch, dt)
    ents = [tuple(torch.randn(r, h, dim, generator=gen).to(rnd).double()
                  for r, h, dim in ((nq, hq, d), (nk, hkv, d), (nk, hkv, dv))) for nq, nk in entries]
    for e, what, r, h in (NAN_AT if nan else []):
        ents[e][0 if what == "q" else 1][r, h, d // 3] = float("nan")
    n, B, ps = sum(e[0].shape[0] for e in ents), len(ents), PAGE_SIZES.get(name, 0)  # ragged-only configs: no pages
    sm_scale = 0.8 / math.sqrt(d)
    q = torch.cat([e[0] for e in ents])
    arrays = {"q": _to_storage(q, dt), "q_indptr": np.cumsum([0] + [e[0].shape[0] for e in ents]).astype(np.int32),
              "o": np.full((n, hq, dv), np.nan, np.float32) if partial else
              np.full((n, hq, dv), np.nan, np.float16) if dt == "float16" else np.full((n, hq, dv), -1, np.int16),
              "lse": np.full((n, hq), np.nan, np.float32)}
    if op == "attn_prefill_ragged":
        # Rows past the last entry's keys (a buffer larger than the batch), NaN: a kernel must not use them.
        tail = [torch.full((TAIL_ROWS, hkv, dim), float("nan"), dtype=torch.float64) for dim in (d, dv)]
        arrays["k"] = _to_storage(torch.cat([e[1] for e in ents] + tail[:1]), dt)
        arrays["v"] = _to_storage(torch.cat([e[2] for e in ents] + tail[1:]), dt)
        arrays["kv_indptr"] = np.cumsum([0] + [e[1].shape[0] for e in ents]).astype(np.int32)
        if misalign:  # q and o too: "tc3" copies q rows with cp.async, multi-stage tiles o rows, when aligned
            arrays["k"], arrays["v"] = _misaligned(arrays["k"]), _misaligned(arrays["v"])
            arrays["q"], arrays["o"] = _misaligned(arrays["q"]), _misaligned(arrays["o"])
    else:
        counts = [-(-e[1].shape[0] // ps) for e in ents]
        order = np.random.default_rng(seed).permutation(sum(counts) + 2)
        pages = torch.full((len(order), 2, hkv, ps, d), float("nan"), dtype=torch.float64)
        values, last, pos = [], [], 0
        for (_q, k, v), cnt in zip(ents, counts):
            ids = [int(order[pos + i]) for i in range(cnt)]
            pos += cnt
            for i, pg in enumerate(ids):
                rows = slice(i * ps, min((i + 1) * ps, k.shape[0]))
                pages[pg, 0, :, :rows.stop - rows.start] = k[rows].transpose(0, 1)
                pages[pg, 1, :, :rows.stop - rows.start] = v[rows].transpose(0, 1)
            values += ids
            last.append(k.shape[0] - (cnt - 1) * ps if cnt else 0)
        arrays.update(pages=_to_storage(pages, dt), page_indptr=np.cumsum([0] + counts).astype(np.int32),
                      page_values=np.array(values or [0], np.int32), last_page_len=np.array(last, np.int32))
    tq = TC_TILES[tile].rows // (hq // hkv)
    maps = (tma_maps(dataclasses.replace(cfg, target_arch="sm_90a"), tile, op == "attn_prefill_paged")
            if TC_TILES[tile].tma else None)
    _run(kernel, arrays, {"B": B, "n": n, "causal": causal, "ps": ps, "scale2": sm_scale * LOG2E},
         (max(n // tq + B, 1), hkv), maps)
    o = torch.from_numpy(arrays["o"]).double() if partial else _from_storage(arrays["o"], dt)
    lse = torch.from_numpy(arrays["lse"]).double()
    row = 0
    for (eq, ek, ev), (nq, nk) in zip(ents, entries):
        if nq:
            ro, rl = R.attention(eq, ek, ev, sm_scale, bool(causal), sliding_window=cfg.sliding_window,
                                 logits_soft_cap=cfg.logits_soft_cap)
            what = f"seed {seed} entry ({nq}, {nk})"
            keep = nan_rows.check(o[row:row + nq], lse[row:row + nq], ro, what)  # rows (token, head) without NaN
            got, gl, ro, rl = o[row:row + nq][keep], lse[row:row + nq][keep], ro[keep], rl[keep]
            empty = rl <= -1e29
            assert torch.all(got[empty] == 0) and torch.all((gl[empty] + 1e30).abs() <= 1e24), f"{what}: empty rows"
            if (~empty).any():
                rel = ((got - ro)[~empty].norm() / ro[~empty].norm()).item()
                assert rel < 1e-2, f"{what}: |o - ref| / |ref| = {rel:.3g}"
                assert torch.allclose(gl[~empty], rl[~empty], atol=2e-2, rtol=1e-3), f"{what}: lse"
        row += nq


#: The SIMT prefill (``cuda_prefill_kernel=simt``: auto's kernel for float32 and for inline RoPE), float32,
#: windowed + capped, GQA group 2, on ``_decode_emu``'s harness (TVM's host code launches it).
SIMT_CFG = tk.KernelSpec(4, 2, 64, 64, "float32", sliding_window=40, logits_soft_cap=20.0)


@pytest.fixture(scope="module")
def simt_built(tmp_path_factory):
    """``SIMT_CFG``'s ragged prefill on the SIMT kernel, for ``_decode_emu.run_launches``."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    return emu_build(SIMT_CFG, {"cuda_prefill_kernel": "simt"}, tmp_path_factory.mktemp("simt") / "simt",
                     op="attn_prefill_ragged")


@pytest.mark.parametrize("apply_rope", [0, 1], ids=["plain", "rope"])
def test_emulated_simt_nan_propagates(apply_rope, simt_built):
    """Issue 44 on the SIMT prefill (ragged, causal): ``NAN_AT``'s NaN q row and keys give NaN rows, the rows that
    do not see a NaN key match the reference; on main the NaN rows came out as the empty state. Entries' positions
    start at ``k_pos_offset`` = 37 b (RoPE's float32 angles are 1e-4 rad off at position 3,000:
    ``docs/ARCHITECTURE.md``, "Kernel ABI")."""
    hq, hkv, d = SIMT_CFG.num_qo_heads, SIMT_CFG.num_kv_heads, SIMT_CFG.head_dim
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator().manual_seed(seed)
    ents = [tuple(torch.randn(r, h, d, generator=gen).float().double() for r, h in ((nq, hq), (nk, hkv), (nk, hkv)))
            for nq, nk in ENTRIES]
    for e, what, r, h in NAN_AT:
        ents[e][0 if what == "q" else 1][r, h, d // 3] = float("nan")
    offs = [37 * b for b in range(len(ents))]
    q_pos = [off + nk - nq + i for (nq, nk), off in zip(ENTRIES, offs) for i in range(nq)]
    n, sm_scale = len(q_pos), 0.8 / math.sqrt(d)
    arrays = {name: torch.cat([e[i] for e in ents]).float().numpy() for i, name in enumerate(("q", "k", "v"))}
    arrays.update(q_indptr=np.cumsum([0] + [nq for nq, _ in ENTRIES]).astype(np.int32),
                  kv_indptr=np.cumsum([0] + [nk for _, nk in ENTRIES]).astype(np.int32),
                  q_pos=np.array(q_pos, np.int32), k_pos_offset=np.array(offs, np.int32),
                  o=np.full((n, hq, d), np.nan, np.float32), lse=np.full((n, hq), np.nan, np.float32))
    env = {"n": n, "_m": arrays["k"].shape[0], "B": len(ents), "causal": 1, "apply_rope": apply_rope,
           "rope_scale": 1.0, "rope_theta": 10000.0, "sm_scale": sm_scale, "dev_id": 0}
    run_launches(simt_built, launches(simt_built.main, env), arrays)
    o, lse, row = torch.from_numpy(arrays["o"]).double(), torch.from_numpy(arrays["lse"]).double(), 0
    for (eq, ek, ev), (nq, nk), off in zip(ents, ENTRIES, offs):
        if apply_rope:
            eq = R.rope(eq, q_pos[row:row + nq], 10000.0, 1.0)
            ek = R.rope(ek, [off + j for j in range(nk)], 10000.0, 1.0)
        ro, rl = R.attention(eq, ek, ev, sm_scale, True, sliding_window=40, logits_soft_cap=20.0)
        what = f"seed {seed} rope {apply_rope} entry ({nq}, {nk})"
        keep = nan_rows.check(o[row:row + nq], lse[row:row + nq], ro, what)
        got, gl, ro, rl = o[row:row + nq][keep], lse[row:row + nq][keep], ro[keep], rl[keep]
        seen = rl > -1e29
        assert torch.all(got[~seen] == 0) and torch.all((gl[~seen] + 1e30).abs() <= 1e24), f"{what}: empty rows"
        if seen.any():
            assert ((got - ro)[seen].norm() / ro[seen].norm()).item() < 2e-5, f"{what}: o"
            assert torch.allclose(gl[seen], rl[seen], atol=1e-3, rtol=1e-4), f"{what}: lse"
        row += nq
    assert torch.isnan(lse).any()

