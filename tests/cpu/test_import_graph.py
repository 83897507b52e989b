"""The package's import graph has no circle (every import counts, also one inside a function), and the
library core does not import the applications above it."""

from __future__ import annotations

import ast
from pathlib import Path

_PKG = Path(__file__).resolve().parents[2] / "python" / "pagedkv"


def _module_name(path: Path) -> str:
    rel = path.relative_to(_PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Modules of the package that ``path`` imports (relative and absolute; ``from X import y`` counts ``X.y``
    when that is a module of the package, else ``X``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bases = [a.name for a in node.names]
            out.update(b for b in bases if b in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif base in known:
                    out.add(base)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {(_module_name(p)): p for p in _PKG.rglob("*.py") if "__pycache__" not in p.parts}
    known = set(files)
    return {name: _imports(path, name, known) for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            # a package's own __init__ importing its submodules is how packages work, not a circle
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_core_does_not_import_applications():
    graph = import_graph()
    apps = {m for m in graph if m.startswith(("pagedkv.apps", "pagedkv.testing"))}
    core = [m for m in graph if m not in apps and m != "pagedkv.__main__"]
    bad = {m: sorted(graph[m] & apps) for m in core if graph[m] & apps}
    assert not bad, bad
