"""The CPU emulation harness of the CUDA decode kernels (``test_decode_staged_emulated.py``,
``test_decode_tc_emulated.py``): TVM's generated CUDA of ``attn_decode_paged`` compiled with g++ against
``_cuda_emu.h`` (one fiber per CUDA thread, run in a random order between waits; barriers, warp shuffles,
``cp.async`` / ``ldmatrix`` / ``mma.sync``), launched in the order and with the arguments and grids of TVM's own
host code (its lowered PrimFunc, evaluated here for the batch), so the split kernel and the merge kernel run as on a
GPU; inputs (random, NaN-poisoned pages past each entry's keys and unused pages) and the check against the float64
reference (``pagedkv.testing.reference``)."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import math
import pathlib
import re
import subprocess

import numpy as np
import torch
from _cuda_support import cuda_source_of

from pagedkv import tir_kernels as tk
from pagedkv.testing import nan_rows
from pagedkv.testing import reference as R
from pagedkv.testing.cuda_source import kernel_defs, static_shared
from pagedkv.tir_kernels._tma_cuda import decode_args

import tvm
from tvm.target import Target

SM80 = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")  # the mma.sync kernels (sm_90 is Hopper: sm_90a)
HERE = pathlib.Path(__file__).resolve().parent
OP = "attn_decode_paged"
#: Bytes of the static array standing in for a kernel's dynamic shared memory.
DYN_SMEM_BYTES = 128 * 1024


def kernels_of(src: str, *, dyn_smem_bytes: int = DYN_SMEM_BYTES) -> dict:
    """{name: (definition, [(type, name)] params)} of the ``__global__`` kernels in a module's source (shared
    arrays made ``static``; a dynamic one becomes a static array of ``dyn_smem_bytes``)."""
    return {k.name: (static_shared(k.text(src), dyn_smem_bytes), k.params) for k in kernel_defs(src)}


class TensorMapEmu(ctypes.Structure):
    """``_cuda_emu.h``'s ``CUtensorMap``: what the emulated TMA copies read."""

    _fields_ = [("base", ctypes.c_void_p), ("rank", ctypes.c_int), ("elem_bytes", ctypes.c_int),
                ("swizzle", ctypes.c_int), ("dims", ctypes.c_uint64 * 5), ("strides", ctypes.c_uint64 * 5),
                ("box", ctypes.c_uint32 * 5)]


def tensor_map(array: np.ndarray, tmap) -> TensorMapEmu:
    """The emulator's tensor map of ``array`` from the map's own encode arguments (what the host code passes
    to ``cuTensorMapEncodeTiled`` on the GPU): dims, byte strides of dims 1.., box, element strides, options."""
    a = decode_args(tmap.rank, tmap.encode_args(array.shape))
    assert a.elem_strides == [1] * tmap.rank and a.interleave == 0 and a.oob_fill == 0 and array.itemsize == 2
    m = TensorMapEmu(array.ctypes.data, tmap.rank, array.itemsize, a.swizzle)
    for r in range(tmap.rank):
        m.dims[r], m.strides[r], m.box[r] = a.dims[r], ([array.itemsize] + a.strides)[r], a.box[r]
    return m


#: The tensor-core decode's non-default build switches (tests build each once): name -> (module of
#: ``pagedkv.tir_kernels``, attribute, value).
TC_SWITCHES = {
    "float32_rotation": ("_decode_tc_rope_cuda", "PACKED_F16", False),
    "rings_inverted": ("_decode_tc_cuda", "TCD_WARP_RING", {"plain": True, "rope": False}),
    "lookup_inverted": ("_decode_tc_cuda", "TCD_LOOKUP_AHEAD", {64: True, 128: False}),
    "no_l2_prefetch": ("_mma_cuda", "CP_ASYNC_L2_PREFETCH", None),
}


def set_tc_switch(monkeypatch, switch: str) -> None:
    """Flip one of ``TC_SWITCHES`` for the test (kernels built afterwards see it)."""
    module, attr, value = TC_SWITCHES[switch]
    monkeypatch.setattr(importlib.import_module(f"pagedkv.tir_kernels.{module}"), attr, value)


def device_helpers(src: str) -> str:
    """The guarded ``__device__`` helper blocks of a module's source (``#ifndef PAGEDKV_X ... #endif``), each
    once: included after ``_cuda_emu.h``, whose emulations define the guards of the PTX ones (mma, ldmatrix,
    cp.async, wgmma), they add the portable ones (the RoPE rotation, the warp barrier) as the GPU compiles
    them."""
    blocks = {}
    for m in re.finditer(r"#ifndef (PAGEDKV_\w+)\n#define \1\n.*?#endif\n", src, re.S):
        blocks.setdefault(m.group(1), m.group(0))
    return "".join(blocks.values())


def host_main(func):
    """The host PrimFunc of ``func`` after TVM's lowering (its kernel launches) and {kernel: launch params}."""
    mod = tvm.IRModule({"main": func.with_attr("target", SM80)})
    with SM80:
        mod = tvm.tirx.get_tir_pipeline("default")[0](mod)
    params = {gv.name_hint: list(f.attrs["tirx.kernel_launch_params"]) for gv, f in mod.functions.items()
              if f.attrs and "tirx.kernel_launch_params" in f.attrs}
    return mod["main"], params


_BIN = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
        "Min": min, "Max": max, "LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
        "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b,
        "And": lambda a, b: a and b, "Or": lambda a, b: a or b,
        "FloorDiv": lambda a, b: a // b, "FloorMod": lambda a, b: a % b,
        "Div": lambda a, b: a / b if isinstance(a, float) else int(a / b),
        "Mod": lambda a, b: int(math.fmod(a, b))}


def _eval(e, env):
    """Value of a host expression (None when it reads something not in ``env``)."""
    kind = type(e).__name__
    if kind in ("IntImm", "FloatImm"):
        return e.value
    if kind == "Var":  # unnamed: the views' element offsets (every array starts at its buffer)
        return env.get(e.name) if e.name else 0
    if kind == "Cast":
        v = _eval(e.value, env)
        return None if v is None else (float(v) if "float" in str(e.ty) else int(v))
    if kind in _BIN:
        a, b = _eval(e.a, env), _eval(e.b, env)
        return None if a is None or b is None else _BIN[kind](a, b)
    if kind == "Call" and "isnullptr" in str(e.op) and "llvm.ptrmask" in str(e.args[0]):
        return env.get("aligned16")  # _tma_cuda.host_aligned16 (a TMA kernel's operand test): what the test says
    if kind == "Not":
        v = _eval(e.a, env)
        return None if v is None else not v
    return None


def launches(main, env):
    """[(kernel, call args evaluated)] of the host function's kernel launches for the values ``env`` (names
    of its shape and scalar variables; the host's own bindings, e.g. the split count ``S``, are added)."""
    out = []

    def walk(s):
        kind = type(s).__name__
        if kind == "Bind":
            if s.var.name not in env:
                v = _eval(s.value, env)
                if v is not None:
                    env[s.var.name] = v
        elif kind == "IfThenElse":
            cond = _eval(s.condition, env)  # None: an argument check (strides, handles); not a launch
            nxt = None if cond is None else s.then_case if cond else s.else_case
            if nxt is not None:
                walk(nxt)
        elif kind == "Evaluate" and "call_ffi_kernel" in str(getattr(s.value, "op", "")):
            out.append((s.value.args[0].value, [_eval(a, env) for a in s.value.args[1:]]))
        else:
            for attr in ("seq", "body"):
                v = getattr(s, attr, None)
                if v is not None:
                    for x in (v if attr == "seq" else [v]):
                        walk(x)

    walk(main.body)
    return out


@dataclasses.dataclass(frozen=True)
class Built:
    """A config's decode PrimFunc compiled for the emulator: the g++ library, {kernel: (definition, params)},
    the lowered host function and {kernel: launch params}."""

    lib: object
    kernels: dict
    main: object
    launch_params: dict


def build(cfg, paths: dict, stem: pathlib.Path, op: str = OP) -> Built:
    """Compile ``cfg``'s ``attn_decode_paged`` (or ``op``: its partial-state variant) (forced ``paths``) for sm_90
    and its kernels with g++."""
    cfg = dataclasses.replace(cfg, paths=paths)
    func = tk.build_kernels(cfg, SM80, ops=(op,))[op]
    with SM80:
        exe = tvm.compile(tvm.IRModule({f"pagedkv_{op}": func}), target=SM80)
    src = cuda_source_of(exe)
    kernels = kernels_of(src)
    main, launch_params = host_main(func)
    runs = []
    for kname, (_body, params) in kernels.items():
        args = ", ".join(f"({ty})ptrs[{i}]" if ty.endswith("*") else f"(({ty})nums[{i}])"
                         for i, (ty, _n) in enumerate(params))
        runs.append(f'  if (!std::strcmp(name, "{kname}")) launch3(g[0], g[1], g[2], g[3], g[4], g[5], [=]() '
                    f'{{ {kname}({args}); }});')
    cpp = stem.with_suffix(".cpp")
    cpp.write_text(f'#include "{HERE / "_cuda_emu.h"}"\n' + device_helpers(src)
                   + "\n".join(b for b, _p in kernels.values())
                   + '\nextern "C" void run(const char* name, void** ptrs, double* nums, int* g) {\n'
                   + "\n".join(runs) + "\n}\n")
    lib = stem.with_suffix(".so")
    proc = subprocess.run(["g++", "-O1", "-std=c++20", "-shared", "-fPIC", "-pthread", "-w", "-o", str(lib),
                           str(cpp)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Built(ctypes.CDLL(str(lib)), kernels, main, launch_params)


def storage(x: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).view(torch.int16).numpy().copy()
    return x.to(getattr(torch, dtype)).numpy().copy()


def values(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(a.copy())
    return (t.view(torch.bfloat16) if dtype == "bfloat16" else t).double()


def inputs(cfg, gen, lengths, ps: int, nan=()):
    """Per entry (q [1, Hq, D], k, v [m, Hkv, D], k_pos_offset) in the storage dtype's values (every other
    entry's positions near 30000), and the page arrays (pages in random order, two spare; every slot not
    holding a key is NaN). ``nan``: elements made NaN, ``("q", entry, head)`` (one element of that q row) or
    ``("k", entry, key, kv_head)`` (one element of that key)."""
    hq, hkv, d, dt = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, getattr(torch, cfg.dtype)
    ents = []
    for i, m in enumerate(lengths):
        q, k, v = (torch.randn(n, h, d, generator=gen).to(dt).double() for n, h in ((1, hq), (m, hkv), (m, hkv)))
        lo, hi = (29_000, 30_000) if i % 2 == 0 else (0, 50)
        ents.append((q, k, v, int(torch.randint(lo, hi, (1,), generator=gen))))
    for what, b, *at in nan:
        ents[b][0 if what == "q" else 1][(0, *at) if what == "q" else tuple(at)][d // 3] = float("nan")
    counts = [-(-m // ps) for m in lengths]
    order = torch.randperm(sum(counts) + 2, generator=gen).tolist()
    pages = torch.full((len(order), 2, hkv, ps, d), float("nan"), dtype=torch.float64)
    page_values, last = [], []
    for (_q, k, v, _o), cnt in zip(ents, counts):
        ids = [order.pop() for _ in range(cnt)]
        for i, pg in enumerate(ids):
            n = min(ps, k.shape[0] - i * ps)
            pages[pg, 0, :, :n] = k[i * ps:i * ps + n].transpose(0, 1)
            pages[pg, 1, :, :n] = v[i * ps:i * ps + n].transpose(0, 1)
        page_values += ids
        last.append(k.shape[0] - (cnt - 1) * ps if cnt else 0)
    return ents, pages, np.cumsum([0] + counts).astype(np.int32), np.array(page_values or [0], np.int32), \
        np.array(last, np.int32)


def run_decode(built: Built, cfg, ents, pages, page_indptr, page_values, last, ps: int, apply_rope: int,
               sm_scale: float, theta: float, scale: float, max_splits: int = 64, max_kv_len: int | None = None,
               out_dtype: str | None = None):
    """Launch the host's kernels on NaN-poisoned outputs / workspace; ``(o, lse, env)`` (float64 tensors, the
    host's evaluated variables). ``max_kv_len``: the runtime's launch hint (default: the longest entry, as the
    runtime passes it; 0 = unknown). ``out_dtype``: o's dtype (default the storage dtype; float32 for a
    partial-state kernel)."""
    hq, d, dt = cfg.num_qo_heads, cfg.head_dim, cfg.dtype
    odt = out_dtype or dt
    B = len(ents)
    q_pos = [off + k.shape[0] - 1 for _q, k, _v, off in ents]
    o_poison = np.full((B, hq, d), np.nan, np.float32)
    arrays = {"q": storage(torch.cat([e[0] for e in ents]), dt), "pages": storage(pages, dt),
              "page_indptr": page_indptr, "page_values": page_values, "last_page_len": last,
              "k_pos_offset": np.array([e[3] for e in ents], np.int32), "q_pos": np.array(q_pos, np.int32),
              "o": storage(torch.from_numpy(o_poison), odt), "lse": np.full((B, hq), np.nan, np.float32),
              "ws_o": np.full((B * hq * max_splits, d), np.nan, np.float32),
              "ws_l": np.full((B * hq * max_splits,), np.nan, np.float32)}
    env = {"B": B, "_p": pages.shape[0], "ps": ps, "nnz": len(page_values), "apply_rope": apply_rope,
           "sm_scale": sm_scale, "rope_scale": scale, "rope_theta": theta, "dev_id": 0,
           "max_kv_len": max(e[1].shape[0] for e in ents) if max_kv_len is None else max_kv_len}
    runs = launch(built, arrays, env)
    assert env["S"] <= max_splits, env["S"]
    assert len(runs) == (2 if env["S"] > 1 else 1), (runs, env.get("S"))
    run_launches(built, runs, arrays)
    return values(arrays["o"], odt), torch.from_numpy(arrays["lse"]).double(), env


def run_launches(built: Built, runs, arrays: dict) -> None:
    """Run the host's kernel launches ``runs`` (``launches``) on ``arrays`` (by buffer name)."""
    for kname, args in runs:
        ps_ = built.kernels[kname][1]
        n = len(ps_)
        ptrs, nums = (ctypes.c_void_p * n)(), (ctypes.c_double * n)()
        for i, (ty, pname) in enumerate(ps_):
            if ty.endswith("*"):
                ptrs[i] = arrays[pname.removesuffix("_ptr")].ctypes.data
            else:
                assert args[i] is not None, f"{kname}: argument {pname} not evaluated"
                nums[i] = args[i]
        dims = dict(zip(built.launch_params[kname], args[n:]))
        grid = [int(dims.get(k, 1)) for k in ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x",
                                              "threadIdx.y", "threadIdx.z")]
        built.lib.run(kname.encode(), ptrs, nums, (ctypes.c_int * 6)(*grid))


def launch(built: Built, arrays: dict, env: dict) -> list:
    """Run the host function's kernel launches for ``env`` (its shape and scalar variables by name) on ``arrays``
    (numpy arrays by buffer name); returns the launches ``[(kernel, args)]``."""
    runs = launches(built.main, env)
    run_launches(built, runs, arrays)
    return runs


def check_against_reference(name, cfg, ents, o, lse, apply_rope: int, theta: float, scale: float, sm_scale: float):
    """Every entry's o / lse against the float64 reference (RoPE at the exact angles when ``apply_rope``);
    no NaN left but in the rows that see a NaN input (``inputs``' ``nan``: whole o row and lse NaN,
    ``nan_rows.check``); an entry without keys has o = 0, lse = -1e30."""
    dt = cfg.dtype
    for b, (eq, ek, ev, off) in enumerate(ents):
        m = ek.shape[0]
        if apply_rope:
            eq, ek = R.rope(eq, [off + m - 1], theta, scale), R.rope(ek, [off + j for j in range(m)], theta, scale)
        ro, rl = R.attention(eq, ek, ev, sm_scale, True, sliding_window=cfg.sliding_window,
                             logits_soft_cap=cfg.logits_soft_cap)
        what = f"{name} rope={apply_rope} entry {b} ({m} keys from {off})"
        keep = nan_rows.check(o[b:b + 1], lse[b:b + 1], ro, what)  # the rows without NaN, as [1, Hq] rows
        got, gl, ro, rl = o[b:b + 1][keep][None], lse[b:b + 1][keep][None], ro[keep][None], rl[keep][None]
        if not keep.any():
            continue
        if m == 0:
            assert torch.all(got == 0) and torch.all((gl + 1e30).abs() <= 1e24), f"{what}: empty row"
            continue
        rel = ((got - ro).norm() / ro.norm()).item()
        assert rel < (2e-5 if dt == "float32" else 1e-2), f"{what}: |o - ref| / |ref| = {rel:.3g}"
        assert torch.allclose(gl, rl, atol=1e-3 if dt == "float32" else 2e-2, rtol=1e-4), f"{what}: lse {gl} vs {rl}"
