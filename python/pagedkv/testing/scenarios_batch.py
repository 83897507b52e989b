"""Scenarios with many sequences in a batch, for the shapes of ``shapes.BATCH_SHAPES`` (``batch >= 24``).

The main scenarios (``scenarios.SCENARIOS``) batch at most 8 sequences. Batches of 20 sequences with
long and short ones mixed, decoded long-first and short-first, give the CPU kernels more work items than
their parallel chunks (so a chunk runs several items on reused scratch) and put entries whose sliding
window starts past the first key tile at the front of the batch and behind short ones.
"""

from __future__ import annotations

from typing import Callable

from .scenarios import Step, add, check, forward

__all__ = ["BATCH_SCENARIOS", "many_sequences"]

#: Sequences of the batch scenarios (the shapes' max_batch_size is larger).
NUM_SEQS = 20


def _prefill_lengths(P: int) -> list[int]:
    """Prompt lengths of sequences 0..19: long (several pages) and short (1-7 tokens) interleaved, the
    longest first and a one-token sequence last."""
    return [4 * P + 3, 1, 2 * P, 3, P + 1, 2, 3 * P - 1, 2, P // 2, 5,
            2 * P + 5, 1, P, 4, 7, 3 * P + 2, 1, 2, P + 3, 1]


def many_sequences(P: int) -> list[Step]:
    """Prefill 20 sequences in two forwards (ids ascending, then descending), decode all of them long-first
    and short-first across page boundaries, prefill a few tokens to each (through forwards on a windowed
    cache, ragged + paged passes otherwise), decode again."""
    lens = _prefill_lengths(P)
    ids = list(range(NUM_SEQS))
    half = NUM_SEQS // 2
    return [
        *[add(s) for s in ids],
        forward({s: lens[s] for s in ids[:half]}),
        forward({s: lens[s] for s in reversed(ids[half:])}),
        check(),
        *[forward({s: 1 for s in ids}) for _ in range(2)],             # longest first
        *[forward({s: 1 for s in reversed(ids)}) for _ in range(2)],   # shortest first
        forward({s: 1 + s % 3 for s in reversed(ids)}),
        forward({s: 1 for s in sorted(ids, key=lambda s: lens[s])}),  # by prompt length, short to long
        check(),
    ]


#: Every batch scenario, by name (the name is the test id).
BATCH_SCENARIOS: dict[str, Callable[[int], list[Step]]] = {
    "many_sequences": many_sequences,
}
