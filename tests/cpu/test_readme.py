"""The README answers "Which target do I use?" and "How fast is it?" in a few lines each, the latter with a plot of
the scoreboard (BENCHMARKS.md) that exists in the checkout."""

from __future__ import annotations

import re
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_readme_answers_target_and_speed_with_a_scoreboard_plot():
    readme = (_REPO / "README.md").read_text()
    scoreboard = (_REPO / "BENCHMARKS.md").read_text()
    for title in ("Which target do I use?", "How fast is it?"):
        lines = [line for line in _section(readme, title).splitlines()[1:] if line.strip()]
        assert len(lines) <= 15, f"{title!r} takes {len(lines)} lines"
    fast = _section(readme, "How fast is it?")
    plots = re.findall(r"!\[[^\]]*\]\((docs/plots/[^)]+\.png)\)", fast)
    assert plots and all((_REPO / p).is_file() and f"({p})" in scoreboard for p in plots), plots
    assert "BENCHMARKS.md" in fast
