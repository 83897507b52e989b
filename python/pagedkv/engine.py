"""A small generation engine over a compiled model library (``pagedkv.models.llama`` exports).

It drives the cache the way a serving loop does: sequences are added (or forked from a shared prefix), one
batched prefill per step, then batched greedy decode steps, all with the TVM runtime only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ._lib import get_global


def library_vocab_size(library_path: str | Path) -> int | None:
    """The vocabulary size written beside a library by ``pagedkv.compile.build_library`` (``None`` when the
    ``.json`` is missing or older than the field)."""
    meta_path = Path(library_path).with_suffix(".json")
    if not meta_path.exists():
        return None
    vocab = json.loads(meta_path.read_text()).get("vocab_size")
    return vocab if isinstance(vocab, int) else None


def param_names(library_path: str | Path) -> list[tuple[str, None]]:
    """The parameter order written beside a library by ``pagedkv.compile.build_library``, as
    ``(name, None)`` pairs (``params_from_hf`` takes them like named parameter specs)."""
    meta = json.loads(Path(library_path).with_suffix(".json").read_text())
    return [(n, None) for n in meta["param_names"]]


def create_cache(vm, max_batch_size: int, max_total_seq_len: int, prefill_chunk_size: int, page_size: int):
    """The cache of a compiled model: its ``create_paged_kv_cache`` called with one-element shapes (how ``nn.spec``
    int arguments arrive), with ``support_sliding_window=0`` as the fifth when the library takes it (libraries
    compiled before the fifth argument take four).

    Parameters
    ----------
    vm : tvm.runtime.vm.VirtualMachine
        The model library's VM.
    max_batch_size, max_total_seq_len, prefill_chunk_size, page_size : int
        The cache's capacity.

    Returns
    -------
    Object
        The runtime cache (a ``pagedkv.PagedKVCache``, which is also TVM's ``relax.vm.AttentionKVCache``).
    """
    import tvm_ffi

    sizes = [max_batch_size, max_total_seq_len, prefill_chunk_size, page_size]
    if vm._get_function_arity("create_paged_kv_cache") == 5:  # pylint: disable=protected-access
        sizes.append(0)  # support_sliding_window: unused (pagedkv.models._common.CausalLMExports)
    return vm["create_paged_kv_cache"](*[tvm_ffi.Shape((v,)) for v in sizes])


@dataclass
class Timing:
    """Tokens and seconds spent in prefill and decode."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    def lines(self) -> list[str]:
        out = []
        if self.prefill_s:
            out.append(f"prefill: {self.prefill_tokens} tokens in {self.prefill_s:.2f} s "
                       f"= {self.prefill_tokens / self.prefill_s:.1f} tokens/s")
        if self.decode_s:
            out.append(f"decode: {self.decode_tokens} tokens in {self.decode_s:.2f} s "
                       f"= {self.decode_tokens / self.decode_s:.1f} tokens/s")
        return out


@dataclass
class Engine:
    """Greedy generation with a compiled model library.

    Parameters
    ----------
    lib_path :
        Library written by ``pagedkv.compile.build_library``.
    params :
        Parameter arrays in the library's order.
    device :
        ``"cpu"`` or ``"cuda"``.
    vocab_size :
        Token ids must lie in ``[0, vocab_size)``; ``None``: the library's (``library_vocab_size``). Without
        one, ids are checked by the library's own functions only (after ``begin_forward``; the engine then
        takes the forward back).

    Every call checks its input before it changes anything, and a call that fails leaves the cache as it was:
    unknown token ids and prompts that do not fit raise ``ValueError`` before a forward begins, and a
    failure inside the library takes back the tokens of the call.
    """

    lib_path: str
    params: Sequence[np.ndarray]
    device: str = "cpu"
    max_batch_size: int = 8
    max_total_seq_len: int = 4096
    prefill_chunk_size: int = 512
    page_size: int = 16
    vocab_size: int | None = None
    timing: Timing = field(default_factory=Timing)

    def __post_init__(self) -> None:
        import tvm
        from tvm.runtime.vm import VirtualMachine  # the runtime's VM: no compiler needed

        from .runtime import load_library

        if self.vocab_size is None:
            self.vocab_size = library_vocab_size(self.lib_path)
        dev = tvm.device(self.device)
        self._tvm = tvm
        self._dev = dev
        # load_library also works with the TVM runtime only (it loads TVM's CUDA runtime when needed)
        self.vm = VirtualMachine(load_library(self.lib_path), dev)
        import tvm_ffi

        # Converted once: the VM takes the weights as one tuple, and converting a Python list of hundreds of
        # tensors on every call costs about as much host time as a small model's whole decode step.
        self._params = tvm_ffi.convert([tvm.runtime.tensor(np.ascontiguousarray(p), dev) for p in self.params])
        self._prefill_fn, self._decode_fn = self.vm["prefill"], self.vm["decode"]
        self._decode_ids: dict[int, object] = {}  # batch size -> device input ids [b, 1], reused

        self.cache = create_cache(self.vm, self.max_batch_size, self.max_total_seq_len, self.prefill_chunk_size,
                                  self.page_size)

    def _g(self, name: str, *args):
        return get_global(f"pagedkv.{name}")(self.cache, *args)

    def add(self, seq_id: int) -> None:
        self._g("add_sequence", seq_id)

    def fork(self, parent: int, child: int, pos: int = -1) -> None:
        self._g("fork_sequence", parent, child, pos)

    def remove(self, seq_id: int) -> None:
        self._g("remove_sequence", seq_id)

    def popn(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` cached tokens of a sequence."""
        self._g("popn", seq_id, n)

    def prefill(self, prompts: dict[int, Sequence[int]]) -> np.ndarray:
        """Append each sequence's tokens (chunked to ``prefill_chunk_size`` tokens and ``max_batch_size``
        sequences per forward); return last-token logits ``[len(prompts), vocab]`` in the order given.

        Raises
        ------
        ValueError, TypeError
            Before anything changes: an empty prompt, a token id that is not an int or lies outside the
            vocabulary, an unknown sequence, or prompts that do not fit the free pages. A failure in a later
            forward takes back every token this call appended, so no sequence is left half-prefilled.
        """
        if not prompts:
            raise ValueError("prefill needs at least one sequence")
        tokens = {s: self._token_ids(t, f"the prompt of sequence {s}", lambda i, s=s: f"position {i} of sequence {s}")
                  for s, t in prompts.items()}
        try:  # all of every prompt, before the first forward: the chunks of one call succeed or fail together
            self._g("check_append", tuple(tokens), tuple(len(t) for t in tokens.values()))
        except ValueError as err:
            raise ValueError(f"prefill of {sum(map(len, tokens.values()))} tokens for sequences {list(tokens)} "
                             f"rejected, nothing changed: {err}") from err
        done = dict.fromkeys(tokens, 0)  # tokens of each sequence appended by finished forwards
        try:
            last = self._prefill_chunks(tokens, done)
        except BaseException:
            self._take_back(done)
            raise
        return np.stack([last[s] for s in tokens])

    def _prefill_chunks(self, tokens: dict[int, np.ndarray], done: dict[int, int]) -> dict[int, np.ndarray]:
        """Forwards of at most ``prefill_chunk_size`` tokens and ``max_batch_size`` sequences until every
        prompt is in; ``done`` counts what each finished forward appended. Returns each last row of logits."""
        last = {}
        while any(done[s] < len(t) for s, t in tokens.items()):
            batch, budget = {}, self.prefill_chunk_size
            for s, t in tokens.items():
                if done[s] < len(t) and budget > 0 and len(batch) < self.max_batch_size:
                    batch[s] = t[done[s]:done[s] + budget]
                    budget -= len(batch[s])
            logits = self._prefill_step(batch)
            for i, (s, t) in enumerate(batch.items()):
                done[s] += len(t)
                last[s] = logits[i]
        return last

    def _take_back(self, done: dict[int, int]) -> None:
        """After a failed call: close its open forward (taking its tokens back) and pop what finished forwards
        of the call appended, so the cache is as before the call."""
        self._g("abort_forward")
        for s, n in done.items():
            if n:
                self.popn(s, n)

    def _token_ids(self, tokens, what: str, where) -> np.ndarray:
        """``tokens`` (called ``what`` in errors) as a non-empty int32 array, checked against the vocabulary:
        ``ValueError`` naming the first bad id, ``where(i)`` it is and the range; ``TypeError`` for ids that
        are not ints."""
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"{what} must be a non-empty sequence of token ids, got {tokens!r:.80}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold int token ids, got {arr.dtype} values ({tokens!r:.80})")
        if self.vocab_size is not None:
            bad = np.flatnonzero((arr < 0) | (arr >= self.vocab_size))
            if bad.size:
                more = f" ({bad.size} of the {arr.size} ids of {what} are)" if bad.size > 1 else ""
                raise ValueError(f"token id {arr[bad[0]]} at {where(bad[0])} is outside the vocabulary "
                                 f"[0, vocab_size={self.vocab_size}){more}")
        return arr.astype("int32")

    def _prefill_step(self, batch: dict[int, np.ndarray]) -> np.ndarray:
        t0 = time.perf_counter()
        lens = [len(t) for t in batch.values()]
        self._g("begin_forward", tuple(batch), tuple(lens))
        flat = np.concatenate(list(batch.values()))[None]
        pos = np.cumsum(lens).astype("int32") - 1
        tvm = self._tvm
        logits, self.cache = self._prefill_fn(tvm.runtime.tensor(flat, self._dev),
                                              tvm.runtime.tensor(pos, self._dev), self.cache, self._params)
        self._g("end_forward")
        out = logits.numpy()[0]
        self.timing.prefill_tokens += sum(lens)
        self.timing.prefill_s += time.perf_counter() - t0
        return out

    def decode(self, tokens: dict[int, int], *, on_device: bool = False):
        """One decode step: one token per sequence; returns logits ``[len(tokens), vocab]`` (numpy), or with
        ``on_device`` the library's ``[len(tokens), 1, vocab]`` device tensor, not copied (pick tokens on the
        device, e.g. ``torch.from_dlpack(t).argmax(-1)``; the step's time then excludes the GPU's work).
        Bad input raises before the step begins (as ``prefill``); a failed step is taken back."""
        t0 = time.perf_counter()
        if not tokens:
            raise ValueError("decode needs at least one sequence")
        seqs = list(tokens)
        ids = self._token_ids(list(tokens.values()), f"the decode step of sequences {seqs}",
                              lambda i: f"the decode step of sequence {seqs[i]}")
        step = ids[:, None]
        self._g("begin_forward", tuple(tokens), (1,) * len(tokens))
        try:
            dev_ids = self._decode_ids.get(len(step))
            if dev_ids is None:  # one device buffer per batch size, refilled each step (no allocation per step)
                dev_ids = self._decode_ids[len(step)] = self._tvm.runtime.empty(step.shape, "int32", self._dev)
            dev_ids.copyfrom(step)
            logits, self.cache = self._decode_fn(dev_ids, self.cache, self._params)
            self._g("end_forward")
        except BaseException:
            self._g("abort_forward")
            raise
        out = logits if on_device else logits.numpy()[:, 0]
        self.timing.decode_tokens += len(tokens)
        self.timing.decode_s += time.perf_counter() - t0
        return out
