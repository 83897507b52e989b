"""``python -m pagedkv.apps.chat`` / ``pagedkv chat``: compile SmolLM2-135M-Instruct with pagedkv and chat.

Several prompts share the system prompt through ``fork``: the shared prefix is prefilled once, each prompt's
remainder is prefilled in one batch, then all decode together. Text of the first prompt streams as it is
produced; prefill and decode tokens/s are printed at the end.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

DEFAULT_PROMPTS = ["What is the capital of France?"]
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDKV_CACHE_DIR", Path.home() / ".cache" / "pagedkv"))


def _source_digest() -> str:
    # Compiled libraries are reused only while the code that produced them is unchanged.
    # (the whole package: the models, the Relax constructor and the kernels, pagedkv.tir_kernels)
    pkg = Path(__file__).resolve().parent.parent
    files = {f.resolve() for f in pkg.rglob("*.py")}  # the kernels included (pagedkv/tir_kernels)
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


class _Ticker:
    """Prints elapsed time every few seconds while a long step runs."""

    def __init__(self, what: str, every: float = 10.0):
        self.what, self.every, self._stop = what, every, threading.Event()

    def __enter__(self):
        self.t0 = time.perf_counter()
        print(f"[pagedkv] {self.what} ...", flush=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.every):
            print(f"[pagedkv]   {self.what}: {time.perf_counter() - self.t0:.0f} s", flush=True)

    def __exit__(self, *exc):
        self._stop.set()
        print(f"[pagedkv] {self.what} done in {time.perf_counter() - self.t0:.1f} s", flush=True)


def compiled_library(cfg, *, dtype: str, target: str, backend) -> tuple[Path, list]:
    """Compile (or reuse) the model library for ``cfg``; returns its path and named parameter specs."""
    from ..compile import build_library
    from ..engine import param_names
    from ..models.llama import LlamaForCausalLM

    from ..cpu_pipeline import SCHEDULE_VERSION

    # The schedules' version is in the key as well as their source: a library compiled with other
    # schedules (or none, before pagedkv.cpu_pipeline) is never reused.
    key = hashlib.sha256(repr((cfg, dtype, target, backend, SCHEDULE_VERSION, _source_digest())).encode())
    key = key.hexdigest()[:20]
    path = cache_dir() / f"llama-{key}.so"
    path.parent.mkdir(parents=True, exist_ok=True)
    # One compile per key: a second process (the suite's workers, two chats) waits for the first and reuses it.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and path.with_suffix(".json").exists():
            print(f"[pagedkv] reusing compiled library {path}", flush=True)
            return path, param_names(path)
        model = LlamaForCausalLM(cfg, dtype=dtype, target=target, backend=backend)
        kind = target if isinstance(target, str) else target.kind.name
        with _Ticker(f"compiling the model for {kind}"):
            path, named = build_library(model, target, path, verbose=True)
    return path, named


def _generate(engine, tok, prompts: list[str], max_new: int, stream: bool) -> list[str]:
    convs = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}],
                                     add_generation_prompt=True) for p in prompts]
    convs = [list(c["input_ids"] if hasattr(c, "keys") else c) for c in convs]
    shared = 0
    while all(len(c) > shared + 1 and c[shared] == convs[0][shared] for c in convs):
        shared += 1
    # Prefill the shared system prefix once in sequence 0, fork it for every prompt.
    engine.add(0)
    engine.prefill({0: convs[0][:shared]})
    for i in range(len(prompts)):
        engine.fork(0, i + 1)
    logits = engine.prefill({i + 1: c[shared:] for i, c in enumerate(convs)})
    eos = tok.eos_token_id
    outs = [[] for _ in prompts]
    live = list(range(len(prompts)))
    nxt = {i: int(np.argmax(logits[i])) for i in live}
    for _ in range(max_new):
        for i in list(live):
            if nxt[i] == eos:
                live.remove(i)
                continue
            outs[i].append(nxt[i])
            if stream and i == 0:
                print(tok.decode([nxt[i]]), end="", flush=True)
        if not live:
            break
        step = engine.decode({i + 1: nxt[i] for i in live})
        nxt = {i: int(np.argmax(step[j])) for j, i in enumerate(live)}
    if stream:
        print(flush=True)
    return [tok.decode(o, skip_special_tokens=True) for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagedkv chat", description=__doc__.splitlines()[0])
    ap.add_argument("prompts", nargs="*", default=DEFAULT_PROMPTS)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    import pagedkv  # noqa: F401  (registers the runtime globals)
    from . import smollm2
    from ..engine import Engine

    print(f"[pagedkv] model file: {smollm2.gguf_path()}", flush=True)
    with _Ticker("loading and dequantizing the GGUF weights"):
        hf, tok = smollm2.load_hf()
    cfg = smollm2.llama_config(hf.config)
    target = args.target
    if target == "llvm":
        from ..tir_kernels import host_target

        target = host_target()  # this CPU's vector units for kernels and matmuls
    lib, named = compiled_library(cfg, dtype=args.dtype, target=target, backend=args.backend)
    params = smollm2.params_from_hf(hf, named, args.dtype)
    del hf
    device = "cpu" if args.target.startswith("llvm") else "cuda"
    engine = Engine(str(lib), params, device=device, max_batch_size=max(8, len(args.prompts) + 1))
    print(f"\n[0] user: {args.prompts[0]}\n[0] assistant: ", end="", flush=True)
    texts = _generate(engine, tok, args.prompts, args.max_new_tokens, stream=True)
    for i, (p, t) in enumerate(zip(args.prompts, texts)):
        if i:
            print(f"\n[{i}] user: {p}\n[{i}] assistant: {t}")
    print()
    for line in engine.timing.lines():
        print(f"[pagedkv] {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
