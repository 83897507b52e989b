#!/usr/bin/env python3
"""Move a set of files to another machine through several size-capped transfers (standard library only).

The GPU host receives at most ~64 MiB of git-ignored files per call, but a machine stays warm between calls:
``split`` cuts the files into parts below a size cap, each call carries one part and ``stage``s it under
/tmp there, and once every part is staged ``assemble`` rebuilds the files and checks every sha256.

    python3 tools/carry.py split OUT [--max-mb 60] SRC[=ARCNAME] ...
    python3 tools/carry.py stage PART DEST
    python3 tools/carry.py assemble DEST ROOT

``SRC`` is a file or a folder (walked recursively, symlinks followed); it is stored under its own relative
path, or under ``ARCNAME`` (``/path/to/model.gguf=.gpu/extra/model.gguf``). Every part holds the whole
manifest (path, size, mode, sha256 of each file and of each chunk, and where each chunk lies), so parts can
be staged in any order; staging a part of another split into DEST starts DEST over. ``assemble`` writes
nothing until every part is staged, names the missing ones, and skips files already equal at ROOT, so
calling it after every stage is safe.

Imports nothing from pagedkv or TVM: it runs with a bare ``python3`` on the GPU host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path, PurePosixPath

FORMAT = "pagedkv-carry/1"
MANIFEST = "carry-manifest.json"
BLOCK = 1 << 20


class CarryError(Exception):
    """A user-facing failure (missing part, corrupted chunk, bad argument): printed without a traceback."""


def _arcname(name: str) -> str:
    """``name`` as a safe relative POSIX path (no absolute path, no ``..``), so ``assemble`` writes only
    under ROOT even from a hand-edited manifest."""
    p = PurePosixPath(name.replace(os.sep, "/"))
    parts = [x for x in p.parts if x not in ("", ".")]
    if p.is_absolute() or not parts or ".." in parts:
        raise CarryError(f"{name!r} is not a relative path inside the carry (give SRC=ARCNAME)")
    return "/".join(parts)


def collect(sources: list[str]) -> list[tuple[str, Path]]:
    """(arcname, path on disk) of every file under ``sources`` (``SRC`` or ``SRC=ARCNAME``), sorted per
    source; an arcname given twice is an error."""
    out, seen = [], set()
    for spec in sources:
        src, _, arc = spec.partition("=")
        path = Path(src)
        base = _arcname(arc or src)
        if path.is_file():
            found = [(base, path)]
        elif path.is_dir():
            found = [(f"{base}/{f.relative_to(path).as_posix()}", f) for f in sorted(path.rglob("*"))
                     if f.is_file()]
        else:
            raise CarryError(f"no such file or folder: {src}")
        for arc_name, f in found:
            if arc_name in seen:
                raise CarryError(f"{arc_name} is given twice")
            seen.add(arc_name)
            out.append((arc_name, f))
    return out


def plan(files: list[tuple[str, Path]], capacity: int) -> tuple[list[dict], int]:
    """Manifest entries (sha256 still empty) and the part count: the files in order fill part after
    part, a file that does not fit being cut at the part's end, so there are as few parts as possible."""
    entries, part, room = [], 1, capacity
    for i, (arc, path) in enumerate(files):
        size = path.stat().st_size
        entry = {"path": arc, "size": size, "mode": path.stat().st_mode & 0o777, "sha256": "", "chunks": []}
        offset = 0
        while offset < size:
            if room == 0:
                part, room = part + 1, capacity
            n = min(room, size - offset)
            entry["chunks"].append({"part": part, "name": f"{i:05d}.{len(entry['chunks']):03d}",
                                    "offset": offset, "size": n, "sha256": ""})
            offset, room = offset + n, room - n
        entries.append(entry)
    return entries, part


def _manifest_bytes(entries: list[dict], parts: int, bundle: str, this_part: int) -> bytes:
    doc = {"format": FORMAT, "bundle": bundle, "parts": parts, "part": this_part, "files": entries}
    return json.dumps(doc, indent=1).encode()


def _placeholder_size(entries: list[dict], parts: int) -> int:
    """The manifest's exact size: sha256 fields are fixed-width, so fill them with 64 zeros."""
    filled = [{**e, "sha256": "0" * 64, "chunks": [{**c, "sha256": "0" * 64} for c in e["chunks"]]}
              for e in entries]
    return len(_manifest_bytes(filled, parts, "0" * 64, parts))


def _write_chunks(entries: list[dict], files: list[tuple[str, Path]], out: Path) -> None:
    """Read each file once, writing its chunks into their parts and filling in every sha256."""
    for entry, (_, path) in zip(entries, files):
        whole = hashlib.sha256()
        with open(path, "rb") as src:
            for chunk in entry["chunks"]:
                folder = out / f"part{chunk['part']}" / "chunks"
                folder.mkdir(parents=True, exist_ok=True)
                digest, left = hashlib.sha256(), chunk["size"]
                with open(folder / chunk["name"], "wb") as dst:
                    while left:
                        block = src.read(min(BLOCK, left))
                        if not block:
                            raise CarryError(f"{path} shrank while being split")
                        dst.write(block)
                        digest.update(block)
                        whole.update(block)
                        left -= len(block)
                chunk["sha256"] = digest.hexdigest()
        entry["sha256"] = whole.hexdigest()


def _clear_old_parts(out: Path) -> None:
    """Remove the parts of an earlier split in OUT (a stale part N+1 must not travel); refuse to remove
    a ``part*`` folder that is not a carry part."""
    for old in sorted(out.glob("part*")):
        if not old.is_dir() or not old.name[4:].isdigit():
            continue
        if not (old / MANIFEST).is_file():
            raise CarryError(f"{old} is not a carry part (no {MANIFEST}); not removing it")
        shutil.rmtree(old)


def split(out: Path, sources: list[str], max_mb: float) -> list[Path]:
    """Write ``out/part1`` ... ``out/partN``, each at most ``max_mb`` MB (10**6 bytes) in all. Returns them."""
    files = collect(sources)
    limit = int(max_mb * 1e6)
    reserve = 0
    for _ in range(8):  # the manifest's own size shrinks the room for chunks, which can add chunks
        entries, parts = plan(files, limit - reserve)
        need = _placeholder_size(entries, parts)
        if need <= reserve:
            break
        reserve = need + 4096
        if reserve >= limit:
            raise CarryError(f"--max-mb {max_mb} leaves no room beside a {need}-byte manifest")
    else:
        raise CarryError("the manifest's size did not settle")
    out.mkdir(parents=True, exist_ok=True)
    _clear_old_parts(out)
    _write_chunks(entries, files, out)
    bundle = hashlib.sha256(json.dumps([(e["path"], e["sha256"]) for e in entries]).encode()).hexdigest()
    paths = []
    for k in range(1, parts + 1):
        folder = out / f"part{k}"
        (folder / "chunks").mkdir(parents=True, exist_ok=True)  # also a part that holds only the manifest
        (folder / MANIFEST).write_bytes(_manifest_bytes(entries, parts, bundle, k))
        paths.append(folder)
    return paths


def _read_manifest(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CarryError(f"cannot read the carry manifest {path}: {err}") from err
    if doc.get("format") != FORMAT:
        raise CarryError(f"{path} is not a {FORMAT} manifest (format {doc.get('format')!r})")
    return doc


def _copy_checked(src: Path, dst: Path, sha256: str, what: str) -> None:
    """Copy ``src`` to ``dst`` through a temporary name, failing (and leaving nothing) on a wrong sha256."""
    tmp = dst.with_name(dst.name + ".tmp")
    digest = hashlib.sha256()
    try:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            for block in iter(lambda: fi.read(BLOCK), b""):
                digest.update(block)
                fo.write(block)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise CarryError(f"{what}: cannot copy {src}: {err}") from err
    if digest.hexdigest() != sha256:
        tmp.unlink()
        raise CarryError(f"{what}: chunk {src.name} is corrupted (sha256 {digest.hexdigest()[:16]}..., "
                         f"expected {sha256[:16]}...)")
    os.replace(tmp, dst)


def _parts_status(dest: Path, parts: int) -> tuple[list[int], list[int]]:
    staged = [k for k in range(1, parts + 1) if (dest / "staged" / f"part{k}").is_file()]
    return staged, [k for k in range(1, parts + 1) if k not in staged]


def stage(part: Path, dest: Path) -> list[int]:
    """Copy one part's chunks (checked) and the manifest into ``dest``. Returns the parts still missing."""
    doc = _read_manifest(part / MANIFEST)
    k = doc["part"]
    if (dest / MANIFEST).is_file() and _read_manifest(dest / MANIFEST)["bundle"] != doc["bundle"]:
        print(f"[carry] {dest} holds parts of another split: starting it over", flush=True)
        for name in ("chunks", "staged", MANIFEST):
            p = dest / name
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    (dest / "chunks").mkdir(parents=True, exist_ok=True)
    (dest / "staged").mkdir(exist_ok=True)
    (dest / "staged" / f"part{k}").unlink(missing_ok=True)  # marked staged only once every chunk is in
    size = 0
    for entry in doc["files"]:
        for chunk in (c for c in entry["chunks"] if c["part"] == k):
            src = part / "chunks" / chunk["name"]
            if not src.is_file():
                raise CarryError(f"part {k} ({part}) lacks chunk {chunk['name']} of {entry['path']}")
            _copy_checked(src, dest / "chunks" / chunk["name"], chunk["sha256"], f"part {k} ({entry['path']})")
            size += chunk["size"]
    (dest / MANIFEST).write_bytes(_manifest_bytes(doc["files"], doc["parts"], doc["bundle"], 0))
    (dest / "staged" / f"part{k}").write_text(f"{size}\n")
    staged, missing = _parts_status(dest, doc["parts"])
    print(f"[carry] staged part {k} of {doc['parts']} ({size / 1e6:.1f} MB) into {dest}; staged {staged}, "
          f"missing {missing or 'none'}", flush=True)
    return missing


def _file_matches(path: Path, entry: dict) -> bool:
    if not path.is_file() or path.stat().st_size != entry["size"]:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest() == entry["sha256"]


def _rebuild(entry: dict, chunks: Path, target: Path) -> None:
    """Concatenate ``entry``'s chunks into ``target`` (through a temporary name), checking each chunk's
    and the whole file's sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".carry-tmp")
    whole = hashlib.sha256()
    with open(tmp, "wb") as out:
        for chunk in entry["chunks"]:
            data = (chunks / chunk["name"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != chunk["sha256"]:
                tmp.unlink()
                raise CarryError(f"staged chunk {chunk['name']} (part {chunk['part']}, {entry['path']}) is "
                                 f"corrupted: stage part {chunk['part']} again")
            whole.update(data)
            out.write(data)
    if whole.hexdigest() != entry["sha256"]:
        tmp.unlink()
        raise CarryError(f"{entry['path']}: sha256 of the rebuilt file differs from the manifest")
    os.chmod(tmp, entry["mode"])
    os.replace(tmp, target)


def assemble(dest: Path, root: Path) -> dict:
    """Rebuild every file under ``root`` once all parts are staged in ``dest``. Returns counts
    ``{"written", "unchanged", "bytes"}``; raises CarryError naming the missing parts (nothing written)."""
    if not (dest / MANIFEST).is_file():
        raise CarryError(f"nothing is staged in {dest} (no {MANIFEST}): run `carry.py stage PART {dest}` first")
    doc = _read_manifest(dest / MANIFEST)
    staged, missing = _parts_status(dest, doc["parts"])
    if missing:
        raise CarryError(f"{len(missing)} of {doc['parts']} parts not staged in {dest}: "
                         + ", ".join(f"part{k}" for k in missing) + f" (staged: {staged or 'none'})")
    counts = {"written": 0, "unchanged": 0, "bytes": 0}
    for entry in doc["files"]:
        target = root / _arcname(entry["path"])
        if _file_matches(target, entry):
            counts["unchanged"] += 1
            continue
        _rebuild(entry, dest / "chunks", target)
        counts["written"] += 1
        counts["bytes"] += entry["size"]
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="carry.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("split", help="pack SRC files/folders into OUT/part1..N")
    sp.add_argument("out", type=Path)
    sp.add_argument("sources", nargs="+", metavar="SRC[=ARCNAME]")
    sp.add_argument("--max-mb", type=float, default=60.0, help="cap of one part, MB of 10**6 bytes (60)")
    st = sub.add_parser("stage", help="copy one part into the staging folder DEST")
    st.add_argument("part", type=Path)
    st.add_argument("dest", type=Path)
    asm = sub.add_parser("assemble", help="rebuild the files under ROOT once every part is staged")
    asm.add_argument("dest", type=Path)
    asm.add_argument("root", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "split":
            for p in split(args.out, args.sources, args.max_mb):
                size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                print(f"[carry] {p}: {size / 1e6:.2f} MB")
        elif args.cmd == "stage":
            stage(args.part, args.dest)
        else:
            c = assemble(args.dest, args.root)
            print(f"[carry] assembled under {args.root}: {c['written']} files written "
                  f"({c['bytes'] / 1e6:.1f} MB), {c['unchanged']} already up to date")
    except CarryError as err:
        print(f"carry: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
