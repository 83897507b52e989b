"""Progress lines of long builds (kernels, models) on stderr: what is built, how far it is, how long it took.

A compile of pagedkv's kernels takes seconds on a CPU host, a CUDA build minutes, a model build longer; a
silent process looks hung. ``Progress`` prints a header, a line at each stage, a tick with the elapsed time
while a stage runs, and an end line that says ``done`` only when the build did not raise::

    [pagedkv] compiling the kernels of 4/2 heads x 32 float32 for target llvm, 9 ops (once: cached in ...) ...
    [pagedkv]   generating the kernels of 9 ops (0.0 s)
    [pagedkv]   TVM compiles 9 kernels (0.8 s)
    [pagedkv]   ... TVM compiles 9 kernels: 10 s
    [pagedkv]   writing the library (11.6 s)
    [pagedkv] compiling the kernels of 4/2 heads x 32 float32 for target llvm, 9 ops: done in 12.3 s

A build that raises ends in ``FAILED after 3.1 s (RuntimeError: ...)`` (``interrupted`` for Ctrl-C) instead.
Short builds can stay quiet (``quiet_for``): nothing is printed unless the build runs longer or fails.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

#: Builds shorter than this (seconds) print nothing when the caller asks for quiet short builds.
QUIET_FOR = 2.0
#: Seconds between ticks while a stage runs.
TICK_EVERY = 10.0


class Progress:
    """Context manager that reports a build's progress on ``stream`` (stderr by default).

    Parameters
    ----------
    what : str
        The build, as the lines name it ("compiling the kernels of ... for target llvm").
    detail : str
        Said once, in the header (e.g. where the result is cached).
    quiet_for : float
        Seconds before anything is printed: 0 announces the build at once; a build that ends (without
        raising) sooner prints nothing. A failure is always reported.
    every : float
        Seconds between ticks (the current stage and the elapsed time) while a stage runs.
    stream : file, optional
        Where the lines go; ``sys.stderr`` (looked up at each line, so pytest's capture sees them) by default.

    Notes
    -----
    The ticker is a daemon thread: TVM's compiler and the linker release the GIL, so it runs while they do.
    """

    def __init__(self, what: str, *, detail: str = "", quiet_for: float = 0.0, every: float = TICK_EVERY,
                 stream: TextIO | None = None) -> None:
        self.what, self.detail, self.quiet_for, self.every, self._stream = what, detail, quiet_for, every, stream
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._status = ""
        self._shown = False  # the header is out: stage and end lines follow it
        self._t0 = 0.0
        self._thread: threading.Thread | None = None

    @property
    def elapsed(self) -> float:
        """Seconds since the build started."""
        return time.perf_counter() - self._t0

    def _print(self, line: str) -> None:
        stream = self._stream or sys.stderr
        print(f"[pagedkv] {line}", file=stream, flush=True)

    def _show_header(self) -> None:
        # called with the lock held
        if not self._shown:
            self._shown = True
            self._print(f"{self.what}{f' ({self.detail})' if self.detail else ''} ...")
            if self._status:  # a quiet build that ran long: what it does now, as a tick says it
                self._print(f"  ... {self._status}: {self.elapsed:.0f} s")

    def __enter__(self) -> "Progress":
        self._t0 = time.perf_counter()
        if self.quiet_for <= 0:
            with self._lock:
                self._show_header()
        self._thread = threading.Thread(target=self._tick, name="pagedkv-progress", daemon=True)
        self._thread.start()
        return self

    def _tick(self) -> None:
        if not self._shown and not self._stop.wait(self.quiet_for):
            with self._lock:
                self._show_header()
        while not self._stop.wait(self.every):
            with self._lock:
                self._print(f"  ... {self._status or self.what}: {self.elapsed:.0f} s")

    def update(self, status: str) -> None:
        """What the build does now (e.g. "generating op 3/9: merge_state"), named by the next tick; no line."""
        with self._lock:
            self._status = status

    def stage(self, status: str) -> None:
        """The build starts ``status`` (e.g. "TVM compiles 9 kernels"): a line now if the header is out (with
        the elapsed time), and the ticks name it until the next ``update`` or ``stage``."""
        with self._lock:
            self._status = status
            if self._shown:
                self._print(f"  {status} ({self.elapsed:.1f} s)")

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if exc_type is None:
                if self._shown:
                    self._print(f"{self.what}: done in {self.elapsed:.1f} s")
            else:
                word, reason = _failure(exc_type, exc)
                self._print(f"{self.what}: {word} after {self.elapsed:.1f} s{reason}")
        return False  # the exception propagates


def _failure(exc_type, exc) -> tuple[str, str]:
    """How an end line names a failure: (word, reason). Ctrl-C is an interruption; anything else a failure
    with the exception's type and first line (the traceback that follows has the rest)."""
    if issubclass(exc_type, KeyboardInterrupt):
        return "interrupted", ""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return "FAILED", f" ({exc_type.__name__}{': ' + first if first else ''})"


__all__ = ["Progress", "QUIET_FOR", "TICK_EVERY"]
