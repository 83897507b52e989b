"""A pagedkv cache driven through TVM's KV-state protocol only (the ``vm.builtin.*`` globals), as engines written for
TVM's own cache drive it: shared by the CPU and GPU conformance tests (``tests/cpu/test_tvm_protocol.py``,
``tests/gpu/test_tvm_protocol_gpu.py``).

- :class:`Builtins`: the protocol's globals, looked up by TVM's names.
- :class:`ConformanceDriver`: the scenario logic of apache-tvm 0.27's CPU paged-KV-cache test
  (``tests/python/relax/test_runtime_builtin_paged_attention_kv_cache_cpu.py``), written anew from what it checks:
  each step forks or adds sequences, runs one forward of random q / k / v through
  ``attention_kv_cache_attention_with_fused_qkv`` on every layer and compares the outputs with a PyTorch
  reference (float32, RoPE angles in float64), then compares every sequence's cached K / V (``debug_get_kv``) with the reference's.
  ``TVM_SCENARIOS`` are that test's scenarios; ``UNSUPPORTED_SCENARIOS`` are those pagedkv refuses, with why.
- :class:`ProtocolEngine`: greedy generation with a compiled model library, the cache created by the library's
  five-argument ``create_paged_kv_cache`` (MLC-LLM's call) and managed through ``vm.builtin.*`` alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..cache import KVCache
from ..config import KVCacheConfig

# ---------------------------------------------------------------------------------------------------------
# The protocol's globals
# ---------------------------------------------------------------------------------------------------------

#: field of :class:`Builtins` -> the ``vm.builtin`` global (apache-tvm 0.27, src/runtime/vm/kv_state.cc)
GLOBAL_NAMES = {
    "clear": "kv_state_clear",
    "add_sequence": "kv_state_add_sequence",
    "remove_sequence": "kv_state_remove_sequence",
    "fork_sequence": "kv_state_fork_sequence",
    "popn": "kv_state_popn",
    "begin_forward": "kv_state_begin_forward",
    "end_forward": "kv_state_end_forward",
    "enable_sliding_window_for_seq": "attention_kv_cache_enable_sliding_window_for_seq",
    "commit_accepted_token_tree_nodes": "attention_kv_cache_commit_accepted_token_tree_nodes",
    "empty": "attention_kv_cache_empty",
    "get_num_available_pages": "attention_kv_cache_get_num_available_pages",
    "get_total_sequence_length": "attention_kv_cache_get_total_sequence_length",
    "get_sequence_length": "attention_kv_cache_get_sequence_length",
    "get_query_positions": "attention_kv_cache_get_query_positions",
    "attention_with_fused_qkv": "attention_kv_cache_attention_with_fused_qkv",
    "self_attention": "attention_kv_cache_self_attention",
    "cross_attention": "attention_kv_cache_cross_attention",
    "merge_attn_output_inplace": "attention_kv_cache_merge_attn_output_inplace",
    "append_mla_kv": "attention_kv_cache_append_mla_kv",
    "debug_get_kv": "attention_kv_cache_debug_get_kv",
    "debug_get_kv_mla": "attention_kv_cache_debug_get_kv_mla",
    "get_checkpoint_metadata": "attention_kv_cache_get_checkpoint_metadata",
    "get_layout_hash": "attention_kv_cache_get_layout_hash",
    "export_page_group": "attention_kv_cache_export_page_group",
    "prepare_import": "attention_kv_cache_prepare_import",
    "import_page_group": "attention_kv_cache_import_page_group",
    "finish_import": "attention_kv_cache_finish_import",
    "attention_with_shared_kv": "attention_kv_cache_attention_with_shared_kv",
    "disagg_prepare_recv": "kv_cache_disagg_prepare_recv",
    "disagg_mark_send": "kv_cache_disagg_mark_send",
}


@dataclass(frozen=True)
class Builtins:
    """TVM's protocol globals (``vm.builtin.<GLOBAL_NAMES[field]>``), each taking the cache first."""

    clear: Callable
    add_sequence: Callable
    remove_sequence: Callable
    fork_sequence: Callable
    popn: Callable
    begin_forward: Callable
    end_forward: Callable
    enable_sliding_window_for_seq: Callable
    commit_accepted_token_tree_nodes: Callable
    empty: Callable
    get_num_available_pages: Callable
    get_total_sequence_length: Callable
    get_sequence_length: Callable
    get_query_positions: Callable
    attention_with_fused_qkv: Callable
    self_attention: Callable
    cross_attention: Callable
    merge_attn_output_inplace: Callable
    append_mla_kv: Callable
    debug_get_kv: Callable
    debug_get_kv_mla: Callable
    get_checkpoint_metadata: Callable
    get_layout_hash: Callable
    export_page_group: Callable
    prepare_import: Callable
    import_page_group: Callable
    finish_import: Callable
    attention_with_shared_kv: Callable
    disagg_prepare_recv: Callable
    disagg_mark_send: Callable

    @classmethod
    def load(cls) -> "Builtins":
        """Look the globals up (TVM's runtime registers them: loaded here as a runtime-only process loads it)."""
        import tvm_ffi

        from ..runtime import load_tvm_runtime

        load_tvm_runtime()
        return cls(**{f.name: tvm_ffi.get_global_func(f"vm.builtin.{GLOBAL_NAMES[f.name]}") for f in fields(cls)})


def shape(values: Sequence[int]):
    """A ``tvm_ffi.Shape`` (the protocol's seq_ids / append_lengths / token trees)."""
    import tvm_ffi

    return tvm_ffi.Shape(tuple(int(v) for v in values))


def _ffi(t: torch.Tensor):
    import tvm_ffi

    return tvm_ffi.from_dlpack(t)


#: ``pagedkv.<name>`` global -> the ``vm.builtin`` global that takes the same arguments in the same order (TVM's
#: wrappers reorder them into the protocol's methods); the other ``pagedkv.*`` globals have no protocol counterpart.
SAME_ARGUMENTS = {name: GLOBAL_NAMES[name] for name in (
    "add_sequence", "remove_sequence", "fork_sequence", "popn", "clear", "begin_forward", "end_forward",
    "get_sequence_length", "get_num_available_pages", "get_total_sequence_length", "get_query_positions",
    "attention_with_fused_qkv", "self_attention", "cross_attention", "merge_attn_output_inplace", "append_mla_kv",
    "debug_get_kv",
)}
SAME_ARGUMENTS["debug_get_mla_kv"] = GLOBAL_NAMES["debug_get_kv_mla"]  # pagedkv names it the other way round


class ProtocolKVCache(KVCache):
    """A ``pagedkv.cache.KVCache`` whose calls with a protocol counterpart (``SAME_ARGUMENTS``) go through TVM's
    ``vm.builtin`` globals instead of ``pagedkv.*``: pagedkv's scenario runner and misuse machine then test the
    protocol surface unchanged (abort_forward, check_append and the debug setters stay pagedkv's)."""

    def _call(self, name: str, *args):
        import tvm_ffi

        if name in SAME_ARGUMENTS:
            return tvm_ffi.get_global_func(f"vm.builtin.{SAME_ARGUMENTS[name]}")(self.handle, *args)
        return super()._call(name, *args)


def protocol_view(cache: KVCache) -> ProtocolKVCache:
    """``cache`` (the same runtime object) seen through :class:`ProtocolKVCache`."""
    return ProtocolKVCache(cache.handle, cache.config, cache.device, cache.resolution,
                           keepalive=cache._keepalive)  # pylint: disable=protected-access


def refused_calls(f: Builtins, h, seq: int, tensor) -> dict[str, Callable[[], Any]]:
    """Calls pagedkv refuses (outside a forward), by what their message names after "not supported by pagedkv: ".

    Parameters
    ----------
    f :
        The protocol's globals.
    h :
        The cache.
    seq :
        A sequence of it.
    tensor :
        Any tensor (the refused calls never read it).
    """
    return {
        "KV checkpoint export / import (GetCheckpointMetadata)": lambda: f.get_checkpoint_metadata(h, seq),
        "KV checkpoint export / import (GetLayoutHash)": lambda: f.get_layout_hash(h),
        "KV checkpoint export / import (ExportPageGroup)": lambda: f.export_page_group(h, seq, 0, tensor),
        "KV checkpoint export / import (PrepareImport)": lambda: f.prepare_import(h, seq, "{}"),
        "KV checkpoint export / import (ImportPageGroup)": lambda: f.import_page_group(h, seq, 0, tensor),
        "KV checkpoint export / import (FinishImport)": lambda: f.finish_import(h, seq),
        "disaggregated prefill / decode": lambda: f.disagg_prepare_recv(h, seq, 4),
        "disaggregated prefill / decode (KV transfer between engines) (DisaggMarkSend)":
            lambda: f.disagg_mark_send(h, seq, 0, shape([0]), 0),
        "attention with K/V shared across layers": lambda: f.attention_with_shared_kv(h, 0, 0.1, *[tensor] * 4),
        "per-sequence sliding windows": lambda: f.enable_sliding_window_for_seq(h, seq, 8, 0),
        "tree attention: the token tree of sequence": lambda: f.begin_forward(h, shape([seq]), shape([3]),
                                                                              shape([-1, 0, 0])),
    }


# ---------------------------------------------------------------------------------------------------------
# The conformance driver
# ---------------------------------------------------------------------------------------------------------

#: TVM's test's tolerance on attention outputs and cached K / V (``rtol = atol = 1e-3``), in every dtype.
TOL = 1e-3

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, scale: float) -> torch.Tensor:
    """Rotate-half RoPE of ``x[n, H, D]`` at ``positions[n]``, angle ``p * scale / theta ** (2 i / D)`` (TVM's
    test's ``f_apply_rotary``), in float64."""
    d = x.shape[-1]
    inv_freq = scale / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angle).repeat(1, 2)[:, None, :], torch.sin(angle).repeat(1, 2)[:, None, :]
    x = x.to(torch.float64)
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * cos + rotated * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """``softmax(q k^T * sm_scale) v`` of ``q[n, Hq, D]`` over ``k, v[m, Hkv, D]`` (query head h reads kv head
    ``h // (Hq / Hkv)``), bottom-right causal: query i sees keys ``j <= m - n + i``; ``[n, Hq, D]`` in q's dtype
    (float32 here: its error is a thousandth of the tolerance)."""
    n, m, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q, k) * sm_scale
    visible = torch.arange(m)[None, :] <= (m - n + torch.arange(n))[:, None]
    s = s.masked_fill(~visible[None], -math.inf)
    return torch.einsum("hnm,mhd->nhd", torch.softmax(s, dim=-1), v)


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``|got - want| <= TOL + TOL * |want|`` elementwise (TVM's test's ``assert_allclose``), in float32: the
    whole-cache comparisons after every step are most of a scenario's time, and torch.testing's is several
    times slower."""
    got, want = got.to(torch.float32), want.to(torch.float32)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    err = (got - want).abs() - TOL * want.abs()
    worst = int(torch.argmax(torch.nan_to_num(err, nan=math.inf)))
    if not bool(err.flatten()[worst] <= TOL):
        index = tuple(int(i) for i in np.unravel_index(worst, tuple(got.shape)))
        raise AssertionError(f"{what}: at {index} got {float(got[index])}, expected {float(want[index])} "
                             f"(tolerance {TOL} + {TOL} x |expected|)")


def _chain_length(parents: Sequence[int]) -> int:
    """Nodes of a token tree that is a chain (each node's parent the node before it); ValueError otherwise
    (the driver's reference covers chains, the token trees pagedkv takes)."""
    if any(p != i - 1 for i, p in enumerate(parents)):
        raise ValueError(f"the conformance driver's reference covers chains only, got the tree {list(parents)}")
    return len(parents)


class ConformanceDriver:
    """TVM's ``apply_attention`` scenario driver over a pagedkv cache, through ``vm.builtin.*`` only.

    Parameters
    ----------
    handle :
        The runtime cache (``pagedkv.create(...).handle``).
    config :
        Its config (heads, dims, dtype, RoPE mode and constants).
    gen :
        Random q / k / v (uniform in [0, 1), as TVM's test draws them).
    device :
        Where the tensors of the calls live (``"cpu"`` or ``"cuda"``).
    """

    def __init__(self, handle, config: KVCacheConfig, gen: torch.Generator, *, device: str = "cpu") -> None:
        self.f = Builtins.load()
        self.handle, self.cfg, self.gen, self.device = handle, config, gen, torch.device(device)
        self.dtype = _TORCH_DTYPES[config.dtype]
        self.sm_scale = config.head_dim ** -0.5
        #: per sequence, ``[num_layers, len, Hkv, D]`` float32 holding values of the cache's dtype: K as the
        #: cache stores it (rotated in "normal")
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        #: per sequence with an uncommitted token chain: its nodes so far
        self.chains: dict[int, int] = {}
        #: per sequence, the K / V debug_get_kv returned when they last matched the reference, while the
        #: reference has not changed since: an exact copy of them still matches (TVM's teardown checks every
        #: remaining sequence after each removal; comparing bytes is a fraction of comparing numbers)
        self._verified: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- sequences --------------------------------------------------------------------------------------
    def _empty_kv(self) -> torch.Tensor:
        c = self.cfg
        return torch.zeros((c.num_layers, 0, c.num_kv_heads, c.head_dim), dtype=torch.float32)

    def clear(self) -> None:
        self.f.clear(self.handle)
        self.k, self.v, self.chains, self._verified = {}, {}, {}, {}

    def remove(self, seq_id: int) -> None:
        self.f.remove_sequence(self.handle, seq_id)
        del self.k[seq_id], self.v[seq_id]
        self.chains.pop(seq_id, None)
        self._verified.pop(seq_id, None)

    def popn(self, seq_id: int, n: int) -> None:
        self.f.popn(self.handle, seq_id, n)
        self._truncate(seq_id, self.k[seq_id].shape[1] - n)

    def _truncate(self, seq_id: int, keep: int) -> None:
        self.k[seq_id], self.v[seq_id] = self.k[seq_id][:, :keep], self.v[seq_id][:, :keep]
        self._verified.pop(seq_id, None)

    def fork(self, parent: int, child: int, pos: int) -> None:
        self.f.fork_sequence(self.handle, parent, child, pos)
        end = self.k[parent].shape[1] if pos == -1 else pos
        self.k[child], self.v[child] = self.k[parent][:, :end], self.v[parent][:, :end]
        self._verified.pop(child, None)

    def _open(self, batch) -> tuple[list[int], list[int]]:
        """Forks (``((child, parent, pos), n)``) and adds (an unknown id) of a batch; its ids and lengths."""
        ids, lengths = [], []
        for seq, n in batch:
            if isinstance(seq, tuple):
                child, parent, pos = seq
                assert child not in self.k and parent in self.k, seq
                self.fork(parent, child, pos)
                seq = child
            elif seq not in self.k:
                self.f.add_sequence(self.handle, seq)
                self.k[seq], self.v[seq] = self._empty_kv(), self._empty_kv()
            ids.append(seq)
            lengths.append(n)
        return ids, lengths

    # -- one forward ------------------------------------------------------------------------------------
    def apply(self, batch, *, token_trees: Sequence[Sequence[int]] | None = None,
              accepted_leaves: Sequence[int] | None = None) -> None:
        """One step of TVM's ``apply_attention``: ``batch`` lists ``(seq_id, append_length)``, a
        ``((child, parent, fork_pos), append_length)`` forking first; ``token_trees`` gives each sequence's whole
        uncommitted tree (parent pointers; its last ``append_length`` nodes are this forward's), ``accepted_leaves``
        the leaves committed after the forward. Checks every layer's output and every sequence's cached K / V."""
        ids, lengths = self._open(batch)
        tree = None
        if token_trees is not None:
            for seq, parents, n in zip(ids, token_trees, lengths):
                assert _chain_length(parents) == self.chains.get(seq, 0) + n, (seq, parents)
            tree = shape([p for parents, n in zip(token_trees, lengths) for p in parents[-n:]])
        self.f.begin_forward(self.handle, shape(ids), shape(lengths), tree)
        priors = [self.k[s].shape[1] for s in ids]
        c = self.cfg
        heads = c.num_qo_heads + 2 * c.num_kv_heads
        new = [torch.rand((c.num_layers, n, heads, c.head_dim), generator=self.gen).to(self.dtype) for n in lengths]
        for seq, prior, qkv in zip(ids, priors, new):
            k, v = qkv[:, :, c.num_qo_heads:c.num_qo_heads + c.num_kv_heads], qkv[:, :, c.num_qo_heads + c.num_kv_heads:]
            if c.rope_mode == "normal":  # stored rotated: rotated in float32 as the kernels do, then rounded
                pos = torch.arange(prior, prior + k.shape[1])
                k = torch.stack([rope(k[l].float(), pos, c.rope_theta, c.rope_scale).to(self.dtype)
                                 for l in range(c.num_layers)])
            self.k[seq] = torch.cat([self.k[seq], k.to(torch.float32)], dim=1)
            self.v[seq] = torch.cat([self.v[seq], v.to(torch.float32)], dim=1)
            self._verified.pop(seq, None)
        for layer in range(c.num_layers):
            self._check_layer(layer, ids, priors, [x[layer] for x in new])
        self.f.end_forward(self.handle)
        if token_trees is not None:
            for seq, n in zip(ids, lengths):
                self.chains[seq] = self.chains.get(seq, 0) + n
        if accepted_leaves is not None:
            self.commit(ids, accepted_leaves)
        self.verify(ids)

    def _check_layer(self, layer: int, ids, priors, qkvs) -> None:
        c = self.cfg
        qkv = torch.cat(qkvs).to(self.device)
        out = torch.empty((qkv.shape[0], c.num_qo_heads, c.head_dim), dtype=self.dtype, device=self.device)
        self.f.attention_with_fused_qkv(self.handle, layer, self.sm_scale, _ffi(qkv), _ffi(out))
        got, row = out.cpu(), 0
        for seq, prior, x in zip(ids, priors, qkvs):
            n = x.shape[0]
            q, k, v = (t.to(torch.float32) for t in (x[:, :c.num_qo_heads], self.k[seq][layer], self.v[seq][layer]))
            if c.rope_mode != "none":
                q = rope(q, torch.arange(prior, prior + n), c.rope_theta, c.rope_scale).float()
            if c.rope_mode == "inline":  # stored unrotated, rotated by the attention kernels
                k = rope(k, torch.arange(k.shape[0]), c.rope_theta, c.rope_scale).float()
            want = causal_attention(q, k, v, self.sm_scale).to(self.dtype)
            assert_near(got[row:row + n], want, f"attention output of layer {layer}, sequence {seq}")
            row += n

    def commit(self, ids: Sequence[int], leaves: Sequence[int]) -> None:
        """``commit_accepted_token_tree_nodes``: of each sequence's uncommitted chain, nodes ``[0, leaf]`` stay."""
        self.f.commit_accepted_token_tree_nodes(self.handle, shape(ids), shape(leaves))
        for seq, leaf in zip(ids, leaves):
            drop = self.chains.pop(seq) - (leaf + 1)
            self._truncate(seq, self.k[seq].shape[1] - drop)

    def verify(self, ids: Sequence[int] | None = None) -> None:
        """Each sequence's cached K / V (``debug_get_kv``) and length equal the reference's."""
        c = self.cfg
        for seq in self.k if ids is None else ids:
            want_k, want_v = self.k[seq], self.v[seq]
            assert self.f.get_sequence_length(self.handle, seq) == want_k.shape[1], seq
            k = torch.empty((c.num_layers, want_k.shape[1], c.num_kv_heads, c.head_dim), dtype=self.dtype,
                            device=self.device)
            v = torch.empty_like(k)
            self.f.debug_get_kv(self.handle, seq, 0, want_k.shape[1], _ffi(k), _ffi(v))
            k, v = k.cpu(), v.cpu()
            last = self._verified.get(seq)
            if last is not None and torch.equal(last[0], k) and torch.equal(last[1], v):
                continue
            assert_near(k, want_k, f"cached K of sequence {seq}")
            assert_near(v, want_v, f"cached V of sequence {seq}")
            self._verified[seq] = (k, v)

    def remove_all_checking(self, ids: Sequence[int]) -> None:
        """TVM's teardown: remove each sequence, checking the rest after each; the cache is empty after."""
        for seq in ids:
            self.remove(seq)
            self.verify()
        assert self.f.empty(self.handle), "the cache is not empty after removing every sequence"


# ---------------------------------------------------------------------------------------------------------
# TVM's scenarios (test_runtime_builtin_paged_attention_kv_cache_cpu.py, apache-tvm 0.27): the same operation
# sequences, lengths and fork positions.
# ---------------------------------------------------------------------------------------------------------


def prefill_and_decode(d: ConformanceDriver) -> None:
    ops = [[(0, 6)], [(1, 8)], [(2, 11)], [(3, 16)], [(4, 19), (5, 20)], [(6, 21), (7, 24)],
           [(2, 5), (4, 7), (8, 24)], [(6, 13)], [(8, 19)], [(0, 1)], [(1, 3), (3, 8), (5, 12), (7, 11)]]
    ops += [[(s, 1) for s in range(9)]] * 2 + [[(s, 1) for s in (0, 2, 4, 6, 8)], [(s, 1) for s in (4, 5, 6, 7, 8)]]
    for batch in ops:
        d.apply(batch)


def remove_sequence(d: ConformanceDriver) -> None:
    for seq in range(5):
        d.apply([(s, 1) for s in range(5)])
        d.remove(seq)
        d.verify()


def fork_sequence(d: ConformanceDriver) -> None:
    d.apply([(0, 60), (1, 88), (2, 17), (3, 4)])
    for batch in ([((4, 3, -1), 35)], [((5, 0, -1), 20)], [((6, 5, -1), 102)], [((7, 0, -1), 3)],
                  [((8, 5, -1), 71), ((9, 5, -1), 20)]):
        d.apply(batch)
    for batch in ([(2, 1), (4, 1), (7, 1), (6, 1), (8, 1), (9, 1)], [(7, 1), (6, 1), (8, 1), (9, 1)],
                  [(7, 1), (1, 1), (6, 1), (2, 1), (8, 1), (4, 1), (9, 1)], [(7, 10), (6, 2), (8, 3), (9, 4)]):
        d.apply(batch)
    for batch in ([((10, 1, 33), 11)], [((11, 0, 60), 45), ((12, 0, 15), 14)], [((13, 0, 16), 19), ((14, 0, 17), 19)],
                  [((15, 5, 60), 8), ((16, 5, 80), 10)], [((17, 5, 75), 11), ((18, 5, 76), 45), ((19, 5, 77), 14)]):
        d.apply(batch)
    for batch in ([(6, 1), (11, 1), (13, 1), (9, 1)], [(10, 1), (16, 1), (18, 1), (19, 1)],
                  [(8, 1), (15, 1), (17, 1), (12, 1), (14, 1)], [(10, 10), (6, 2), (8, 3), (19, 4)]):
        d.apply(batch)
    d.remove_all_checking(range(20))
    # forks after the pages were recycled
    for batch in ([(0, 7), (1, 24)], [((2, 1, -1), 10)], [((3, 0, -1), 20)], [(2, 1), (3, 1)], [(10, 7), (11, 24)],
                  [((12, 11, -1), 200)], [(10, 1), (12, 1)]):
        d.apply(batch)


def unlimited_depth(d: ConformanceDriver) -> None:
    d.apply([(0, 30)])
    for child, parent, n in ((1, 0, 15), (2, 1, 5), (3, 2, 20), (4, 3, 26), (5, 3, 18), (6, 5, 22), (7, 5, 12),
                             (8, 7, 29), (9, 7, 9), (10, 9, 31), (11, 9, 4)):
        d.apply([((child, parent, -1), n)])
    for batch in ([(3, 1), (6, 1), (9, 1)], [(4, 1), (8, 1), (10, 1)], [(5, 1), (7, 1), (11, 1)]):
        d.apply(batch)
    d.remove_all_checking(range(12))


def popn(d: ConformanceDriver) -> None:
    d.apply([(0, 35), (1, 88), (2, 17), (3, 4)])
    d.apply([((4, 3, -1), 35)])
    for seq, n in ((0, 17), (1, 57), (2, 16), (3, 0), (4, 37)):
        d.popn(seq, n)
        d.verify(range(4))
    d.remove_all_checking(range(5))


def token_chains(d: ConformanceDriver) -> None:
    """TVM's tree-attention test, its case whose token trees are all chains (speculative decoding with one
    draft per step): a chain forward, a commit keeping a prefix of each (none of sequence 2's), decode."""
    d.apply([(0, 10), (1, 20), (2, 30), (3, 40)])
    chains = [list(range(-1, n - 1)) for n in (7, 15, 10, 14)]
    d.apply([(0, 7), (1, 15), (2, 10), (3, 14)], token_trees=chains, accepted_leaves=[2, 6, -1, 4])
    for _ in range(5):
        d.apply([(0, 1), (1, 1), (2, 1), (3, 1)])
    # a chain grown over two forwards before its commit, as TVM's rounds of tree decode are
    d.apply([(0, 2), (1, 3)], token_trees=[[-1, 0], [-1, 0, 1]])
    d.apply([(0, 1), (1, 2)], token_trees=[[-1, 0, 1], [-1, 0, 1, 2, 3]], accepted_leaves=[0, 4])
    d.apply([(0, 1), (1, 1)])


#: name -> scenario; each starts from a cleared cache.
TVM_SCENARIOS = {
    "prefill_and_decode": prefill_and_decode,
    "remove_sequence": remove_sequence,
    "fork_sequence": fork_sequence,
    "unlimited_depth": unlimited_depth,
    "popn": popn,
    "token_chains": token_chains,
}

#: TVM's scenarios pagedkv refuses (NotImplementedError "not supported by pagedkv"), and why.
UNSUPPORTED_SCENARIOS = {
    "sliding_window": "per-sequence sliding windows with attention sinks that evict tokens "
                      "(EnableSlidingWindowForSeq): pagedkv's window is the config's sliding_window, Mistral's "
                      "(every query sees the last window positions, no token is evicted)",
    "sliding_window_fork": "the same, on forked sequences",
    "tree_attn": "token trees that are not chains (tree attention); the chain case runs as token_chains",
}


def conformance_capacity(config: KVCacheConfig) -> KVCacheConfig:
    """``config`` (a kernel shape of the scenario suites, so its kernels are shared) with TVM's test's capacity:
    32 sequences, 2048 tokens, forwards of up to 512."""
    return config.replace(max_batch_size=32, max_total_seq_len=2048, prefill_chunk_size=512)


# ---------------------------------------------------------------------------------------------------------
# An engine on the protocol
# ---------------------------------------------------------------------------------------------------------


class ProtocolEngine:
    """Greedy generation with a pagedkv model library (``pagedkv.models.llama`` exports), the way an engine written
    for TVM's cache runs it: the cache comes from the library's ``create_paged_kv_cache`` with MLC-LLM's five
    one-element shapes, and every cache call is a ``vm.builtin.*`` global (none of ``pagedkv.*``; the library's
    own functions call those).

    Parameters
    ----------
    lib_path :
        The library (``pagedkv.compile.build_library``).
    params :
        Its parameters, in its order.
    device :
        ``"cpu"`` or ``"cuda"``.
    max_batch_size, max_total_seq_len, prefill_chunk_size, page_size :
        The cache's capacity.
    """

    def __init__(self, lib_path: str, params: Sequence[np.ndarray], *, device: str = "cpu", max_batch_size: int = 4,
                 max_total_seq_len: int = 4096, prefill_chunk_size: int = 256, page_size: int = 16) -> None:
        import tvm
        import tvm_ffi
        from tvm.runtime.vm import VirtualMachine

        from ..runtime import load_library

        self.f = Builtins.load()
        self._tvm, self._dev = tvm, tvm.device(device)
        self.vm = VirtualMachine(load_library(lib_path), self._dev)
        self._params = tvm_ffi.convert([tvm.runtime.tensor(np.ascontiguousarray(p), self._dev) for p in params])
        self.prefill_chunk_size, self.max_batch_size = prefill_chunk_size, max_batch_size
        sizes = (max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, 0)  # 0: support_sliding_window
        self.cache = self.vm["create_paged_kv_cache"](*[shape([v]) for v in sizes])

    def add(self, seq_id: int) -> None:
        self.f.add_sequence(self.cache, seq_id)

    def fork(self, parent: int, child: int, pos: int = -1) -> None:
        self.f.fork_sequence(self.cache, parent, child, pos)

    def prefill(self, prompts: dict[int, Sequence[int]]) -> np.ndarray:
        """Every prompt appended, ``prefill_chunk_size`` tokens and ``max_batch_size`` sequences per forward;
        the last-token logits ``[len(prompts), vocab]``, in the order given."""
        done, last = dict.fromkeys(prompts, 0), {}
        while any(done[s] < len(t) for s, t in prompts.items()):
            batch, budget = {}, self.prefill_chunk_size
            for s, t in prompts.items():
                if done[s] < len(t) and budget > 0 and len(batch) < self.max_batch_size:
                    batch[s] = list(t[done[s]:done[s] + budget])
                    budget -= len(batch[s])
            lens = [len(t) for t in batch.values()]
            logits = self._forward("prefill", list(batch), lens, np.concatenate(list(batch.values()))[None],
                                   np.cumsum(lens) - 1)
            for i, (s, t) in enumerate(batch.items()):
                done[s] += len(t)
                last[s] = logits[0, i]
        return np.stack([last[s] for s in prompts])

    def decode(self, tokens: dict[int, int]) -> np.ndarray:
        """One step, a token per sequence; logits ``[len(tokens), vocab]``."""
        ids = np.array(list(tokens.values()))[:, None]
        return self._forward("decode", list(tokens), [1] * len(tokens), ids)[:, 0]

    def _forward(self, fn: str, seq_ids: list[int], lengths: list[int], *inputs: Any) -> np.ndarray:
        t = self._tvm.runtime
        self.f.begin_forward(self.cache, shape(seq_ids), shape(lengths))
        args = [t.tensor(np.asarray(x, dtype="int32"), self._dev) for x in inputs]
        logits, self.cache = self.vm[fn](*args, self.cache, self._params)
        self.f.end_forward(self.cache)
        return logits.numpy()


__all__ = ["Builtins", "ConformanceDriver", "causal_attention", "rope", "ProtocolEngine", "TVM_SCENARIOS", "UNSUPPORTED_SCENARIOS",
           "ProtocolKVCache", "conformance_capacity", "protocol_view", "refused_calls", "shape"]
