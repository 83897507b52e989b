"""Generate and compile one FlashInfer module's objects, in a child process (``pagedkv.flashinfer.build``).

Run as ``python <path>/_worker.py SPEC_JSON JOBS`` with FlashInfer's environment set by the
parent (``FLASHINFER_CUDA_ARCH_LIST``, ``FLASHINFER_WORKSPACE_BASE``, ``CUDA_HOME``): flashinfer reads them
when it is first imported, so each build gets a fresh interpreter. The sources come from flashinfer 0.7.4's
own generators, unmodified; ninja builds only the object files (the module's ``.so`` link, which wants
``-lcuda``, is not needed: pagedkv links the objects into the model library).

stdout: one JSON object per line, ``{"progress": [done, total]}`` while ninja runs, then
``{"objects": [...], "uri": ..., "seconds": ...}``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


def jit_spec(spec: dict):
    """flashinfer's JitSpec for a ``ModuleSpec`` dict (writes the generated sources)."""
    import torch

    from flashinfer.jit.attention import modules as m

    dt = {name: getattr(torch, name) for name in ("float16", "bfloat16", "int32")}
    q, kv, o, idx = (dt[spec[k]] for k in ("dtype_q", "dtype_kv", "dtype_o", "dtype_idx"))
    kind = spec["kind"]
    if kind == "decode":
        return m.gen_batch_decode_module(q, kv, o, idx, spec["head_dim_qk"], spec["head_dim_vo"],
                                         spec["pos_encoding_mode"], spec["use_sliding_window"],
                                         spec["use_logits_soft_cap"])
    if kind in ("prefill_fa2", "prefill_fa3"):
        return m.gen_batch_prefill_module(kind[-3:], q, kv, o, idx, spec["head_dim_qk"], spec["head_dim_vo"],
                                          spec["pos_encoding_mode"], spec["use_sliding_window"],
                                          spec["use_logits_soft_cap"], spec["use_fp16_qk_reduction"])
    if kind in ("mla", "mla_fa3"):
        backend = "fa3" if kind == "mla_fa3" else "fa2"
        return m.gen_batch_mla_module(backend, q, kv, o, idx, spec["head_dim_qk"], spec["head_dim_vo"], False)
    raise ValueError(f"unknown module kind {kind!r}")


def object_targets(ninja_file: Path) -> list[str]:
    """The compile outputs of a flashinfer build.ninja (real names: 0.7.4's ``get_object_paths()`` returns
    ``<stem>.cuda.o`` while its ninja file writes ``<parent-dir>_<stem>.cuda.o``)."""
    out = []
    for line in ninja_file.read_text().splitlines():
        m = re.match(r"^build (\S+): (cuda_compile|compile) ", line)
        if m:
            out.append(m.group(1))
    if not out:
        raise RuntimeError(f"no compile targets in {ninja_file}")
    return out


def main(argv: list[str]) -> int:
    spec, jobs = json.loads(argv[0]), int(argv[1])
    t0 = time.perf_counter()
    js = jit_spec(spec)
    js.write_ninja()
    objects = object_targets(js.ninja_path)
    cmd = ["ninja", "-C", str(js.build_dir), "-f", str(js.ninja_path), "-j", str(jobs), *objects]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    log = []
    for line in proc.stdout:
        log.append(line)
        m = _PROGRESS.match(line)
        if m:
            print(json.dumps({"progress": [int(m.group(1)), int(m.group(2))]}), flush=True)
    if proc.wait() != 0:
        tail = "".join(log[-60:])
        print(json.dumps({"error": f"ninja failed for {js.name} (exit {proc.returncode}):\n{tail}"}), flush=True)
        return 1
    print(json.dumps({"objects": objects, "uri": js.name, "seconds": time.perf_counter() - t0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
