"""Forcing a kernel's run-time code path, so tests can check every path on small shapes.

Several kernels choose between code paths at run time from a work estimate, a split count or a size
threshold (the CPU attention kernels run their work items on the calling thread or on the thread pool;
the CUDA decode kernels pick a split-KV count). Left alone (``"auto"``) each kernel chooses as it always
has, and the generated TIR is unchanged. A forced path is compile-time: ``KernelConfig.paths`` holds
``(switch, value)`` pairs, the kernel reads its switch with ``forced(cfg_paths, switch)``, and the kernel
library key includes the pairs, so a forced library never stands in for an automatic one.

``SWITCHES`` names every switch, the kernels that read it and the values it takes ("auto" first).
"""

from __future__ import annotations

from typing import Iterable, Mapping

#: switch -> (what reads it, allowed values; "auto" = the kernel's own run-time choice).
SWITCHES: dict[str, tuple[str, tuple[str, ...]]] = {
    "cpu_threads": ("CPU attention kernels (MHA and MLA): work items on the calling thread or the pool",
                    ("auto", "serial", "parallel")),
    "cuda_decode_splits": ("CUDA decode kernels (MHA attn_decode_paged, MLA mla_attn_decode_paged): the split-KV "
                           "count S (auto: from the shapes); a forced S is clamped to 1 .. the batch's key slots "
                           "(nnz * page size), and with S > 1 the partial states go through the merge kernel",
                           ("auto", "1", "2", "3", "8")),
}


def normalize_paths(paths: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> tuple[tuple[str, str], ...]:
    """``paths`` as sorted ``(switch, value)`` pairs without "auto" entries; raises ``ValueError`` naming an
    unknown switch or value."""
    items = dict(paths.items() if isinstance(paths, Mapping) else (paths or ()))
    out = []
    for name, value in sorted(items.items()):
        if name not in SWITCHES:
            raise ValueError(f"unknown kernel path switch {name!r}; known: {', '.join(sorted(SWITCHES))}")
        allowed = SWITCHES[name][1]
        if str(value) not in allowed:
            raise ValueError(f"kernel path switch {name!r} takes {', '.join(allowed)}; got {value!r}")
        if str(value) != "auto":
            out.append((name, str(value)))
    return tuple(out)


def forced(paths: tuple[tuple[str, str], ...], switch: str) -> str:
    """The value forced for ``switch`` in normalized ``paths``, or ``"auto"``."""
    if switch not in SWITCHES:
        raise KeyError(f"unknown kernel path switch {switch!r}")
    return dict(paths).get(switch, "auto")


__all__ = ["SWITCHES", "forced", "normalize_paths"]
