"""``python3 tools/sass_counts.py DIR_OR_LIB...``: per kernel function of every ``*.so`` under DIR (or named), how many tensor-core
instructions its SASS holds (HMMA: ``mma.sync``; HGMMA: ``wgmma``), from ``cuobjdump -sass`` (a CUDA toolkit
tool; the GPU host has it; on the build host, from PyPI's ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``
wheels, which it calls: ``pip download --no-deps`` both, unzip, put their ``nvidia/cu13/bin`` on ``PATH``). TVM embeds a kernel library's device code as a CUDA
fatbin inside its own module blob, where cuobjdump does not look, so each fatbin is cut out first (its header
gives the size). Prints ``file function HMMA HGMMA`` lines, functions without either left out, and a JSON
summary as the last line."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

#: First bytes of a CUDA fatbin (little-endian 0xBA55ED50), then version (u16), header size (u16), size (u64).
FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)


def fatbins(lib: Path) -> list[bytes]:
    """The CUDA fatbins embedded in ``lib`` (header + payload each)."""
    data, out = lib.read_bytes(), []
    i = data.find(FATBIN_MAGIC)
    while i >= 0:
        _version, header, size = struct.unpack_from("<HHQ", data, i + 4)
        out.append(data[i:i + header + size])
        i = data.find(FATBIN_MAGIC, i + header + size)
    return out


def counts(lib: Path, tool: str) -> dict:
    """{function: {"HMMA": n, "HGMMA": n}} of the SASS of ``lib``'s embedded fatbins."""
    out = ""
    with tempfile.TemporaryDirectory() as tmp:
        for k, blob in enumerate(fatbins(lib)):
            path = Path(tmp) / f"{k}.fatbin"
            path.write_bytes(blob)
            out += subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=False).stdout
    found, name = {}, None
    for line in out.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            name = m.group(1)
            found.setdefault(name, {"HMMA": 0, "HGMMA": 0})
        elif name is not None:
            for op in ("HGMMA", "HMMA"):
                if re.search(rf"\b{op}\.", line):
                    found[name][op] += 1
                    break
    return {f: c for f, c in found.items() if c["HMMA"] or c["HGMMA"]}


def main(argv: list[str]) -> int:
    tool = shutil.which("cuobjdump") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/cuobjdump")), None)
    if tool is None:
        print("cuobjdump not found", file=sys.stderr)
        return 1
    summary = {}
    for d in argv:
        for lib in [Path(d)] if Path(d).is_file() else sorted(Path(d).rglob("*.so")):
            c = counts(lib, tool)
            for f, n in sorted(c.items()):
                print(f"{lib.name} {f} {n['HMMA']} {n['HGMMA']}")
            summary[lib.name] = c
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
