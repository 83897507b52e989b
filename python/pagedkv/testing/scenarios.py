"""Cache scenarios as data, and the driver that runs one against a real cache and :class:`ReferenceCache`.

A scenario is a list of :class:`Step` built for a page size (positions are written relative to it so that
every scenario crosses page boundaries for any page size). The driver applies each step to both caches;
after every forward it compares every layer's output with the reference (relative error
``||out - ref|| / ||ref||`` below :data:`TOLERANCE` of the dtype), and at ``check`` steps it compares
lengths, page accounting and ``debug_get_kv`` dumps of every sequence.

The GPU suite reuses this module with other targets and devices.
"""

from __future__ import annotations

from dataclasses import dataclass
import random
from typing import Callable

import torch

from .reference import EMPTY_LSE, ReferenceCache
from .reference_mla import reference_for
from .scenarios_mla import check_mla_state, mla_layer

__all__ = ["Step", "add", "fork", "remove", "popn", "forward", "check", "clear", "SCENARIOS", "random_step",
           "TOLERANCE", "rel_err", "assert_close", "assert_state_close", "ScenarioRunner"]

#: Relative-error bound ``||out - ref|| / ||ref||`` per storage dtype (never loosened).
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


# ---------------------------------------------------------------------------------------------------------
# steps
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One scenario step: ``kind`` in add / fork / remove / popn / forward / check / clear."""

    kind: str
    args: tuple = ()

    def __str__(self) -> str:
        return f"{self.kind}{self.args}"


def add(seq: int) -> Step:
    return Step("add", (seq,))


def fork(parent: int, child: int, pos: int = -1) -> Step:
    return Step("fork", (parent, child, pos))


def remove(seq: int) -> Step:
    return Step("remove", (seq,))


def popn(seq: int, n: int) -> Step:
    return Step("popn", (seq, n))


def forward(batch: dict[int, int]) -> Step:
    """A forward appending ``batch[seq]`` tokens to each sequence, in the dict's order."""
    return Step("forward", tuple(batch.items()))


def check() -> Step:
    return Step("check")


def clear() -> Step:
    return Step("clear")


def _decode(seqs, times: int = 1) -> list[Step]:
    return [forward({s: 1 for s in seqs}) for _ in range(times)]


# ---------------------------------------------------------------------------------------------------------
# scenarios (functions of the page size P); they need max_batch_size >= 8, prefill_chunk_size >= 64 and
# a pool of >= 128 tokens + 8 pages
# ---------------------------------------------------------------------------------------------------------
def mixed_prefill_decode(P: int) -> list[Step]:
    """Batches mixing multi-token prefills with one-token sequences, and pure decode batches."""
    return [
        add(0), add(1), add(2),
        forward({0: P + 3, 1: 5, 2: 1}),  # prefill batch that holds a one-token sequence
        check(),
        forward({0: 1, 1: 1, 2: 1}),  # decode
        forward({1: 2 * P - 3, 0: 1, 2: 1}),
        forward({2: 1, 0: 1, 1: 1}),
        forward({0: 2, 2: P}),
        check(),
    ]


def chunked_prefill(P: int) -> list[Step]:
    """One long prompt in several forwards (each one attends to the chunks before it)."""
    return [
        add(0),
        forward({0: P - 3}),
        forward({0: P + 5}),
        forward({0: 2 * P + 1}),
        check(),
        *_decode([0], 2),
        add(1),
        forward({1: P // 2, 0: P}),
        forward({1: P + 1}),
        forward({0: 1, 1: 1}),
        check(),
    ]


def remove_reuse(P: int) -> list[Step]:
    """Removed sequences give their pages back; new sequences (and a reused id) get them."""
    return [
        add(0), add(1),
        forward({0: 2 * P + 5, 1: P + 1}),
        check(),
        remove(0),
        check(),
        add(2),
        forward({2: 3 * P, 1: 2}),
        check(),
        remove(1), remove(2),
        check(),
        # three rounds of 127 tokens: more pages in total than the pool has, so freed pages must be reused
        *[step for r in range(3) for step in (add(10 + r), forward({10 + r: 64}), forward({10 + r: 63}),
                                               check(), remove(10 + r))],
        add(3), add(0),
        forward({3: P + 1, 0: 4}),
        forward({0: 1, 3: 1}),
        check(),
    ]


def fork_boundary_midpage(P: int) -> list[Step]:
    """Forks at page boundaries, mid-page, at the parent's end and at 0; all of them then extended."""
    return [
        add(0),
        forward({0: 2 * P + 5}),
        fork(0, 1, P),          # page boundary
        fork(0, 2, P + 3),      # mid-page: the partial page is copied
        fork(0, 3, -1),         # at the parent's length (mid-page)
        fork(0, 4, 2 * P),      # boundary of the parent's last full page
        fork(0, 5, 0),          # nothing shared
        check(),
        forward({1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 0: 1}),
        check(),
        forward({1: 3, 2: P, 0: 2, 4: 1, 5: 2, 3: 1}),
        check(),
        *_decode([0, 1, 2, 3, 4, 5], 2),
        check(),
    ]


def fork_three_deep(P: int) -> list[Step]:
    """Child of a child of a child, then every level decoded in one batch across page boundaries."""
    return [
        add(0),
        forward({0: P + 5}),
        fork(0, 1, -1),
        forward({1: P}),
        fork(1, 2, P + 2),      # mid-page, inside the part 1 shares with 0
        forward({2: 2 * P - 1}),
        fork(2, 3, 2 * P),      # page boundary
        forward({3: 3}),
        check(),
        *_decode([0, 1, 2, 3], P // 2 + 1),
        check(),
        *_decode([3, 2, 1, 0], P // 2 + 1),
        forward({2: 2, 0: 3, 3: 1, 1: P}),
        check(),
    ]


def popn_scenario(P: int) -> list[Step]:
    """popn across page boundaries, into a prefix shared after a fork, and of a whole sequence."""
    return [
        add(0),
        forward({0: 3 * P + 2}),
        popn(0, P + 4),         # 2P - 2: crosses two page boundaries
        check(),
        forward({0: 5}),        # 2P + 3
        popn(0, 1),             # 2P + 2
        check(),
        fork(0, 1, 2 * P + 1),  # mid-page
        forward({0: 2, 1: 2}),  # 0: 2P + 4, 1: 2P + 3
        popn(1, P + 2),         # 1: P + 1, mid-page inside the shared prefix
        check(),
        forward({1: 1, 0: 1}),  # 1: P + 2, 0: 2P + 5
        check(),
        fork(0, 2, -1),         # 2: 2P + 5
        popn(2, P + 5),         # 2: P, page-aligned, inside the shared prefix
        forward({2: 3, 0: 1, 1: 2}),  # 2: P + 3, 0: 2P + 6, 1: P + 4
        check(),
        popn(0, 2 * P + 6),     # all of it
        check(),
        forward({0: 3, 2: 1}),
        check(),
        remove(1),
        popn(2, 1),
        forward({2: 1, 0: 1}),
        check(),
    ]


def decode_only(P: int) -> list[Step]:
    """Decode batches from empty sequences, then long runs of decode over page boundaries."""
    return [
        add(0), add(1), add(2), add(3),
        *_decode([0, 1, 2, 3], 2),
        check(),
        forward({0: P - 1, 1: 2, 2: P + 1, 3: 5}),
        *_decode([0, 1, 2, 3], P // 2 + 2),
        check(),
        *_decode([2, 0, 3], P // 2 + 1),
        check(),
    ]


def shared_prefix_adjacent(P: int) -> list[Step]:
    """Sequences sharing a prefix, adjacent in the batch (one prefix pass), nested and non-adjacent."""
    return [
        add(0),
        forward({0: 2 * P + 5}),
        fork(0, 1, -1), fork(0, 2, -1), fork(0, 3, 2 * P),
        add(4),
        forward({1: 3, 2: 3, 3: 3, 4: 4}),      # prefill; 1, 2, 3 share [0, 2P)
        check(),
        forward({1: 1, 2: 1, 3: 1, 0: 1, 4: 1}),  # decode; 0..3 adjacent
        forward({1: 1, 4: 1, 2: 1, 0: 1, 3: 1}),  # decode; sharing sequences not adjacent
        fork(1, 5, -1), fork(1, 6, P + 1),
        forward({1: 1, 5: 1, 6: 1, 2: 1, 3: 1}),  # nested sharing: {1, 5} below {1, 5, 6, 2, 3}
        forward({5: 2, 6: 1, 1: 3, 0: 2}),        # prefill with nested sharing
        check(),
        remove(0), remove(1),
        forward({5: 1, 6: 1, 2: 1}),
        forward({6: P, 5: 1, 3: 2}),
        check(),
    ]


def deep_shared_prefix(P: int) -> list[Step]:
    """Seven sequences whose chains share up to six page-aligned blocks (more prefix depths than the
    runtime gives passes of their own), decoded and prefilled in one batch, adjacent and shuffled."""
    steps = [add(0), forward({0: P})]
    for s in range(1, 7):
        steps += [fork(s - 1, s, -1), forward({s: P})]
    every = list(range(7))
    return steps + [
        check(),
        forward({s: 1 for s in every}),
        forward({s: 2 for s in every}),
        forward({s: 1 for s in [3, 0, 6, 1, 5, 2, 4]}),
        fork(6, 7, 3 * P + 1),
        forward({s: 1 for s in [7, *every]}),
        check(),
    ]


def edge_cases(P: int) -> list[Step]:
    """Empty leaves, forks of a parent whose leaf is empty, popn to a block boundary / to 0 / of 0 tokens,
    reused ids, and batches with sharing groups split by an unrelated sequence."""
    return [
        add(0),
        forward({0: 2 * P}),
        fork(0, 1, -1),          # 0's leaf becomes empty (aligned end)
        fork(0, 2, -1),          # fork of a sequence whose leaf is empty
        fork(1, 3, -1),
        popn(0, 0),
        check(),
        add(4),
        forward({1: 1, 2: 1, 4: 1, 0: 1, 3: 1}),  # decode; 1, 2 adjacent, 4 splits them from 0, 3
        forward({0: 3, 4: P, 1: 2}),               # prefill; an empty-cache sequence among sharing ones
        popn(1, 3),              # back to exactly 2P: its leaf empties, the chain ends at the shared block
        popn(2, 1),
        check(),
        forward({2: 1, 1: 1, 3: 1}),
        popn(3, 2 * P + 1),      # all of it (into the shared prefix)
        forward({3: 2, 0: 1}),
        remove(2), remove(4),
        add(2),                  # reused id
        fork(1, 4, P - 1),       # reused id as a child, mid-page in the first shared page
        forward({4: 2, 2: 1, 1: 1}),
        check(),
        popn(4, P + 1),
        forward({4: 1}),
        check(),
    ]


def clear_scenario(P: int) -> list[Step]:
    """clear drops every sequence and gives every page back."""
    return [
        add(0), add(1),
        forward({0: P + 2, 1: 3}),
        fork(0, 2, P + 1),
        forward({2: 2, 1: 1}),
        clear(),
        check(),
        add(1),
        forward({1: P + 1}),
        forward({1: 1}),
        check(),
    ]


def random_step(ref: ReferenceCache, rng: random.Random, max_seqs: int = 8) -> Step:
    """A random step that the reference accepts in its current state (fork positions, popn lengths,
    batches and append lengths drawn within the page, batch and chunk limits)."""
    import copy

    P = ref.page_size
    seqs = sorted(ref.seqs)
    for _ in range(100):
        kind = rng.choices(["add", "fork", "remove", "popn", "decode", "prefill", "check"],
                           weights=[2 if len(seqs) < max_seqs else 0, 3 if seqs and len(seqs) < max_seqs else 0,
                                    1 if len(seqs) > 2 else 0, 2 if seqs else 0, 4 if seqs else 0,
                                    4 if seqs else 0, 1])[0]
        free_ids = [i for i in range(max_seqs + 4) if i not in ref.seqs]
        if kind == "add":
            step = add(rng.choice(free_ids))
        elif kind == "fork":
            parent = rng.choice(seqs)
            length = ref.get_sequence_length(parent)
            pos = rng.choice([-1, 0, length, (length // P) * P, rng.randint(0, length)])
            step = fork(parent, rng.choice(free_ids), pos)
        elif kind == "remove":
            step = remove(rng.choice(seqs))
        elif kind == "popn":
            seq = rng.choice(seqs)
            length = ref.get_sequence_length(seq)
            step = popn(seq, rng.choice([rng.randint(0, min(length, 3)), rng.randint(0, length)]))
        elif kind in ("decode", "prefill"):
            batch = rng.sample(seqs, rng.randint(1, min(len(seqs), ref.config.max_batch_size)))
            if rng.random() < 0.5:
                batch.sort()  # sequences sharing blocks end up adjacent more often
            if kind == "decode":
                step = forward({b: 1 for b in batch})
            else:
                budget = ref.config.prefill_chunk_size
                lens = [rng.choice([1, 2, rng.randint(1, 2 * P + 3)]) for _ in batch]
                while sum(lens) > budget:
                    lens = [max(1, n // 2) for n in lens]
                step = forward(dict(zip(batch, lens)))
        else:
            step = check()
        trial = copy.deepcopy(ref)
        try:
            _apply_to_reference(trial, step)
        except ValueError:
            continue
        return step
    return check()


def _apply_to_reference(ref: ReferenceCache, step: Step) -> None:
    if step.kind == "add":
        ref.add_sequence(*step.args)
    elif step.kind == "fork":
        ref.fork_sequence(*step.args)
    elif step.kind == "remove":
        ref.remove_sequence(*step.args)
    elif step.kind == "popn":
        ref.popn(*step.args)
    elif step.kind == "forward":
        ref.begin_forward([s for s, _ in step.args], [n for _, n in step.args])
        ref.fwd = None
    elif step.kind == "clear":
        ref.clear()


#: Every scenario, by name (the name is the test id).
SCENARIOS: dict[str, Callable[[int], list[Step]]] = {
    "mixed_prefill_decode": mixed_prefill_decode,
    "chunked_prefill": chunked_prefill,
    "remove_reuse": remove_reuse,
    "fork_boundary_midpage": fork_boundary_midpage,
    "fork_three_deep": fork_three_deep,
    "popn": popn_scenario,
    "decode_only": decode_only,
    "shared_prefix_adjacent": shared_prefix_adjacent,
    "deep_shared_prefix": deep_shared_prefix,
    "edge_cases": edge_cases,
    "clear": clear_scenario,
}


# ---------------------------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------------------------
def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (NaN anywhere in ``out`` gives NaN)."""
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    denom = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(out - ref).item()
    return num / denom if denom else (0.0 if num == 0 else float("inf"))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: str, what: str) -> None:
    """Assert ``rel_err(out, ref) < TOLERANCE[dtype]`` (NaN fails)."""
    tol = TOLERANCE[dtype]
    err = rel_err(out, ref)
    if not err < tol:
        nan = int(torch.isnan(out.detach().float()).sum())
        raise AssertionError(f"{what}: relative error {err:.3e} >= {tol:g} ({nan} NaN of {out.numel()})")


def assert_state_close(o: torch.Tensor, lse: torch.Tensor, ref_o: torch.Tensor, ref_lse: torch.Tensor,
                       dtype: str, what: str) -> None:
    """Compare an attention state: rows the reference finds empty must be ``o = 0``, ``lse = -1e30``;
    the others follow the relative-error rule (o and lse separately)."""
    lse = lse.detach().to("cpu", torch.float64)
    o = o.detach().to("cpu", torch.float64)
    empty = ref_lse <= EMPTY_LSE / 2
    if empty.any():
        bad = lse[empty]
        if not torch.all((bad - EMPTY_LSE).abs() <= 1e-6 * abs(EMPTY_LSE)):
            raise AssertionError(f"{what}: rows with no keys must have lse = -1e30, got {bad.unique()[:4]}")
        if not torch.all(o[empty] == 0):
            bad_o = o[empty]
            nan = int(torch.isnan(bad_o).sum())  # unwritten (the poison) or written wrong: say which
            raise AssertionError(f"{what}: rows with no keys must have o = 0: {int((bad_o != 0).sum())} of "
                                 f"{bad_o.numel()} elements not 0 ({nan} NaN, max |finite| "
                                 f"{float(bad_o.nan_to_num(0).abs().max()):.3g}) in rows "
                                 f"{torch.nonzero((o != 0).any(-1) & empty)[:4].tolist()}")
    full = ~empty
    if full.any():
        assert_close(o[full], ref_o[full], dtype, f"{what} (o)")
        assert_close(lse[full], ref_lse[full], dtype, f"{what} (lse)")


def random_sm_scale(gen: torch.Generator, head_dim: int) -> float:
    """A softmax scale near ``head_dim ** -0.5`` but never equal to it, so a kernel that ignores its
    ``sm_scale`` argument fails."""
    return float(head_dim ** -0.5 * (0.6 + 0.8 * torch.rand((), generator=gen).item()))


# ---------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------
class ScenarioRunner:
    """Apply steps to a real cache and a :class:`ReferenceCache` side by side and compare.

    Parameters
    ----------
    cache : pagedkv.cache.KVCache
        The cache under test (fresh, ideally created with ``poison=True``).
    generator : torch.Generator
        Source of the random qkv inputs (on the CPU; inputs are moved to the cache's device).
    sm_scale : float
        Softmax scale of every attention call.
    fine_grained : bool
        Also run ``self_attention`` / ``cross_attention`` / ``merge_attn_output_inplace`` on every layer of
        every forward and compare them with the reference and with the fused result.
    """

    def __init__(self, cache, generator: torch.Generator, sm_scale: float, *, fine_grained: bool = False):
        self.cache = cache
        self.cfg = cache.config
        self.ref = reference_for(self.cfg)
        self.gen = generator
        self.sm_scale = float(sm_scale)
        self.fine_grained = fine_grained
        self.dtype = getattr(torch, self.cfg.dtype)
        self.where = ""

    # -- inputs ---------------------------------------------------------------------------------------
    def randn(self, *shape) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen, dtype=torch.float32)
        return x.to(self.dtype).to(self.cache.device)

    # -- steps ------------------------------------------------------------------------------------------
    def run(self, steps: list[Step], name: str = "") -> None:
        for i, step in enumerate(steps):
            self.where = f"{name} step {i} {step}"
            getattr(self, f"_do_{step.kind}")(*step.args)

    def _do_add(self, seq):
        self.ref.add_sequence(seq)
        self.cache.add_sequence(seq)

    def _do_fork(self, parent, child, pos):
        self.ref.fork_sequence(parent, child, pos)
        self.cache.fork_sequence(parent, child, pos)

    def _do_remove(self, seq):
        self.ref.remove_sequence(seq)
        self.cache.remove_sequence(seq)

    def _do_popn(self, seq, n):
        self.ref.popn(seq, n)
        self.cache.popn(seq, n)

    def _do_clear(self):
        self.ref.clear()
        self.cache.clear()

    def _do_forward(self, *batch):
        seqs = [s for s, _ in batch]
        lens = [n for _, n in batch]
        self.ref.begin_forward(seqs, lens)
        self.cache.begin_forward(seqs, lens)
        qpos = self.cache.get_query_positions()
        assert torch.equal(qpos.cpu().to(torch.int64), self.ref.get_query_positions().to(torch.int64)), (
            f"{self.where}: query positions {qpos.tolist()} != {self.ref.get_query_positions().tolist()}")
        n = sum(lens)
        width = self.cfg.num_qo_heads + 2 * self.cfg.num_kv_heads
        for layer in range(self.cfg.num_layers):
            if self.cfg.is_mla:
                mla_layer(self, layer, n)
                continue
            qkv = self.randn(n, width, self.cfg.head_dim)
            qkv_in = qkv.clone()
            o = self.cache.attention_with_fused_qkv(layer, qkv, self.sm_scale)
            ref_o = self.ref.attention_with_fused_qkv(layer, qkv.cpu(), self.sm_scale)
            assert torch.equal(qkv, qkv_in), f"{self.where}: attention_with_fused_qkv modified its qkv input"
            assert o.dtype == self.dtype and tuple(o.shape) == tuple(ref_o.shape)
            assert_close(o, ref_o, self.cfg.dtype, f"{self.where} layer {layer}: attention_with_fused_qkv")
            if self.fine_grained:
                self._fine_grained(layer, qkv, o, ref_o)
        self.cache.end_forward()
        self.ref.end_forward()

    def _fine_grained(self, layer, qkv, fused_o, ref_o):
        """self + cross (+ merge in prefill) must give the fused result; each part matches the reference."""
        where = f"{self.where} layer {layer}"
        q, k, v = self.ref.split_rotary(qkv.cpu())  # float64; rotated in "normal" mode (what a model passes)
        q, k, v = (t.to(self.dtype).to(self.cache.device) for t in (q, k, v))
        o_s, lse_s = self.cache.self_attention(layer, q, k, v, self.sm_scale)
        r_os, r_ls = self.ref.self_attention(layer, q.cpu(), k.cpu(), v.cpu(), self.sm_scale)
        assert_state_close(o_s, lse_s, r_os, r_ls, self.cfg.dtype, f"{where}: self_attention")
        o_c, lse_c = self.cache.cross_attention(layer, q, self.sm_scale)
        r_oc, r_lc = self.ref.cross_attention(layer, q.cpu(), self.sm_scale)
        assert_state_close(o_c, lse_c, r_oc, r_lc, self.cfg.dtype, f"{where}: cross_attention")
        if self.ref.fwd.through:
            # the cache view includes the new tokens (decode, or a windowed cache): cross attention alone is
            # the full attention (and self_attention, checked above, is the empty state, so merging the two
            # changes nothing)
            assert_close(o_c, ref_o, self.cfg.dtype, f"{where}: decode cross_attention vs full attention")
            assert_close(o_c, fused_o, self.cfg.dtype, f"{where}: decode cross_attention vs fused")
        r_om, r_lm = self.ref.merge_attn_output_inplace(r_os, r_ls, r_oc, r_lc)
        assert_close(r_om, ref_o, self.cfg.dtype, f"{where}: reference self+cross merge vs reference full attention")
        o_a, lse_a = o_s.clone(), lse_s.clone()
        ret_o, ret_l = self.cache.merge_attn_output_inplace(o_a, lse_a, o_c, lse_c)
        # in place: o_a / lse_a themselves hold the merged state
        ref_m_o, ref_m_l = self.ref.merge_attn_output_inplace(o_s.cpu(), lse_s.cpu(), o_c.cpu(), lse_c.cpu())
        assert_state_close(o_a, lse_a, ref_m_o, ref_m_l, self.cfg.dtype, f"{where}: merge_attn_output_inplace")
        assert ret_o.data_ptr() == o_a.data_ptr() and ret_l.data_ptr() == lse_a.data_ptr()
        assert_close(o_a, ref_o, self.cfg.dtype, f"{where}: self+cross merged vs full attention")
        assert_close(o_a, fused_o, self.cfg.dtype, f"{where}: self+cross merged vs attention_with_fused_qkv")

    def assert_state(self, o, lse, ref_o, ref_lse, what: str) -> None:
        assert_state_close(o, lse, ref_o, ref_lse, self.cfg.dtype, what)

    def _do_check(self):
        if self.cfg.is_mla:
            check_mla_state(self.cache, self.ref, self.where)
        else:
            check_state(self.cache, self.ref, self.where)


def check_state(cache, ref: ReferenceCache, where: str = "") -> None:
    """Lengths, page accounting and every sequence's K/V dump equal the reference's.

    V and (outside "normal" RoPE mode) K are copies of the inputs, so they must be bit-exact; K rotated by
    ``split_rotary`` follows the relative-error rule.
    """
    cfg = cache.config
    assert cache.num_available_pages == ref.num_available_pages, (
        f"{where}: num_available_pages {cache.num_available_pages} != reference {ref.num_available_pages}")
    assert cache.total_sequence_length == ref.total_sequence_length, (
        f"{where}: total_sequence_length {cache.total_sequence_length} != {ref.total_sequence_length}")
    ps = cfg.page_size
    for seq in sorted(ref.seqs):
        length = ref.get_sequence_length(seq)
        got = cache.get_sequence_length(seq)
        assert got == length, f"{where}: length of sequence {seq} is {got}, reference {length}"
        ranges = [(0, length)]
        if length > ps + 1:
            ranges.append((ps - 1, ps + 2))  # a slice across a page boundary
        for start, end in ranges:
            k, v = cache.debug_get_kv(seq, start, end)
            rk, rv = ref.debug_get_kv(seq, start, end)
            what = f"{where}: debug_get_kv({seq}, {start}, {end})"
            assert tuple(k.shape) == tuple(rk.shape), f"{what}: shape {tuple(k.shape)} != {tuple(rk.shape)}"
            if length == 0:
                continue
            kd, vd = k.cpu().to(torch.float64), v.cpu().to(torch.float64)
            assert torch.equal(vd, rv), f"{what}: V differs at {_first_diff(vd, rv)}"
            if cfg.rope_mode == "normal":
                assert_close(kd, rk, cfg.dtype, f"{what}: K (rotated)")
            else:
                assert torch.equal(kd, rk), f"{what}: K differs at {_first_diff(kd, rk)}"


def _first_diff(a: torch.Tensor, b: torch.Tensor):
    """Index ``(layer, token, head, dim)`` of the first element that differs (NaN differs)."""
    diff = ~(a == b)
    idx = diff.nonzero()
    return tuple(idx[0].tolist()) if len(idx) else None
