"""Helpers of ``bench_gpu_kernels.py``: finding and loading the prebuilt kernel libraries of a GPU bundle,
CUDA-looking tensors for ``--dry-run`` on a host without a GPU, and the report (table, JSON, PNG)."""

from __future__ import annotations

import ctypes
import json
import math
from pathlib import Path

#: The benchmark shape (same as ``pagedkv.apps.gpu_bundle.UPSTREAM_SHAPE``).
HQ, HKV, D, PS, DTYPE = 32, 8, 128, 16, "float16"
TARGET = {"kind": "cuda", "arch": "sm_90"}
ATTN_OPS = ("attn_decode_paged", "attn_prefill_paged", "attn_prefill_ragged")


# --------------------------------------------------------------------------------------------------
# libraries
# --------------------------------------------------------------------------------------------------
def bench_config():
    """The benchmark's cache config: full attention (no window, no soft-cap), the shape above; the bundle
    builds its TIR kernel library (``pagedkv.testing.shapes.gpu_configs``)."""
    from pagedkv.config import KVCacheConfig

    return KVCacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=DTYPE)


def find_our_library(kernels_dir: Path, config=None) -> tuple[Path, str]:
    """The ``kernels-<key>.so`` of ``config`` (default ``bench_config()``) with every op on the "tir" backend:
    its content key names exactly that config's kernels (attention options included), so no other library
    can be picked. Raises ``FileNotFoundError`` when the bundle lacks it."""
    from pagedkv.cache import kernel_library_path

    config = bench_config() if config is None else config
    lib = kernel_library_path(config, kernels_dir, target=TARGET, backend="tir")
    if not (lib.exists() and lib.with_suffix(".json").exists()):
        raise FileNotFoundError(f"{lib} (+ .json) is missing: the bundle has no TIR kernel library for "
                                f"{config.to_json()} on {TARGET}; rebuild it with `make gpu-bundle`")
    meta = json.loads(lib.with_suffix(".json").read_text())
    if meta.get("config", {}).get("sliding_window", 0) != config.sliding_window or \
            meta.get("config", {}).get("logits_soft_cap", 0.0) != config.logits_soft_cap:
        raise RuntimeError(f"{lib.name} was built for another config: {meta.get('config')}")
    return lib, f"content key of {config.to_json()}"


def _lookup(load, lib_path: Path, symbols: dict[str, str]) -> dict:
    """op -> function, or op -> the exception that prevented loading it."""
    try:
        module = load(lib_path)
    except Exception as e:  # noqa: BLE001
        return {op: e for op in symbols}
    out = {}
    for op, sym in symbols.items():
        try:
            out[op] = module[sym]
        except Exception as e:  # noqa: BLE001
            out[op] = e
    out["_module"] = module
    return out


def _as_op_functions(funcs: dict, heads: dict) -> dict:
    """Each loaded function as the runtime's adapter calls it (``op_function``: ABI arguments, then the facts
    its adapter kind adds, e.g. ``max_kv_len``); ``heads``: op -> the op-table strings after the tag."""
    from pagedkv.testing.op_calls import op_function

    return {op: fn if op.startswith("_") or isinstance(fn, Exception) else
            op_function([op, "", *heads.get(op, []), fn]) for op, fn in funcs.items()}


def load_functions(bundle: Path) -> tuple[dict, dict]:
    """({"ours": {op: fn|exc}, "upstream": {op: fn|exc}}, info about where they came from)."""
    from pagedkv.runtime import load_library

    funcs, info = {}, {}
    try:
        lib, how = find_our_library(bundle / "kernels")
        entries = json.loads(lib.with_suffix(".json").read_text())["entries"]
        symbols = {op: names[0] for op, _tag, names, *_ in entries if op in ATTN_OPS}
        heads = {op: (rest[0] if rest else []) for op, _tag, _names, *rest in entries}
        info["ours"] = {"library": str(lib), "found_by": how, "symbols": symbols}
        funcs["ours"] = _as_op_functions(_lookup(load_library, lib, symbols), heads)
        for op in ATTN_OPS:
            funcs["ours"].setdefault(op, KeyError(f"{op} is not in {lib.name}'s op table"))
    except Exception as e:  # noqa: BLE001
        funcs["ours"] = {op: e for op in ATTN_OPS}
    try:
        lib = bundle / "upstream" / "upstream-kernels.so"
        meta = json.loads(lib.with_suffix(".json").read_text())
        symbols = {op: f"upstream_{op}" for op in ATTN_OPS}
        info["upstream"] = {"library": str(lib), "tvm_version": meta.get("tvm_version"), "symbols": symbols}
        funcs["upstream"] = _as_op_functions(_lookup(load_library, lib, {op: meta["functions"][s]["symbol"]
                                                                         for op, s in symbols.items()}), {})
    except Exception as e:  # noqa: BLE001
        funcs["upstream"] = {op: e for op in ATTN_OPS}
    return funcs, info


# --------------------------------------------------------------------------------------------------
# --dry-run: tensors that claim to live on cuda:0 (host memory), so the compiled host code of a kernel
# checks every argument (count, dtype, shape, device) and stops at the first CUDA call (no driver here).
# --------------------------------------------------------------------------------------------------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class FakeCudaTensor:
    """DLPack producer: a contiguous CPU torch tensor presented as a tensor on cuda:0."""

    _KDLCUDA = 2

    def __init__(self, t):
        import torch

        codes = {torch.float16: (2, 16), torch.float32: (2, 32), torch.int32: (0, 32), torch.uint8: (1, 8)}
        self.t = t.contiguous()
        self._shape = (ctypes.c_int64 * self.t.dim())(*self.t.shape)
        code, bits = codes[self.t.dtype]
        self._m = _DLManagedTensor(_DLTensor(self.t.data_ptr(), _DLDevice(self._KDLCUDA, 0), self.t.dim(),
                                             _DLDataType(code, bits, 1), self._shape, None, 0), None, None)

    def __dlpack_device__(self):
        return (self._KDLCUDA, 0)

    def __dlpack__(self, **_kwargs):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._m), b"dltensor", None)


def is_launch_error(exc: Exception) -> bool:
    """An error raised past the host-side argument checks, at the first CUDA call (no driver)."""
    msg = str(exc)
    return not isinstance(exc, TypeError) and ("CUDA" in msg or "cuda" in msg.split("\n")[0])


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------
def add_ratios(rows: list[dict]) -> None:
    """Per case: speedup over upstream, fraction of SDPA speed, fraction of copy bandwidth."""
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    for impls in by_case.values():
        up, sdpa, copy = (impls.get(k, {}).get("ms", math.nan) for k in ("upstream", "torch_sdpa", "copy"))
        copy_bw = impls.get("copy", {}).get("gbps", math.nan)
        for name, r in impls.items():
            ms = r.get("ms", math.nan)
            r["speedup_vs_upstream"] = up / ms if name != "copy" else math.nan
            r["frac_of_sdpa"] = sdpa / ms if name != "copy" else math.nan
            r["frac_of_copy_bw"] = r.get("gbps", math.nan) / copy_bw if name != "copy" else math.nan
            if name == "copy":
                r["read_ceiling_ms"] = copy / 2


def _fmt(x, spec):
    width = int(spec.split(".")[0])
    return "-".rjust(width) if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def print_table(rows: list[dict]) -> None:
    head = (f"{'case':<26} {'impl':<11} {'ms':>9} {'GB/s':>8} {'TFLOP/s':>8} {'%copyBW':>8} "
            f"{'vs upstr':>9} {'vs SDPA':>8} {'rel err':>9}  status")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        pct = r.get("frac_of_copy_bw", math.nan) * 100
        print(f"{r['case']:<26} {r['impl']:<11} {_fmt(r.get('ms'), '9.4f')} {_fmt(r.get('gbps'), '8.0f')} "
              f"{_fmt(r.get('tflops'), '8.1f')} {_fmt(pct, '7.1f') + ('%' if math.isfinite(pct) else ' ')} {_fmt(r.get('speedup_vs_upstream'), '8.2f')}x "
              f"{_fmt(r.get('frac_of_sdpa'), '7.2f')}x {_fmt(r.get('rel_err'), '9.2e')}  {r['status'][:90]}")
    print("GB/s = KV bytes / time (copy: read + write); %copyBW = GB/s / copy GB/s; vs upstr = upstream ms / ms; "
          "vs SDPA = SDPA ms / ms (>1: faster)")


def write_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 2.2 * len(cases) + 0.6), squeeze=False)
    colors = {"ours": "tab:green", "upstream": "tab:red", "torch_sdpa": "tab:blue", "copy": "tab:gray"}
    for ax, case in zip(axes[:, 0], cases):
        rs = [r for r in rows if r["case"] == case]
        ms = [r.get("ms", math.nan) for r in rs]
        ax.barh([r["impl"] for r in rs], [m if math.isfinite(m) else 0 for m in ms],
                color=[colors.get(r["impl"], "tab:purple") for r in rs])
        good = [m for m in ms if math.isfinite(m) and m > 0]
        left = min(good) / 4 if good else 0
        if good:
            ax.set_xscale("log")
            ax.set_xlim(left, max(good) * 12)
        for i, (r, m) in enumerate(zip(rs, ms)):
            label = f"{m:.3f} ms" if math.isfinite(m) else r["status"][:60]
            if r["impl"] != "copy" and math.isfinite(r.get("speedup_vs_upstream", math.nan)):
                label += f"  ({r['speedup_vs_upstream']:.1f}x upstream)"
            ax.text(m if math.isfinite(m) and m > 0 else (left or 0), i, " " + label, va="center", fontsize=8)
        ax.set_title(case, fontsize=10)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("time per call, ms (log; CUDA events, median, L2 flushed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
