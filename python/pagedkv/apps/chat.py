"""``python -m pagedkv.apps.chat`` / ``pagedkv chat``: compile SmolLM2-135M-Instruct with pagedkv and chat.

Several prompts share the system prompt through ``fork``: the shared prefix is prefilled once, each prompt's
remainder is prefilled in one batch, then all decode together. Text of the first prompt streams as it is
produced; prefill and decode tokens/s are printed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np

DEFAULT_PROMPTS = ["What is the capital of France?"]
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#: Name prefix of the compiled models in the cache folder (``llama-<key>.so``).
MODEL_PREFIX = "llama"


def cache_dir() -> Path:
    """Where compiled models are kept: pagedkv's cache root (``pagedkv.kernel_cache.cache_root``)."""
    from ..kernel_cache import cache_root

    return cache_root()


def _source_digest() -> str:
    # Compiled libraries are reused only while the code that produced them is unchanged.
    # (the whole package: the models, the Relax constructor and the kernels, pagedkv.tir_kernels)
    pkg = Path(__file__).resolve().parent.parent
    files = {f.resolve() for f in pkg.rglob("*.py")}  # the kernels included (pagedkv/tir_kernels)
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def compiled_library(cfg, *, dtype: str, target: str, backend) -> tuple[Path, list]:
    """Compile (or reuse) the model library for ``cfg``; returns its path and named parameter specs.

    The library is an entry of pagedkv's disk cache (``pagedkv.kernel_cache.load_or_build``): built in a
    temporary folder and renamed into place under a lock, so two chats started at once compile once, and a
    compile that is interrupted or fails leaves nothing a later run would take for a library."""
    from ..compile import build_library
    from ..cpu_pipeline import SCHEDULE_VERSION
    from ..engine import param_names
    from ..kernel_cache import load_or_build, lookup
    from ..models.llama import LlamaForCausalLM

    # The schedules' version is in the key as well as their source: a library compiled with other
    # schedules (or none, before pagedkv.cpu_pipeline) is never reused.
    key = hashlib.sha256(repr((cfg, dtype, target, backend, SCHEDULE_VERSION, _source_digest())).encode())
    key = key.hexdigest()[:20]
    found = lookup(cache_dir(), key, prefix=MODEL_PREFIX)
    if found is not None:
        print(f"[pagedkv] reusing compiled library {found}", flush=True)
        return found, param_names(found)
    named: list = []

    def build(path: Path, progress) -> None:
        model = LlamaForCausalLM(cfg, dtype=dtype, target=target, backend=backend)
        named[:] = build_library(model, target, path, verbose=True, progress=progress)[1]

    kind = target if isinstance(target, str) else target.kind.name
    path = load_or_build(cache_dir(), key, build, what=f"the model for {kind}", prefix=MODEL_PREFIX)
    return path, named or param_names(path)  # another process built it while this one waited: read its names


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
    from ..progress import Progress

    print(f"[pagedkv] model file: {smollm2.gguf_path()}", flush=True)
    with Progress("loading and dequantizing the GGUF weights"):
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
