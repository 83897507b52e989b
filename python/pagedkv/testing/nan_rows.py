"""NaN propagation checks (issue 44): a NaN in what a query attends to makes its output row NaN, and nothing else.

The semantics every backend is tested against (``docs/ARCHITECTURE.md``, "Kernel ABI"): a NaN in a query's q row or
in the k of a key it sees makes its whole o row and its lse NaN (so that every later merge of its state is NaN too);
a NaN in the v of a key it sees makes its o row NaN at least where v is; a key it does not see (outside the causal
mask or the sliding window, past its sequence, an unused page slot) never changes it; a row without keys is still o
= 0, lse = ``EMPTY_LSE``. The float64 reference (``pagedkv.testing.reference``) gives exactly the NaN rows of a NaN q
row or k (its masks replace the scores of keys a row does not see), so the expected rows are the reference's NaN
rows; a NaN v the reference spreads to every row of its entry (``0 * NaN`` in ``p @ v``), so a v case takes its rows
from a k case at the same key (``attending``).
"""

from __future__ import annotations

import torch


class NaNLost(AssertionError):
    """A row that sees a NaN input is not NaN (the bug of issue 44)."""


class NaNLeak(AssertionError):
    """A row that sees no NaN input holds NaN."""


def check(o: torch.Tensor, lse: torch.Tensor | None, ref_o: torch.Tensor, what: str, *, expect=None,
          whole: bool = True) -> torch.Tensor:
    """Assert the NaN rows of ``o[..., Dv]`` / ``lse[...]`` (``None``: an output without lse): the rows ``expect``
    (default: where ``ref_o`` has a NaN) are NaN, their whole o row and lse when ``whole``, else somewhere in o;
    no other row holds a NaN. Returns the mask of the other rows, which the caller compares with the reference."""
    expect = torch.isnan(ref_o.detach().cpu()).any(-1) if expect is None else expect
    o_nan = torch.isnan(o.detach().cpu().double())
    lse_nan = expect.clone() if lse is None else torch.isnan(lse.detach().cpu().double())
    if whole:
        bad = (~o_nan.all(-1) | ~lse_nan) & expect
        if bad.any():
            raise NaNLost(f"{what}: {int(bad.sum())} of the {int(expect.sum())} rows that see a NaN input are not NaN "
                          f"(o row{'' if lse is None else ' and lse'}), e.g. row {_first(bad)}")
    else:
        bad = ~o_nan.any(-1) & expect
        if bad.any():
            raise NaNLost(f"{what}: {int(bad.sum())} of the {int(expect.sum())} rows that see a NaN value have no NaN "
                          f"in o, e.g. row {_first(bad)}")
    leak = (o_nan.any(-1) | lse_nan) & ~expect
    if leak.any():
        raise NaNLeak(f"{what}: {int(leak.sum())} of the {int((~expect).sum())} rows that see no NaN input hold NaN, "
                      f"e.g. row {_first(leak)}")
    return ~expect


def attending(ref_with_nan_k: torch.Tensor) -> torch.Tensor:
    """The rows that see a key: the NaN rows of the reference output with a NaN in that key's k (``[..., Dv]`` ->
    ``[...]``)."""
    return torch.isnan(ref_with_nan_k).any(-1)


def _first(mask: torch.Tensor) -> list[int]:
    return mask.nonzero()[0].tolist()


__all__ = ["NaNLeak", "NaNLost", "attending", "check"]
