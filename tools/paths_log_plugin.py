"""pytest plugin that lists the forced kernel paths a suite exercises (issue 43: "nothing kept lost its test").

    PAGEDKV_PATHS_LOG=paths.tsv PYTHONPATH=tools:$PYTHONPATH python -m pytest tests -p paths_log_plugin ...
    python3 tools/paths_log_plugin.py paths.tsv      # switch=value -> the test modules that force it

Every normalization of forced paths (``pagedkv.kernel_spec.normalize_paths``: a ``KernelSpec(paths=...)`` and
``pagedkv.backends.tir.forced_paths``) appends ``switch=value<TAB>module`` (once per pair and module) to the log,
from every pytest-xdist worker.
"""

from __future__ import annotations

import os
import sys

_MODULE = ["(collection)"]
_SEEN: set = set()


def _log(pairs) -> None:
    path = os.environ["PAGEDKV_PATHS_LOG"]
    for switch, value in pairs:
        row = f"{switch}={value}\t{_MODULE[0]}"
        if row not in _SEEN:
            _SEEN.add(row)
            with open(path, "a") as fh:
                fh.write(row + "\n")


def pytest_configure(config):
    if not os.environ.get("PAGEDKV_PATHS_LOG"):
        return
    from pagedkv import kernel_spec

    original = kernel_spec.normalize_paths

    def normalize_paths(paths):
        out = original(paths)
        _log(out)
        return out

    kernel_spec.normalize_paths = normalize_paths
    try:  # forced_paths' own reference (the module imports the name)
        from pagedkv.backends import tir
    except Exception as err:  # noqa: BLE001 (a listing tool must not stop the suite)
        print(f"paths_log_plugin: pagedkv.backends.tir not patched ({err})")
    else:
        tir.normalize_paths = normalize_paths


def pytest_runtest_setup(item):
    _MODULE[0] = item.nodeid.split("::")[0]


def summary(path: str) -> str:
    """``switch=value: module, module`` lines of a log, sorted."""
    table: dict[str, set] = {}
    for line in open(path):
        pair, _, module = line.rstrip("\n").partition("\t")
        table.setdefault(pair, set()).add(module.rsplit("/", 1)[-1])
    return "\n".join(f"{pair}: {', '.join(sorted(mods))}" for pair, mods in sorted(table.items()))


if __name__ == "__main__":
    print(summary(sys.argv[1]))
