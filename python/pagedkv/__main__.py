"""``pagedkv`` command line: ``pagedkv chat [PROMPT ...]``, ``pagedkv backends [--target T] [config options]``,
``pagedkv --version``."""

from __future__ import annotations

import sys

#: (name printed, distribution, module to ask when the distribution has no metadata, e.g. a runtime bundle)
_VERSIONED = (("tvm", "apache-tvm", "tvm"), ("tvm-ffi", "apache-tvm-ffi", "tvm_ffi"),
              ("flashinfer", "flashinfer-python", None))


def _version_of(dist: str, module: str | None) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    if module is None:  # flashinfer is never imported here: it pulls in torch and may need a GPU
        return "not installed"
    try:
        return str(__import__(module).__version__)
    except Exception:  # noqa: BLE001 (any failure to import means: not usable here)
        return "not installed"


def versions() -> dict[str, str]:
    """pagedkv's version and those of the packages it runs on (``pagedkv --version``)."""
    from . import __version__

    return {"pagedkv": __version__, **{name: _version_of(dist, mod) for name, dist, mod in _VERSIONED}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: pagedkv chat [PROMPT ...] [--max-new-tokens N] [--target llvm] [--backend tir]\n"
              "       pagedkv backends [--target T] [config options]   (pagedkv backends --help)\n"
              "       pagedkv --version")
        return 0
    if argv[0] in ("--version", "-V"):
        v = versions()
        print(f"pagedkv {v.pop('pagedkv')} (" + ", ".join(f"{k} {x}" for k, x in v.items()) + ")")
        return 0
    if argv[0] == "backends":
        from .support import main as backends

        return backends(argv[1:])
    if argv[0] == "chat":
        from .apps.chat import main as chat

        return chat(argv[1:])
    print(f"pagedkv: unknown command {argv[0]!r} (try 'pagedkv chat', 'pagedkv backends' or 'pagedkv --version')",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
