"""The functional pieces of the PyTorch reference (float64): RoPE, softmax attention of one entry (causal,
sliding window, logits soft-cap), merging two states, splitting fused qkv. See ``reference.py`` for the
conventions; :class:`pagedkv.testing.reference.ReferenceCache` builds on these."""

from __future__ import annotations

import math
from typing import Sequence

import torch

#: The finite "no keys" LSE every kernel writes (``docs/ARCHITECTURE.md``: LSE is base 2).
EMPTY_LSE = -1e30

_LN2 = math.log(2.0)


class ReferenceCacheError(ValueError):
    """A call the documented semantics reject (the reference's counterpart of a runtime error)."""


def rope(x: torch.Tensor, positions: torch.Tensor | Sequence[int], theta: float, scale: float) -> torch.Tensor:
    """Rotary embedding, Llama / GPT-NeoX "rotate half" layout over the whole head dim.

    For position ``p`` and ``i < D/2``: ``angle = p * scale / theta ** (2 i / D)``,
    ``x'[i] = x[i] cos - x[i + D/2] sin`` and ``x'[i + D/2] = x[i + D/2] cos + x[i] sin``.

    Parameters
    ----------
    x : Tensor ``[n, H, D]``
        Vectors to rotate (any float dtype; computed and returned in float64).
    positions : Tensor or sequence of int, ``[n]``
        Position of each of the ``n`` tokens.
    theta, scale : float
        RoPE base and position multiplier.

    Returns
    -------
    Tensor ``[n, H, D]``, float64.
    """
    x = x.to(torch.float64)
    n, _, d = x.shape
    if d % 2:
        raise ValueError(f"rope needs an even head dim, got {d}")
    pos = torch.as_tensor(positions, dtype=torch.float64, device=x.device).reshape(n)
    half = d // 2
    i = torch.arange(half, dtype=torch.float64, device=x.device)
    inv_freq = 1.0 / (float(theta) ** (2.0 * i / d))
    angle = pos[:, None] * float(scale) * inv_freq[None, :]  # [n, D/2]
    cos = torch.cos(angle)[:, None, :]
    sin = torch.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
              causal: bool, *, sliding_window: int = 0, logits_soft_cap: float = 0.0,
              sinks: torch.Tensor | None = None, sink_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one entry with grouped-query heads and a base-2 LSE.

    Parameters
    ----------
    q : Tensor ``[n, Hq, D]``
    k : Tensor ``[m, Hkv, D]``
    v : Tensor ``[m, Hkv, Dv]``
        ``Hq`` must be a multiple of ``Hkv``; query head ``h`` uses kv head ``h // (Hq // Hkv)``.
    sm_scale : float
        Scores are ``(q . k) * sm_scale``.
    causal : bool
        Bottom-right aligned: query ``i`` sits at key position ``m - n + i`` and sees keys ``j <= m - n + i``.
    sliding_window : int
        0: off. Else query ``i`` sees only keys ``j > m - n + i - sliding_window`` (the ``sliding_window``
        most recent positions up to its own, HF's and Mistral's definition).
    logits_soft_cap : float
        0: off. Else scores become ``logits_soft_cap * tanh(s / logits_soft_cap)`` (Gemma-2's definition).
    sink_size : int
        StreamingLLM sink tokens (with ``sliding_window``): keys ``j < sink_size`` stay visible beside the window
        (the causal limit still holds).
    sinks : Tensor ``[Hq]``, optional
        Learnable attention sinks (gpt-oss): one more logit per query head, ``sinks[h]`` (natural log, not scaled
        or capped), in every row's softmax, whose value is 0.

    Returns
    -------
    o : Tensor ``[n, Hq, Dv]``, float64
        Rows that see no key are 0.
    lse : Tensor ``[n, Hq]``, float64
        ``log2(sum_j exp(s_j))`` (with ``exp(sinks[h])`` in the sum); ``EMPTY_LSE`` for rows that see no key and
        no sink.
    """
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    n, hq, _ = q.shape
    m, hkv, _ = k.shape
    dv = v.shape[2]
    if hq % hkv:
        raise ValueError(f"Hq ({hq}) is not a multiple of Hkv ({hkv})")
    group = hq // hkv
    if n == 0:
        return q.new_zeros((0, hq, dv)), q.new_zeros((0, hq))
    kh = k.repeat_interleave(group, dim=1)  # [m, Hq, D]
    vh = v.repeat_interleave(group, dim=1)  # [m, Hq, Dv]
    s = torch.einsum("nhd,mhd->hnm", q, kh) * float(sm_scale)  # [Hq, n, m]
    if logits_soft_cap:
        s = float(logits_soft_cap) * torch.tanh(s / float(logits_soft_cap))
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(m, device=q.device)[None, :]
    visible = torch.ones((n, m), dtype=torch.bool, device=q.device)
    if causal:
        visible &= j <= (m - n + i)
    if sliding_window:
        visible &= (j > (m - n + i) - int(sliding_window)) | (j < int(sink_size))
    s = s.masked_fill(~visible[None], -math.inf)
    any_key = visible.any(dim=1)  # [n]
    if sinks is not None:  # the sink is a key every row sees, with value 0: one more column of s, none of v
        s = torch.cat([s, sinks.to(torch.float64).reshape(hq, 1, 1).expand(hq, n, 1)], dim=-1)
        vh = torch.cat([vh, vh.new_zeros((1, hq, dv))])
        any_key = torch.ones_like(any_key)
    lse_e = torch.logsumexp(s, dim=-1)  # [Hq, n], -inf where no key
    p = torch.exp(s - torch.where(any_key[None], lse_e, torch.zeros_like(lse_e))[..., None])
    p = torch.where(any_key[None, :, None], p, torch.zeros_like(p))
    o = torch.einsum("hnm,mhd->nhd", p, vh)
    lse = (lse_e / _LN2).transpose(0, 1)
    lse = torch.where(any_key[:, None], lse, torch.full_like(lse, EMPTY_LSE))
    return o, lse


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets (base-2 LSE).

    Parameters
    ----------
    o_a, o_b : Tensor ``[n, H, Dv]``
    lse_a, lse_b : Tensor ``[n, H]``
        ``EMPTY_LSE`` (or anything ``<= EMPTY_LSE / 2``) marks an empty state.

    Returns
    -------
    o : Tensor ``[n, H, Dv]``, float64
    lse : Tensor ``[n, H]``, float64
        Equal to the attention over the union of both key sets.
    """
    o_a, lse_a, o_b, lse_b = (t.to(torch.float64) for t in (o_a, lse_a, o_b, lse_b))
    empty_a = lse_a <= EMPTY_LSE / 2
    empty_b = lse_b <= EMPTY_LSE / 2
    mx = torch.maximum(lse_a, lse_b)
    wa = torch.where(empty_a, torch.zeros_like(lse_a), torch.exp2(lse_a - mx))
    wb = torch.where(empty_b, torch.zeros_like(lse_b), torch.exp2(lse_b - mx))
    total = wa + wb
    both_empty = empty_a & empty_b
    safe = torch.where(both_empty, torch.ones_like(total), total)
    o = (wa[..., None] * o_a + wb[..., None] * o_b) / safe[..., None]
    lse = torch.where(both_empty, torch.full_like(mx, EMPTY_LSE), mx + torch.log2(safe))
    return o, lse


def apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A state ``(o[n, H, Dv], lse[n, H])`` with attention sinks ``[H]`` added: merged with the state of a key
    whose logit is ``sinks[h]`` (natural log) and whose value is 0, i.e. ``(0, sinks[h] / ln 2)`` (float64)."""
    sink_lse = (sinks.to(torch.float64) / _LN2).reshape(1, -1).expand(lse.shape)
    return merge_states(o, lse, torch.zeros_like(o, dtype=torch.float64), sink_lse)


def split_qkv(qkv: torch.Tensor, num_qo_heads: int, num_kv_heads: int):
    """Split fused ``qkv[n, Hq + 2 Hkv, D]`` into ``q[n, Hq, D]``, ``k[n, Hkv, D]``, ``v[n, Hkv, D]``."""
    if qkv.dim() != 3 or qkv.shape[1] != num_qo_heads + 2 * num_kv_heads:
        raise ReferenceCacheError(f"qkv must be [n, {num_qo_heads + 2 * num_kv_heads}, D], got {list(qkv.shape)}")
    q = qkv[:, :num_qo_heads]
    k = qkv[:, num_qo_heads:num_qo_heads + num_kv_heads]
    v = qkv[:, num_qo_heads + num_kv_heads:]
    return q, k, v
