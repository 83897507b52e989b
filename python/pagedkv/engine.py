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


def param_names(library_path: str | Path) -> list[tuple[str, None]]:
    """The parameter order written beside a library by ``pagedkv.compile.build_library``, as
    ``(name, None)`` pairs (``params_from_hf`` takes them like named parameter specs)."""
    meta = json.loads(Path(library_path).with_suffix(".json").read_text())
    return [(n, None) for n in meta["param_names"]]


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
    """

    lib_path: str
    params: Sequence[np.ndarray]
    device: str = "cpu"
    max_batch_size: int = 8
    max_total_seq_len: int = 4096
    prefill_chunk_size: int = 512
    page_size: int = 16
    timing: Timing = field(default_factory=Timing)

    def __post_init__(self) -> None:
        import tvm
        from tvm.runtime.vm import VirtualMachine  # the runtime's VM: no compiler needed

        from .runtime import load_library

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

        # nn.spec int arguments arrive as one-element shapes.
        sizes = (self.max_batch_size, self.max_total_seq_len, self.prefill_chunk_size, self.page_size)
        self.cache = self.vm["create_paged_kv_cache"](*[tvm_ffi.Shape((v,)) for v in sizes])

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
        """Append each sequence's tokens (chunked to ``prefill_chunk_size``); return last-token logits
        ``[len(prompts), vocab]`` in the order given."""
        ids = list(prompts)
        pending = {s: list(t) for s, t in prompts.items()}
        last = {}
        while any(pending.values()):
            batch, budget = {}, self.prefill_chunk_size
            for s in ids:
                if pending[s] and budget > 0:
                    take = pending[s][:budget]
                    batch[s], pending[s], budget = take, pending[s][len(take):], budget - len(take)
            logits = self._prefill_step(batch)
            for i, s in enumerate(batch):
                last[s] = logits[i]
        return np.stack([last[s] for s in ids])

    def _prefill_step(self, batch: dict[int, list[int]]) -> np.ndarray:
        t0 = time.perf_counter()
        lens = [len(t) for t in batch.values()]
        self._g("begin_forward", tuple(batch), tuple(lens))
        flat = np.array([sum(batch.values(), [])], dtype="int32")
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
        device, e.g. ``torch.from_dlpack(t).argmax(-1)``; the step's time then excludes the GPU's work)."""
        t0 = time.perf_counter()
        self._g("begin_forward", tuple(tokens), (1,) * len(tokens))
        step = np.array([[t] for t in tokens.values()], dtype="int32")
        ids = self._decode_ids.get(len(step))
        if ids is None:  # one device buffer per batch size, refilled each step (no allocation per step)
            ids = self._decode_ids[len(step)] = self._tvm.runtime.empty(step.shape, "int32", self._dev)
        ids.copyfrom(step)
        logits, self.cache = self._decode_fn(ids, self.cache, self._params)
        self._g("end_forward")
        out = logits if on_device else logits.numpy()[:, 0]
        self.timing.decode_tokens += len(tokens)
        self.timing.decode_s += time.perf_counter() - t0
        return out
