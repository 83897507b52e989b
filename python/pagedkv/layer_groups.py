"""Per-layer attention kinds in one cache (config schema 7): ``LayerGroup``.

Gemma 2/3, gpt-oss, Cohere2 and Olmo3 alternate sliding-window and full-attention layers. A config lists its
layers in groups, each with its own window; one block tree serves every group (fork, popn and remove apply to
all), and a sliding group keeps window-sized memory: pages wholly behind the window of every sequence that reads
them go back to its own page pool (``docs/ARCHITECTURE.md``, "Layer groups").

>>> from pagedkv.config import KVCacheConfig
>>> from pagedkv.layer_groups import layer_groups_from_windows
>>> cfg = KVCacheConfig(num_layers=4, num_qo_heads=8, num_kv_heads=2, head_dim=64,
...                     layer_groups=layer_groups_from_windows([128, 0, 128, 0]))
>>> [g.name for g in cfg.layer_groups], cfg.layer_window(2)
(['sliding128', 'full'], 128)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class LayerGroup:
    """Layers of a cache that attend alike (schema 7).

    Parameters
    ----------
    layers :
        The cache's layers in this group (every layer of the cache is in exactly one group).
    sliding_window :
        0: full attention. Else a query at position ``p`` attends to keys ``p - sliding_window + 1 .. p`` (HF's
        definition), and the group keeps at most ``ceil(sliding_window / page_size) + 1`` pages per sequence
        besides the tokens of the forward in flight.
    name :
        Named by errors (a fork or popn that needs tokens the group released); ``""``: ``"full"`` or
        ``"sliding<W>"``.
    """

    layers: tuple[int, ...]
    sliding_window: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.layers, (list, range)):
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.name == "" and isinstance(self.sliding_window, int):
            object.__setattr__(self, "name", f"sliding{self.sliding_window}" if self.sliding_window else "full")

    def problems(self) -> list[str]:
        """Every reason this group is invalid on its own (the config checks the cover)."""
        out = []
        w = self.sliding_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            out.append(f"layer group {self.name!r}: sliding_window must be an int >= 0 (0: full attention), got {w!r}")
        if not isinstance(self.layers, tuple) or not self.layers or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in self.layers):
            out.append(f"layer group {self.name!r}: layers must be a non-empty tuple of ints, got {self.layers!r}")
        if not isinstance(self.name, str) or not self.name:
            out.append(f"layer group name must be a non-empty string, got {self.name!r}")
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "layers": list(self.layers), "sliding_window": self.sliding_window}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LayerGroup":
        """The group ``to_dict`` wrote; unknown keys are errors (a misspelled field never passes as its default)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"a layer group must be an object (LayerGroup fields), got {data!r}")
        unknown = sorted(set(data) - {"name", "layers", "sliding_window"})
        if unknown:
            raise ValueError(f"unknown LayerGroup keys {unknown}; known: ['layers', 'name', 'sliding_window']")
        layers = data.get("layers")
        if not isinstance(layers, (list, tuple)):
            raise TypeError(f"LayerGroup layers must be a list of ints, got {layers!r}")
        return cls(layers=tuple(layers), sliding_window=data.get("sliding_window", 0), name=data.get("name", ""))


def layer_groups_from_windows(windows: Sequence[int], *, names: Mapping[int, str] | None = None
                              ) -> tuple[LayerGroup, ...]:
    """The groups of a per-layer window list (0: full attention), one per distinct window in order of first use.

    Parameters
    ----------
    windows :
        ``windows[i]`` is layer ``i``'s sliding window, e.g. from a transformers config's ``layer_types``
        (``"sliding_attention"`` -> its ``sliding_window``, ``"full_attention"`` -> 0).
    names :
        Window -> group name (default ``"full"`` / ``"sliding<W>"``).
    """
    order: dict[int, list[int]] = {}
    for layer, w in enumerate(windows):
        order.setdefault(w, []).append(layer)
    names = dict(names or {})
    return tuple(LayerGroup(layers=tuple(layers), sliding_window=w, name=names.get(w, ""))
                 for w, layers in order.items())


def cover_problems(groups: Any, num_layers: int) -> list[str]:
    """Why ``groups`` is not a valid ``layer_groups`` for ``num_layers`` layers (each layer exactly once, names
    unique)."""
    if not isinstance(groups, tuple) or not groups or not all(isinstance(g, LayerGroup) for g in groups):
        return [f"layer_groups must be a non-empty tuple of pagedkv.layer_groups.LayerGroup, got {groups!r}"]
    out = [p for g in groups for p in g.problems()]
    if out:
        return out
    names = [g.name for g in groups]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        out.append(f"layer group names {twice} are given twice")
    seen: dict[int, str] = {}
    for g in groups:
        for layer in g.layers:
            if not 0 <= layer < num_layers:
                out.append(f"layer group {g.name!r} names layer {layer}, outside [0, {num_layers})")
            elif layer in seen:
                out.append(f"layer {layer} is in two layer groups ({seen[layer]!r} and {g.name!r})")
            else:
                seen[layer] = g.name
    missing = [i for i in range(num_layers) if i not in seen] if isinstance(num_layers, int) else []
    if missing:
        out.append(f"layers {missing} are in no layer group (each layer must be in exactly one)")
    return out


def as_groups(groups: Any) -> Any:
    """``KVCacheConfig.layer_groups`` as the config keeps it: a list as a tuple, mappings as ``LayerGroup``s
    (``LayerGroup.from_dict``); anything else as given, for ``cover_problems`` to name."""
    if isinstance(groups, list):
        groups = tuple(groups)
    if isinstance(groups, tuple) and any(isinstance(g, Mapping) for g in groups):
        groups = tuple(LayerGroup.from_dict(g) if isinstance(g, Mapping) else g for g in groups)
    return groups


def group_problems(config) -> list[str]:
    """Every reason the ``layer_groups`` of ``config`` (a ``KVCacheConfig``) are invalid: the cover, and the options
    they do not combine with."""
    if config.layer_groups is None:
        return []
    out = cover_problems(config.layer_groups, config.num_layers)
    # The groups say every layer's window; the CUDA-graph layout is planned for one window (src/forward_plan.h):
    # not implemented per group yet, refused rather than applied to some.
    refused = [(config.sliding_window, "the top-level sliding_window (each group's sliding_window says it)"),
               (config.cuda_graph_batch, "cuda_graph_batch (not implemented with layer groups yet)"),
               (config.is_mla, "MLA layers (they take no window)")]
    out += [f"layer_groups with {what}" for value, what in refused if value]
    return out


__all__ = ["LayerGroup", "as_groups", "cover_problems", "group_problems", "layer_groups_from_windows"]
