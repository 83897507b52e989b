"""``tools/carry.py`` (moving ``.gpu/`` and the GGUF file to the GPU host in size-capped parts): split ->
stage every part (in any order) -> assemble gives identical files; a missing part, a corrupted chunk and a
part of another split are reported clearly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import carry  # noqa: E402


@pytest.fixture
def tree(tmp_path):
    """A source tree with a file bigger than a part, small files, an empty file, an executable and a file
    outside the tree stored under another name."""
    src = tmp_path / "src"
    (src / ".gpu" / "models").mkdir(parents=True)
    (src / ".gpu" / "models" / "big.so").write_bytes(os.urandom(2_500_000))
    (src / ".gpu" / "models" / "big.json").write_text('{"param_names": []}')
    (src / ".gpu" / "empty").write_bytes(b"")
    script = src / ".gpu" / "run.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    outside = tmp_path / "elsewhere" / "model.gguf"
    outside.parent.mkdir()
    outside.write_bytes(os.urandom(1_200_000))
    return src, outside


def _split(tmp_path, tree, max_mb=1.0):
    src, outside = tree
    cwd = os.getcwd()
    os.chdir(src)  # SRC paths are stored relative to where split runs
    try:
        return carry.split(tmp_path / "carry", [".gpu", f"{outside}=.gpu/extra/model.gguf"], max_mb)
    finally:
        os.chdir(cwd)


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
        assert (a / n).stat().st_mode & 0o777 == (b / n).stat().st_mode & 0o777, n


def test_round_trip_any_order(tmp_path, tree):
    parts = _split(tmp_path, tree)
    assert len(parts) == 4  # 3.7 MB in parts of 1 MB
    for p in parts:
        assert sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) <= 1_000_000
    stage = tmp_path / "stage"
    for p in reversed(parts):  # every part holds the manifest: any order works
        carry.stage(p, stage)
    root = tmp_path / "root"
    counts = carry.assemble(stage, root)
    assert counts["written"] == 5 and counts["unchanged"] == 0
    src, outside = tree
    assert (root / ".gpu" / "extra" / "model.gguf").read_bytes() == outside.read_bytes()
    (root / ".gpu" / "extra" / "model.gguf").unlink()
    (root / ".gpu" / "extra").rmdir()
    _same_files(src / ".gpu", root / ".gpu")
    # idempotent: a second assemble rewrites only what differs from the manifest
    (root / ".gpu" / "models" / "big.json").write_text("changed")
    again = carry.assemble(stage, root)
    assert again["written"] == 2 and again["unchanged"] == 3  # big.json and the removed model.gguf
    assert (root / ".gpu" / "models" / "big.json").read_text() == '{"param_names": []}'


def test_missing_part_named(tmp_path, tree):
    parts = _split(tmp_path, tree)
    stage = tmp_path / "stage"
    with pytest.raises(carry.CarryError, match="nothing is staged"):
        carry.assemble(stage, tmp_path / "root")
    missing = carry.stage(parts[0], stage)
    assert missing == [2, 3, 4]
    carry.stage(parts[2], stage)
    with pytest.raises(carry.CarryError, match=r"2 of 4 parts not staged .*: part2, part4"):
        carry.assemble(stage, tmp_path / "root")
    assert not (tmp_path / "root").exists()  # nothing written while parts are missing


def test_corrupted_chunk_detected(tmp_path, tree):
    parts = _split(tmp_path, tree)
    chunk = sorted((parts[1] / "chunks").iterdir())[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    stage = tmp_path / "stage"
    with pytest.raises(carry.CarryError, match=f"part 2 .*chunk {chunk.name} is corrupted"):
        carry.stage(parts[1], stage)
    assert not (stage / "staged" / "part2").exists()
    # a chunk corrupted after staging is caught by assemble, naming the part to stage again
    for p in parts[:1] + parts[2:]:
        carry.stage(p, stage)
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    carry.stage(parts[1], stage)
    staged = stage / "chunks" / chunk.name
    staged.write_bytes(b"x" + staged.read_bytes()[1:])
    with pytest.raises(carry.CarryError, match=f"staged chunk {chunk.name} \\(part 2,.*stage part 2 again"):
        carry.assemble(stage, tmp_path / "root")


def test_another_split_starts_stage_over(tmp_path, tree):
    parts = _split(tmp_path, tree)
    stage = tmp_path / "stage"
    carry.stage(parts[0], stage)
    (tree[0] / ".gpu" / "empty").write_text("now different")
    new = _split(tmp_path, tree)
    assert carry.stage(new[1], stage) == [1, 3, 4]  # the old part 1 no longer counts


def test_bad_sources(tmp_path):
    with pytest.raises(carry.CarryError, match="not a relative path"):
        carry.split(tmp_path / "c", [f"{tmp_path}"], 1.0)
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(carry.CarryError, match="not a relative path"):
        carry.split(tmp_path / "c", [f"{f}=../up"], 1.0)
    with pytest.raises(carry.CarryError, match="given twice"):
        carry.split(tmp_path / "c", [f"{f}=a", f"{f}=a"], 1.0)


def test_cli(tmp_path, tree):
    src, outside = tree
    tool = Path(carry.__file__)
    run = lambda *a: subprocess.run([sys.executable, str(tool), *map(str, a)], cwd=src,  # noqa: E731
                                    capture_output=True, text=True)
    out = run("split", tmp_path / "c", "--max-mb", "2", ".gpu")
    assert out.returncode == 0, out.stderr
    assert "part2" in out.stdout and not (tmp_path / "c" / "part3").exists()
    assert run("stage", tmp_path / "c" / "part2", tmp_path / "s").returncode == 0
    bad = run("assemble", tmp_path / "s", tmp_path / "r")
    assert bad.returncode == 1 and "part1" in bad.stderr and "Traceback" not in bad.stderr
    assert run("stage", tmp_path / "c" / "part1", tmp_path / "s").returncode == 0
    assert run("assemble", tmp_path / "s", tmp_path / "r").returncode == 0
    _same_files(src / ".gpu", tmp_path / "r" / ".gpu")
