"""``pagedkv`` command line: ``pagedkv chat [PROMPT ...]``, ``pagedkv backends [--target T] [config options]``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: pagedkv chat [PROMPT ...] [--max-new-tokens N] [--target llvm] [--backend tir]\n"
              "       pagedkv backends [--target T] [config options]   (pagedkv backends --help)")
        return 0
    if argv[0] == "backends":
        from .support import main as backends

        return backends(argv[1:])
    if argv[0] == "chat":
        from .apps.chat import main as chat

        return chat(argv[1:])
    print(f"pagedkv: unknown command {argv[0]!r} (try 'pagedkv chat' or 'pagedkv backends')", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
