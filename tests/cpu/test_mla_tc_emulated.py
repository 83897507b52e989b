"""The tensor-core MLA decodes (``tir_kernels/mla_cuda_tc.py``, ``cuda_mla_decode_kernel=tc``, and the wgmma one,
``mla_cuda_wgq.py``, ``=wgq``, built for sm_90a: ``WG_CONFIGS``; with its fallback, ``mla_cuda_wg.py``'s kernel,
where the host code finds the pool unaligned) run on the CPU (no GPU): TVM's generated CUDA of
``mla_attn_decode_paged``, compiled with g++ against ``_cuda_emu.h`` (one fiber per CUDA thread, run in a random
order between waits; ``mma.sync`` / ``ldmatrix`` / ``cp.async`` emulated from the PTX ISA), launched in the order
and with the grids of TVM's own host code (``test_decode_staged_emulated``'s helpers), so the split kernel and the
merge kernel run as on a GPU. Checked against the float64 reference (``pagedkv.testing.reference.attention`` with
one kv head: key = the latent, value = its first ``kv_lora_rank`` elements, which is what
``pagedkv.testing.reference_mla`` computes per layer).

Cases: 16 heads (one m16 tile), 12 (padding rows) and 40 (two m16 tiles, a second group of 8 heads); a small latent
(128 + 64: 3 k steps a dim group) and DeepSeek's (512 + 64: 9) at 16 heads, and 128 heads at DeepSeek's dims with a
short batch; fp16 and bf16; forced splits 1 (direct write), 3 and 8 (workspace + merge, splits past an entry's
keys); entries of mixed lengths (empty, one key, page and 64-key tile edges, three tiles), pages in random order,
NaN past every length, NaN-poisoned outputs; NaN runs (issue 44, ``NAN_RUNS``). Fresh random inputs each run.
Skips without g++.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from _cuda_support import cuda_source_of
from _decode_emu import HERE, SM80, device_helpers, host_main, kernels_of, launches, storage, tensor_map, values

from pagedkv import tir_kernels as tk
from pagedkv.testing import nan_rows
from pagedkv.testing import reference as R
from pagedkv.tir_kernels import mla_cuda_wgq
from pagedkv.tir_kernels._tma_cuda import LatentPageMap

import tvm
from tvm.target import Target

OP = "mla_attn_decode_paged"
PREFILL = "mla_attn_prefill_paged"
SM90A = Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
#: name -> (heads, kv_lora_rank, qk_rope_head_dim, dtype, forced splits, keys per entry).
LENGTHS = [130, 0, 1, 17, 64]
CONFIGS = {
    "h16-r128-f16-s1": (16, 128, 64, "float16", "1", LENGTHS),
    "h12-r128-bf16-s3": (12, 128, 64, "bfloat16", "3", LENGTHS),
    "h40-r128-f16-s3": (40, 128, 64, "float16", "3", [130, 3, 0]),
    "h16-r512-f16-s3": (16, 512, 64, "float16", "3", [150, 0, 17]),
    "h16-r128-bf16-s8": (16, 128, 64, "bfloat16", "8", [130, 1, 0]),
    "h128-r512-bf16-s1": (128, 512, 64, "bfloat16", "1", [80, 1]),
}
#: The wgmma kernel's configs (``cuda_mla_decode_kernel=wgq``, built for sm_90a): 64 heads a block (128 = two
#: groups; 40: padding rows), value dims split over two warpgroups (512 / 256 / 128: wgmma widths 256 / 128 / 64),
#: 64-key tiles in 2 stages at 576, 4 below (lengths past the stages: the ring wraps).
WG_CONFIGS = {
    "h128-r512-bf16-s1": (128, 512, 64, "bfloat16", "1", [300, 1, 0]),
    "h40-r256-f16-s3": (40, 256, 64, "float16", "3", [130, 0, 17, 200]),
    "h64-r128-f16-s8": (64, 128, 64, "float16", "8", [130, 1, 0]),
    "h16-r512-f16-s1": (16, 512, 64, "float16", "1", [150, 33]),
}
#: The TMA kernel (Q in shared memory), on those configs and once with the pool's address reported unaligned: the
#: PrimFunc's host code then runs ``mla_cuda_wg``'s kernel (``wgq/unaligned``).
TMA_KERNELS = ("wgq",)
#: wgq's box paths (``mla_cuda_wgq.box_rows``: the page size picks them; the cases above use pages of 16, four
#: 16-key groups a tile, one a warp): pages of 64 (one group a tile, the column blocks split over the warps), 8
#: (eight groups, two a warp) and 24 (8-key boxes, a tile's groups on three pages).
WGQ_PAGES = {"h64-r512-f16-s1-p64": ("h64-r128-f16-s8", 64, [300, 64, 1, 0]),
             "h128-r512-bf16-s3-p8": ("h128-r512-bf16-s1", 8, [150, 3, 64]),
             "h40-r256-f16-s1-p24": ("h40-r256-f16-s3", 24, [130, 0, 17, 200])}
#: The wgq runs at pages of 16 (``WG_CONFIGS``) on the configs without a run of their own page size below: 40 heads
#: (padding rows, widths 128) and 16 (auto's smallest wgq head count); the 64- and 128-head configs run at pages
#: of 64 and 8 in ``WGQ_PAGES`` (the 16-key groups of pages of 16 are the 40- and 16-head runs').
WGQ_PS16 = ("h40-r256-f16-s3", "h16-r512-f16-s1")
CASES = ([(n, "tc") for n in CONFIGS] + [(n, k) for k in TMA_KERNELS for n in WGQ_PS16]
         + [("h40-r256-f16-s3", f"{k}/unaligned") for k in TMA_KERNELS] + [(n, "wgq") for n in WGQ_PAGES])
WG_KERNELS = (*TMA_KERNELS, *(f"{k}/unaligned" for k in TMA_KERNELS))
PS = 16
#: Bytes of the static array standing in for the kernel's dynamic shared memory.
DYN_SMEM_BYTES = 232 * 1024


def _config(name, kernel):
    """(heads, rank, rope, dtype, splits, lengths, page size) of a case."""
    if name in WGQ_PAGES:
        base, ps, lengths = WGQ_PAGES[name]
        h, r, rope, dt, _s, _l = WG_CONFIGS[base]
        return h, (512 if "r512" in name else r), rope, dt, name.split("-s")[1].split("-")[0], lengths, ps
    return (*(CONFIGS if kernel == "tc" else WG_CONFIGS)[name], PS)


def _spec(name, kernel="tc", op=OP):
    h, r, rope, dt, splits, _l, _ps = _config(name, kernel)
    switch = "cuda_mla_decode_kernel" if op == OP else "cuda_mla_prefill_kernel"
    return tk.KernelSpec(h, h, 64, 64, dt, kv_lora_rank=r, qk_rope_head_dim=rope,
                           paths={switch: kernel.split("/")[0], "cuda_decode_splits": splits})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    out, workdir = {}, tmp_path_factory.mktemp("emu_mla_tc")

    def get(name, kernel, op=OP):
        kernel = kernel.split("/")[0]  # one build serves the aligned and the unaligned run
        if (name, kernel, op) not in out:
            out[(name, kernel, op)] = _build(name, kernel, workdir / f"{name}-{kernel}-{op}", op)
        return out[(name, kernel, op)]

    return get


def _build(name, kernel, stem, op=OP):
    target = SM90A if kernel in WG_KERNELS else SM80
    func = tk.build_kernels(_spec(name, kernel, op), target, ops=(op,))[op]
    with target:
        exe = tvm.compile(tvm.IRModule({f"pagedkv_{op}": func}), target=target)
    src = cuda_source_of(exe)
    kernels = kernels_of(src, dyn_smem_bytes=DYN_SMEM_BYTES)
    mark = "pagedkv_wgmma_" if kernel in WG_KERNELS else "pagedkv_mma_"
    # wgq: the TMA kernel and the wg kernel its host code falls back to.
    assert sum(mark in body for body, _p in kernels.values()) == (2 if kernel in TMA_KERNELS else 1), \
        "tensor-core kernels"
    main, launch_params = host_main(func)
    runs, bodies = [], []
    for kname, (body, params) in kernels.items():
        bodies.append(body)
        args = ", ".join(f"*(const CUtensorMap*)ptrs[{i}]" if "CUtensorMap" in ty  # by value, as the host passes it
                         else f"({ty})ptrs[{i}]" if ty.endswith("*") else f"(({ty})nums[{i}])"
                         for i, (ty, _n) in enumerate(params))
        runs.append(f'  if (!std::strcmp(name, "{kname}")) launch3(g[0], g[1], g[2], g[3], g[4], g[5], [=]() '
                    f'{{ {kname}({args}); }});')
    cpp = stem.with_suffix(".cpp")
    cpp.write_text(f'#define PAGEDKV_EMU_THREADS 256\n#include "{HERE / "_cuda_emu.h"}"\n' + device_helpers(src)
                   + "\n".join(bodies)
                   + '\nextern "C" void run(const char* name, void** ptrs, double* nums, int* g) {\n'
                   + "\n".join(runs) + "\n}\n")
    lib = stem.with_suffix(".so")
    proc = subprocess.run(["g++", "-O1", "-std=c++20", "-shared", "-fPIC", "-pthread", "-w", "-o", str(lib),
                           str(cpp)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(lib)), {k: p for k, (_b, p) in kernels.items()}, main, launch_params, _shape_vars(func)


def _inputs(h, dl, dt, lengths, gen, PS=PS, queries=None, nan=()):  # noqa: N803
    """Per entry (q [queries (1 each by default), H, DL], latents [m, 1, DL]) in the storage dtype's values, and
    the page arrays. ``nan``: (entry, 0 (q) or 1 (latents), row, head, dim) elements made NaN."""
    rnd = getattr(torch, dt)
    ents = [(torch.randn(nq, h, dl, generator=gen).to(rnd).double(),
             torch.randn(m, 1, dl, generator=gen).to(rnd).double())
            for nq, m in zip(queries or [1] * len(lengths), lengths)]
    for b, which, row, head, dim in nan:
        ents[b][which][row, head, dim] = float("nan")
    counts = [-(-m // PS) for m in lengths]
    order = torch.randperm(sum(counts) + 2, generator=gen).tolist()
    pages = torch.full((len(order), 1, 1, PS, dl), float("nan"), dtype=torch.float64)
    values, last = [], []
    for (_q, kv), cnt in zip(ents, counts):
        ids = [order.pop() for _ in range(cnt)]
        for i, pg in enumerate(ids):
            n = min(PS, kv.shape[0] - i * PS)
            pages[pg, 0, 0, :n] = kv[i * PS:i * PS + n, 0]
        values += ids
        last.append(kv.shape[0] - (cnt - 1) * PS if cnt else 0)
    return ents, pages, np.cumsum([0] + counts).astype(np.int32), np.array(values or [0], np.int32), \
        np.array(last, np.int32)


def _shape_vars(func):
    """{buffer name: [name of each dim's shape var, or ""]} of a PrimFunc's parameters: TVMScript names a shape
    var after its last binding in a macro (the prefill's token count is the blocks' ``B``), so the tests read the
    names here instead of spelling them."""
    return {p.name: [getattr(d, "name", "") for d in p.shape] for p in func.params if hasattr(p, "shape")}


def _env(shape_vars, arrays, **scalars):
    """The host function's shape vars (``_shape_vars``) with the values of ``arrays``' shapes, and ``scalars``."""
    env = dict(scalars)
    for name, dims in shape_vars.items():
        for var, size in zip(dims, arrays[name].shape if name in arrays else ()):
            if var:
                env[var] = size
    return env


def _arrays(ents, pages, page_indptr, page_values, last, h, r, dt):
    """The kernels' buffers by parameter name: inputs, NaN-poisoned outputs and workspace."""
    n = sum(e[0].shape[0] for e in ents)
    return {"q": storage(torch.cat([e[0] for e in ents]), dt), "pages": storage(pages, dt),
            "q_indptr": np.cumsum([0] + [e[0].shape[0] for e in ents]).astype(np.int32),
            "page_indptr": page_indptr, "page_values": page_values, "last_page_len": last,
            "o": storage(torch.full((n, h, r), float("nan")), dt), "lse": np.full((n, h), np.nan, np.float32),
            "ws_o": np.full((n * h * 8, r), np.nan, np.float32), "ws_l": np.full((n * h * 8,), np.nan, np.float32)}


def _run(built_case, kernel, arrays, env, ps, dl, splits):
    """Launch the host function's kernels for ``env`` on ``arrays`` (the split kernel, then the merge when S > 1)."""
    lib, params, main, launch_params, _shape_vars = built_case
    calls = launches(main, env)
    assert env["S"] == int(splits) and len(calls) == (2 if env["S"] > 1 else 1), (calls, env.get("S"))
    keep = []
    for kname, args in calls:
        ps_, n = params[kname], len(params[kname])
        ptrs, nums = (ctypes.c_void_p * n)(), (ctypes.c_double * n)()
        assert any("CUtensorMap" in ty for ty, _p in ps_) == (kernel in TMA_KERNELS and kname == calls[0][0]), kname
        for i, (ty, pname) in enumerate(ps_):
            if "CUtensorMap" in ty:
                keep.append(tensor_map(arrays["pages"], LatentPageMap(dl, mla_cuda_wgq.box_rows(ps))))  # the host's box
                ptrs[i] = ctypes.addressof(keep[-1])
            elif ty.endswith("*"):
                ptrs[i] = arrays[re.sub(r"_ptr(_\d+)?$", "", pname)].ctypes.data  # TVM may suffix a name
            else:
                assert args[i] is not None, f"{kname}: argument {pname} not evaluated"
                nums[i] = args[i]
        dims = dict(zip(launch_params[kname], args[n:]))
        grid = [int(dims.get(k, 1)) for k in ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x",
                                              "threadIdx.y", "threadIdx.z")]
        lib.run(kname.encode(), ptrs, nums, (ctypes.c_int * 6)(*grid))


def _check(what, ents, arrays, r, dt, sm_scale, causal):
    """Each entry's rows against the float64 reference (rows that see no key: o = 0, lse = -1e30)."""
    o, lse = values(arrays["o"], dt), torch.from_numpy(arrays["lse"]).double()
    t0 = 0
    for b, (eq, kv) in enumerate(ents):
        got, gl = o[t0:t0 + eq.shape[0]], lse[t0:t0 + eq.shape[0]]
        t0 += eq.shape[0]
        at = f"{what} entry {b} ({eq.shape[0]} queries, {kv.shape[0]} keys)"
        ro, rl = R.attention(eq, kv, kv[..., :r], sm_scale, causal)
        keep = nan_rows.check(got, gl, ro, at)  # (token, head) rows without NaN
        got, gl, ro, rl = got[keep], gl[keep][:, None], ro[keep], rl[keep][:, None]
        seen = rl[:, 0] > -1e29  # rows that see a key
        assert torch.all(got[~seen] == 0) and torch.all((gl[~seen] + 1e30).abs() <= 1e24), f"{at}: empty rows"
        if seen.any():
            rel = ((got[seen] - ro[seen]).norm() / ro[seen].norm()).item()
            assert rel < 1e-2, f"{at}: |o - ref| / |ref| = {rel:.3g}"
            assert torch.allclose(gl[seen], rl[seen], atol=2e-2, rtol=1e-4), f"{at}: lse {gl} vs {rl}"


@pytest.mark.parametrize("name,kernel", CASES, ids=[f"{k}-{n}" for n, k in CASES])
def test_emulated_tc_mla_decode_matches_reference(name, kernel, built):
    h, r, rope, dt, splits, lengths, ps = _config(name, kernel)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = _inputs(h, r + rope, dt, lengths, gen, ps)
    arrays = _arrays(ents, pages, page_indptr, page_values, last, h, r, dt)
    case = built(name, kernel)
    env = _env(case[4], arrays, sm_scale=1.0 / math.sqrt(192), max_kv_len=max(lengths), dev_id=0,
               aligned16=kernel in TMA_KERNELS)
    _run(case, kernel, arrays, env, ps, r + rope, splits)
    _check(name, ents, arrays, r, dt, env["sm_scale"], True)


#: The paged MLA prefill on the tensor-core kernels (``cuda_mla_prefill_kernel``; ``_mla_frame_cuda.
#: make_prefill_frame``): case -> (the decode config whose heads, dims, dtype and splits it takes, kernel, causal,
#: [(queries, keys)] per entry). Causal entries with more queries than keys (the first rows see none), an entry
#: without keys, one query, tile and page edges; forced splits 1 / 3 / 8.
PREFILL_CASES = {
    "tc-h16-r128-f16-s1-causal": ("h16-r128-f16-s1", "tc", True, [(5, 130), (4, 0), (20, 17), (1, 64)]),
    "tc-h12-r128-bf16-s3": ("h12-r128-bf16-s3", "tc", False, [(3, 130), (2, 1), (6, 64)]),
    "tc-h16-r128-bf16-s8-causal": ("h16-r128-bf16-s8", "tc", True, [(3, 150), (2, 0), (5, 3)]),
    "wgq-h40-r256-f16-s3-causal": ("h40-r256-f16-s3", "wgq", True, [(3, 200), (4, 2), (1, 0)]),
    "wgq-h128-r512-bf16-s1": ("h128-r512-bf16-s1", "wgq", False, [(2, 80), (2, 1)]),
    "wgq/unaligned-h40-r256-f16-s3-causal": ("h40-r256-f16-s3", "wgq/unaligned", True, [(3, 130), (2, 17)]),
}


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_emulated_tc_mla_prefill_matches_reference(case, built):
    name, kernel, causal, shapes = PREFILL_CASES[case]
    h, r, rope, dt, splits, _l, ps = _config(name, kernel)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = _inputs(h, r + rope, dt, [m for _q, m in shapes], gen, ps,
                                                          [q for q, _m in shapes])
    arrays = _arrays(ents, pages, page_indptr, page_values, last, h, r, dt)
    built_case = built(name, kernel, PREFILL)
    env = _env(built_case[4], arrays, sm_scale=1.0 / math.sqrt(192), causal=int(causal), dev_id=0,
               aligned16=kernel in TMA_KERNELS)
    _run(built_case, kernel, arrays, env, ps, r + rope, splits)
    _check(case, ents, arrays, r, dt, env["sm_scale"], causal)


#: The NaN runs (issue 44): (case, kernel or prefill case, NaN elements (``_inputs``' ``nan``)). A NaN q row of one
#: head and a NaN in a key's rope part (k only: the reference then gives the exact NaN rows; v is the latent's
#: first ``kv_lora_rank`` dims) give NaN rows, through the split merge at S = 3; in the causal prefill the queries
#: before the NaN key stay finite. On main the NaN rows came out as the empty state.
NAN_RUNS = {"tc-h12-r128-bf16-s3": ("h12-r128-bf16-s3", "tc", [(0, 0, 0, 3, 7), (3, 1, 10, 0, 130)]),
            "wgq-h40-r256-f16-s3": ("h40-r256-f16-s3", "wgq", [(0, 0, 0, 3, 7), (3, 1, 10, 0, 300)]),
            "prefill-tc-h16-r128-f16-s1-causal": ("tc-h16-r128-f16-s1-causal", PREFILL,
                                                  [(0, 0, 1, 5, 7), (0, 1, 127, 0, 150)])}


@pytest.mark.parametrize("case", list(NAN_RUNS))
def test_emulated_tc_mla_nan_propagates(case, built):
    name, kernel, nan = NAN_RUNS[case]
    prefill = kernel == PREFILL
    if prefill:  # query i of the (5, 130) entry sits at key 125 + i: keys 127 is seen by queries 2..4
        name, kernel, causal, shapes = PREFILL_CASES[name]
    else:
        causal, shapes = True, [(1, m) for m in _config(name, kernel)[5]]
    h, r, rope, dt, splits, _l, ps = _config(name, kernel)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    ents, pages, page_indptr, page_values, last = _inputs(h, r + rope, dt, [m for _q, m in shapes], gen, ps,
                                                          [q for q, _m in shapes], nan=nan)
    arrays = _arrays(ents, pages, page_indptr, page_values, last, h, r, dt)
    built_case = built(name, kernel, PREFILL if prefill else OP)
    env = _env(built_case[4], arrays, sm_scale=1.0 / math.sqrt(192), dev_id=0, aligned16=kernel in TMA_KERNELS,
               **({"causal": int(causal)} if prefill else {"max_kv_len": max(m for _q, m in shapes)}))
    _run(built_case, kernel, arrays, env, ps, r + rope, splits)
    assert np.isnan(arrays["lse"]).sum() == (1 + 3 * h if prefill else 1 + h), "NaN rows"
    _check(case, ents, arrays, r, dt, env["sm_scale"], causal)


def test_dataclasses_replace_keeps_paths():
    """The forced paths the cases use reach the kernel spec (a guard on the test itself)."""
    spec = dataclasses.replace(_spec("h16-r128-f16-s1"))
    assert dict(spec.paths) == {"cuda_mla_decode_kernel": "tc", "cuda_decode_splits": "1"}
