"""FlashInfer 0.7.4's own Python API as a peer on a GPU host without network or compiler work.

Build host (``pack``): FlashInfer's Python wrappers load each JIT module from an AOT folder when one is
there (``flashinfer/data/aot/<uri>/<uri>.so``, ``jit.core.JitSpec.try_load``) before they would build it.
The modules are the ones pagedkv builds anyway (``pagedkv.flashinfer.build_module``: FlashInfer's own
generators and ninja rules, same URIs as its wrappers compute); ``pack`` links each module's objects into the
``<uri>.so`` FlashInfer's ninja file would have linked, and writes a trimmed copy of the flashinfer package
(its Python sources, jinja templates and the csrc files the attention generators copy; not its 850 MB of
CUTLASS headers and prebuilt kernels of other ops).

GPU host (``activate``): unpacks the package under /tmp, puts the AOT modules where FlashInfer looks, sets
``FLASHINFER_DISABLE_JIT=1`` (a module that is missing is an error, never a build), and imports flashinfer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

#: The attention modules FlashInfer's wrappers need for the benchmark, per dtype: CUDA-core decode, fa2 and
#: fa3 batch prefill (fa2 also serves its tensor-core decode), fa2 and fa3 MLA (DeepSeek dims).
PEER_KINDS = ("decode", "prefill_fa2", "prefill_fa3", "mla", "mla_fa3")
#: csrc files the attention generators read (``flashinfer.jit.attention.modules``)
_CSRC_PREFIXES = ("batch_prefill", "batch_decode", "batch_mla", "pytorch_", "tvm_ffi_utils")


def peer_specs(dtypes=("float16", "bfloat16"), arch: str = "sm_90") -> list:
    from pagedkv.flashinfer import MLA_KINDS, ModuleSpec

    out = []
    for dt in dtypes:
        for kind in PEER_KINDS:
            dims = (512, 64) if kind in MLA_KINDS else (128, 128)
            out.append(ModuleSpec(kind, dt, dt, dt, *dims, arch=arch))
    return out


def _link(objects: list[Path], so: Path) -> None:
    """The link step of FlashInfer's build.ninja (``c++ $in -shared -lcudart -lcuda``), against the stub
    libcuda pagedkv's CUDA builds use (the GPU host's driver provides the real one)."""
    from pagedkv.cuda_build import cuda_home, stub_libcuda

    home = cuda_home()
    so.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["c++", *map(str, objects), "-shared", f"-L{home}/lib64", f"-L{home}/lib", "-lcudart",
           f"-L{stub_libcuda().parent}", "-l:libcuda.so.1", "-o", str(so)]
    subprocess.run(cmd, check=True)


def _package_files(root: Path):
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_dir() or "__pycache__" in rel.parts:
            continue
        if p.suffix in (".py", ".jinja", ".json"):
            yield p, rel
        elif rel.parts[:2] == ("data", "csrc") and len(rel.parts) == 3 and p.name.startswith(_CSRC_PREFIXES):
            yield p, rel


_PRIMARY_SCRIPT = r"""
import json, subprocess, sys, torch
sys.path.insert(0, sys.argv[3])
from _worker import object_targets
from flashinfer.jit.attention import modules as m
dt = getattr(torch, sys.argv[1])
js = m._gen_batch_prefill_primary_module("fa2", dt, dt, dt, torch.int32, 128, 128, 0, False, False, False)
js.write_ninja()
objs = object_targets(js.ninja_path)
subprocess.run(["ninja", "-C", str(js.build_dir), "-f", str(js.ninja_path), "-j", sys.argv[2], *objs],
               check=True, stdout=subprocess.DEVNULL)
print(json.dumps({"uri": js.name, "objects": objs}))
"""


def _fa2_primary(spec, out: Path) -> dict:
    """FlashInfer's own fa2 batch-prefill wrapper (and its tensor-core decode) loads the equal-K/V-stride
    "primary" module (``_kv_stride_equal``: the SAME_KV_STRIDES instantiation only), not the public module
    pagedkv links (which dispatches to the same instantiation at run time when K and V strides agree).
    Built with FlashInfer's generator and ninja rules, in pagedkv's FlashInfer workspace."""
    import pagedkv.flashinfer.build as fb

    jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
    env = fb._worker_env(spec, fb.cache_root(), int(jobs))  # pylint: disable=protected-access
    worker_dir = Path(fb.__file__).parent
    res = subprocess.run([sys.executable, "-c", _PRIMARY_SCRIPT, spec.dtype_q, jobs, str(worker_dir)], env=env,
                         check=True, capture_output=True, text=True)
    info = json.loads(res.stdout.strip().splitlines()[-1])
    so = out / "aot" / info["uri"] / f"{info['uri']}.so"
    if not so.exists():
        _link([Path(o) for o in info["objects"]], so)
    return {"uri": info["uri"], "bytes": so.stat().st_size}


def pack(out: Path, specs=None) -> dict:
    """Write ``out/flashinfer-py.tar.xz`` and ``out/aot/<uri>/<uri>.so`` for ``specs`` (default
    ``peer_specs()``); returns what was written (also ``out/peer.json``)."""
    import flashinfer

    from pagedkv.flashinfer import build_module

    out.mkdir(parents=True, exist_ok=True)
    modules = {}
    for spec in specs or peer_specs():
        built = build_module(spec)
        uri = json.loads(built.object_path.with_name("module.json").read_text())["uri"]
        so = out / "aot" / uri / f"{uri}.so"
        if not so.exists():
            _link(built.source_objects(), so)
        modules[spec.name] = {"uri": uri, "bytes": so.stat().st_size}
        if spec.kind == "prefill_fa2":
            modules[spec.name + "_kv_stride_equal"] = _fa2_primary(spec, out)
    root = Path(flashinfer.__file__).parent
    with tarfile.open(out / "flashinfer-py.tar.xz", "w:xz") as tar:
        for path, rel in _package_files(root):
            tar.add(path, arcname=str(Path("flashinfer") / rel))
    info = {"flashinfer": flashinfer.__version__, "modules": modules}
    (out / "peer.json").write_text(json.dumps(info, indent=1))
    return info


def activate(peer_dir: Path, site: Path = Path("/tmp/pagedkv-fi-site")):
    """Make ``import flashinfer`` load the packed copy with its AOT modules; returns the module."""
    pkg = site / "flashinfer"
    if not (pkg / "__init__.py").exists():
        site.mkdir(parents=True, exist_ok=True)
        with tarfile.open(peer_dir / "flashinfer-py.tar.xz") as tar:
            tar.extractall(site, filter="data")
    aot = pkg / "data" / "aot"
    aot.mkdir(parents=True, exist_ok=True)
    for d in (peer_dir / "aot").iterdir():
        if not (aot / d.name).exists():
            shutil.copytree(d, aot / d.name)
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(site / "workspace"))
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    import flashinfer

    return flashinfer
