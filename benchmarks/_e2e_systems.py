"""The systems ``bench_e2e.py`` times: pagedkv's engine and HF transformers (eager; static cache + compiled
decode step on CUDA). Each ``run(ids, n)`` prefills the batch ``ids`` (one forward), decodes ``n - 1``
greedy steps and returns the tokens and the two times; nothing else (argmax of the logits included, as a
generation loop needs it) is inside the timed region."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter

import numpy as np
import torch


@dataclass(frozen=True)
class Run:
    """Greedy tokens ``[batch][n]``, transformers' top-2 logit margins (reference systems only) and times."""

    tokens: list
    prefill_s: float
    decode_s: float
    margins: list = field(default_factory=list)
    #: of ``decode_s``, the seconds spent picking tokens on the host (pagedkv: its engine returns logits
    #: to the host; transformers' argmax runs on its device and is not split out)
    host_argmax_s: float = 0.0


def greedy(logits: np.ndarray) -> list[int]:
    """Row-wise argmax of ``[rows, vocab]`` logits, as ``np.argmax`` picks it. float16 goes through its bits:
    numpy's float16 argmax is a scalar loop (milliseconds a step at batch 32, more than a GPU decode step),
    while integer keys that order as the values do are vectorized: with the sign clear the key is
    ``bits ^ 0x8000``, with it set ``bits ^ 0xFFFF`` (one temporary array: the arithmetic shift gives the
    mask). The one difference: -0.0 ranks just below +0.0 instead of tying with it."""
    if logits.dtype != np.float16:
        return np.argmax(logits, axis=-1).tolist()
    bits = logits.view(np.int16)
    keys = bits >> 15  # 0 (sign clear) or -1 (set), i.e. 0x0000 or 0xFFFF
    np.bitwise_or(keys, np.int16(-0x8000), out=keys)
    np.bitwise_xor(keys, bits, out=keys)
    return np.argmax(keys.view(np.uint16), axis=-1).tolist()


def _cache_kw(model) -> str:
    """The name transformers' forward takes the KV cache under: ``cache`` (5.2x) or ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _takes_cache_position(model) -> bool:
    import inspect

    return "cache_position" in inspect.signature(model.forward).parameters


def _margins(logits: list) -> list:
    """``[batch][step]`` top-1 minus top-2 logit, from per-step ``[batch, vocab]`` logits."""
    steps = [torch.topk(lg.float(), 2, dim=-1).values.cpu() for lg in logits]
    return [[float(s[b, 0] - s[b, 1]) for s in steps] for b in range(steps[0].shape[0])]


class Ours:
    """pagedkv: the model library (compiled here for the CPU, prebuilt for CUDA) on ``pagedkv.engine``."""

    def __init__(self, engine, weight_bytes: int, *, on_device: bool = False):
        # on_device (CUDA): decode logits stay on the GPU and the argmax runs there, as for the HF systems
        self.engine, self.weight_bytes, self.on_device = engine, weight_bytes, on_device

    @classmethod
    def create(cls, hf, args, lib: Path | None = None) -> Ours:
        """The engine over ``lib`` (CUDA: a prebuilt model library), or over a library compiled here for the
        CPU when ``lib`` is None."""
        import pagedkv  # noqa: F401 (registers the runtime's globals)
        from pagedkv.apps import smollm2
        from pagedkv.engine import Engine, param_names

        if lib is None:
            from pagedkv.apps.chat import compiled_library
            from pagedkv.target import host_target

            lib, named = compiled_library(smollm2.llama_config(hf.config), dtype=args.dtype,
                                          target=host_target(), backend=None)
        else:
            named = param_names(lib)
        params = smollm2.params_from_hf(hf, named, args.dtype)
        # A decode step reads every weight but the embedding table (of which it gathers one row per sequence).
        weight_bytes = sum(p.nbytes for (name, _), p in zip(named, params) if "embed_tokens" not in name)
        top = max(args.batches)
        engine = Engine(str(lib), params, device=args.device, max_batch_size=top,
                        prefill_chunk_size=top * args.prompt_len,
                        max_total_seq_len=top * (args.prompt_len + args.new_tokens + 16))
        return cls(engine, weight_bytes, on_device=args.device == "cuda")

    def run(self, ids: list, n: int) -> Run:
        eng, seqs = self.engine, list(range(len(ids)))
        for s in seqs:
            eng.add(s)
        t0 = perf_counter()
        nxt = greedy(eng.prefill({s: ids[s] for s in seqs}))
        t1 = perf_counter()
        toks, host = [[t] for t in nxt], 0.0
        for _ in range(n - 1):
            if self.on_device:  # as the HF systems: argmax on the GPU, only the token ids come back
                logits = eng.decode({s: nxt[s] for s in seqs}, on_device=True)
                nxt = torch.from_dlpack(logits).argmax(-1).flatten().tolist()
            else:
                logits = eng.decode({s: nxt[s] for s in seqs})
                ta = perf_counter()
                nxt = greedy(logits)
                host += perf_counter() - ta
            for s in seqs:
                toks[s].append(nxt[s])
        t2 = perf_counter()
        for s in seqs:
            eng.remove(s)
        return Run(toks, t1 - t0, t2 - t1, host_argmax_s=host)


class HFEager:
    """transformers' model called step by step with its dynamic cache (what ``generate`` does, greedy),
    ``logits_to_keep=1`` in the prefill as ``generate`` passes it."""

    def __init__(self, model, device: str):
        self.model, self.device, self.cache_kw = model, device, _cache_kw(model)

    def _out_cache(self, out):
        # the output's field carries the input's name where it has one (5.2x's ``past_key_values`` warns)
        return getattr(out, self.cache_kw) if hasattr(out, self.cache_kw) else out.past_key_values

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, ids: list, n: int) -> Run:
        x = torch.tensor(ids, device=self.device)
        self._sync()
        t0 = perf_counter()
        out = self.model(x, use_cache=True, logits_to_keep=1)
        logits = [out.logits[:, -1]]
        nxt = logits[-1].argmax(-1)
        toks = [nxt]
        self._sync()
        t1 = perf_counter()
        pkv = self._out_cache(out)
        for _ in range(n - 1):
            out = self.model(nxt[:, None], use_cache=True, **{self.cache_kw: pkv})
            pkv = self._out_cache(out)
            logits.append(out.logits[:, -1])
            nxt = logits[-1].argmax(-1)
            toks.append(nxt)
        self._sync()
        t2 = perf_counter()
        tokens = torch.stack(toks, 1).tolist()
        return Run(tokens, t1 - t0, t2 - t1, _margins(logits))


class HFStatic(HFEager):
    """CUDA: transformers with a ``StaticCache``; the prefill runs eager, each decode step is the model's
    forward under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs). One cache per batch size; its
    graphs are captured in the untimed warm-up run. transformers moved the cache argument
    (``past_key_values`` -> ``cache``) and ``cache_position`` between versions, so both are chosen from the
    forward's signature; no ``fullgraph`` (a deprecation warning inside the forward would break the graph).
    Checked on the CPU only (``--hf-static``; transformers 5.17, the GPU host's, and 5.24): one graph per
    batch size, no graph break, tokens equal to the eager run's; CUDA graphs themselves are untried."""

    def __init__(self, model, device: str):
        super().__init__(model, device)
        # dynamic=False: one graph specialized per batch size (what a served static batch gets), rather than
        # a symbolic-shape graph after the second batch size (automatic dynamic shapes).
        self.step = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)
        self.with_position = _takes_cache_position(model)
        self.caches: dict = {}

    def _positions(self, start: int, count: int, batch: int) -> dict:
        pos = torch.arange(start, start + count, device=self.device)
        # contiguous: an expanded (stride 0) input would be one more layout for the compiled graph to guard on
        kw = {"position_ids": pos.expand(batch, count).contiguous()}
        if self.with_position:
            kw["cache_position"] = pos
        return kw

    def _cache(self, batch: int, length: int):
        from transformers import StaticCache

        key = (batch, length)
        if key not in self.caches:
            self.caches[key] = StaticCache(config=self.model.config, max_cache_len=length)
        cache = self.caches[key]
        cache.reset()
        return cache

    @torch.inference_mode()
    def run(self, ids: list, n: int) -> Run:
        b, L = len(ids), len(ids[0])
        cache = self._cache(b, L + n)
        x = torch.tensor(ids, device=self.device)
        self._sync()
        t0 = perf_counter()
        out = self.model(x, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache},
                         **self._positions(0, L, b))
        logits = [out.logits[:, -1].clone()]
        nxt = logits[-1].argmax(-1)
        toks = [nxt]
        self._sync()
        t1 = perf_counter()
        for i in range(n - 1):
            out = self.step(nxt[:, None], use_cache=True, **{self.cache_kw: cache}, **self._positions(L + i, 1, b))
            logits.append(out.logits[:, -1].clone())  # CUDA graph outputs are overwritten by the next call
            nxt = logits[-1].argmax(-1)
            toks.append(nxt)
        self._sync()
        t2 = perf_counter()
        return Run(torch.stack(toks, 1).tolist(), t1 - t0, t2 - t1, _margins(logits))
