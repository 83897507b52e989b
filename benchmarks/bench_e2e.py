"""SmolLM2-135M end to end: pagedkv against HF transformers on the same prompts, in one process.

Each batch of ``b`` sequences prefills ``--prompt-len`` tokens per sequence (one forward for all of them) and
then decodes ``--new-tokens`` greedy tokens in lockstep (no stop at EOS). Reported per batch and system:
prefill tokens/s (``b * prompt_len / prefill time``), decode tokens/s (``b * (new_tokens - 1) / decode
time``; the first new token comes from the prefill's logits) and the ratio to transformers' eager run.

Fairness: both run in this process with the same thread count (``torch.set_num_threads`` and TVM's pool,
``TVM_NUM_THREADS``, set before TVM starts), the same dtype and the same token ids. Every system runs once
untimed per batch (warm-up, compilation of transformers' static-cache graph), then ``--rounds`` timed rounds
interleave the systems, alternating their order; the median round is reported. Before any time is printed
the greedy tokens of every system must equal transformers' eager tokens: a divergence prints where, with
transformers' top-2 logit margin there, and exits 1 (``--tie-margin m`` accepts a divergence at a margin
below ``m``, for float16 on the GPU).

Memory: the host's read bandwidth (a sum over 1 GiB) and copy bandwidth (a 512 MiB copy, read + write) are
measured first; the decode roof is ``read bandwidth / bytes of weights one decode step reads`` (every
projection and the logits head, not the embedding table, of which a step reads ``b`` rows).

CPU (default): batches 1 and 4, float32. ``--device cuda`` (batches 1, 8, 32, float16): pagedkv runs the
CUDA model library ``--model-lib`` (``make gpu-bundle`` writes ``.gpu/models/smollm2-float16-cuda.so``), and
transformers runs both eager and with a static cache whose decode step is
``torch.compile(mode="reduce-overhead")``. llama-cpp-python is not a column: PyPI has no wheel of it for
this host (sdist only; building llama.cpp from source on the 2-core host takes far longer than a run).

Writes ``benchmarks/results/bench_e2e_<device>.json`` and ``.png``.

Usage: ``.venv/bin/python benchmarks/bench_e2e.py [--device cuda --model-lib PATH] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated batch sizes (default: 1,4 on the CPU, 1,8,32 on CUDA)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or float16 (CUDA default)")
    ap.add_argument("--model-lib", default=None, help="CUDA: pagedkv's model library (default: "
                    "$PAGEDKV_MODEL_DIR or .gpu/models, smollm2-float16-cuda.so)")
    ap.add_argument("--tie-margin", type=float, default=None,
                    help="accept a token divergence where transformers' top-2 margin is below this "
                         "(default 0 on the CPU, 0.25 on CUDA)")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.batches = args.batches or ([1, 8, 32] if cuda else [1, 4])
    args.dtype = args.dtype or ("float16" if cuda else "float32")
    args.tie_margin = args.tie_margin if args.tie_margin is not None else (0.25 if cuda else 0.0)
    if args.rounds < 1 or args.new_tokens < 2:
        ap.error("--rounds >= 1 and --new-tokens >= 2")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # TVM's thread pool reads this when it starts (first parallel call): before any TVM import.
    os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _e2e_systems import HFEager, HFStatic, Ours, Run  # noqa: E402

#: Plain prose the prompts are cut from (windows at different offsets, so every sequence differs).
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps out of habit. "
    "There were one hundred and twelve of them, worn smooth in the middle by more than a century of boots. "
    "At the top he trimmed the wick, polished the great lens, and wrote the weather in a leather logbook: "
    "wind from the north-east, a heavy swell, two fishing boats returning late to the harbour below. "
    "In winter the storms came in from the open ocean and shook the windows until the glass sang, and on "
    "those nights he stayed awake until morning, listening to the waves break against the rocks. "
    "The village children believed he could speak to the gulls, and he never told them otherwise. "
    "When the supply boat arrived each month it brought flour, lamp oil, newspapers a week out of date, "
    "and letters from his sister, who lived in the city and wrote about trams, theatres and the price of "
    "bread. He answered every letter the same evening, describing the colour of the sea, the ships he had "
    "seen pass, and the small repairs he had made to the tower, the boat shed and the garden wall. "
    "Years later, when the light was automated and the keeper moved to the mainland, the logbooks were "
    "sent to the maritime museum, where visitors still read his careful handwriting about wind and waves."
)


def prompts(tok, batch: int, length: int) -> list[list[int]]:
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    if len(ids) <= length:
        raise ValueError(f"the text has {len(ids)} tokens: too few for prompts of {length}")
    step = max(1, (len(ids) - length) // batch)
    return [ids[i * step % (len(ids) - length):][:length] for i in range(batch)]


def bandwidth(device: str) -> dict:
    """Read (sum over 1 GiB) and copy (512 MiB, read + write) bandwidth in GB/s, best of 3."""
    dev = torch.device(device)
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32, device=dev)
    y = torch.empty(128 * 1024 * 1024, dtype=torch.float32, device=dev)

    def best(fn, nbytes):
        times = []
        for _ in range(4):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t)
        return nbytes / min(times[1:]) / 1e9

    read = best(lambda: x.sum(), x.numel() * 4)
    copy = best(lambda: y.copy_(x[: y.numel()]), 2 * y.numel() * 4)
    return {"read_GBps": read, "copy_GBps": copy}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def check_tokens(runs: dict[str, Run], ref: str, tok, tie_margin: float) -> list[str]:
    """Problems (empty: every system's greedy tokens equal ``ref``'s, up to accepted near ties)."""
    problems, base = [], runs[ref]
    for name, run in runs.items():
        for s, (ours, theirs) in enumerate(zip(run.tokens, base.tokens)):
            j = next((k for k in range(len(theirs)) if ours[k] != theirs[k]), None)
            if j is None:
                continue
            margin = base.margins[s][j]
            what = (f"{name} vs {ref}: sequence {s} diverges at new token {j}: {ours[j]} "
                    f"({tok.decode([ours[j]])!r}) vs {theirs[j]} ({tok.decode([theirs[j]])!r}); "
                    f"{ref}'s top-2 margin there {margin:.4f}")
            if margin >= tie_margin:
                problems.append(what)
            else:
                print(f"[bench_e2e] accepted near tie: {what}")
    return problems


def measure(systems: dict, batch: int, ids, args, tok) -> dict[str, list[Run]]:
    """Warm-up + token check, then ``rounds`` interleaved timed runs per system."""
    warm = {name: sys_.run(ids, args.new_tokens) for name, sys_ in systems.items()}
    problems = check_tokens(warm, "hf_eager", tok, args.tie_margin)
    if problems:
        print("[bench_e2e] greedy tokens differ; no timing is reported:\n  " + "\n  ".join(problems))
        sys.exit(1)
    runs: dict[str, list[Run]] = {name: [] for name in systems}
    names = list(systems)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            run = systems[name].run(ids, args.new_tokens)
            if run.tokens != warm[name].tokens:
                print(f"[bench_e2e] {name}: round {r} produced other tokens than its warm-up; no timing")
                sys.exit(1)
            runs[name].append(run)
    return runs


def summarize(runs: dict[str, list[Run]], batch: int, args) -> dict:
    rows = {}
    for name, rs in runs.items():
        pre = statistics.median(r.prefill_s for r in rs)
        dec = statistics.median(r.decode_s for r in rs)
        rows[name] = {"prefill_tok_s": batch * args.prompt_len / pre,
                      "decode_tok_s": batch * (args.new_tokens - 1) / dec,
                      "prefill_s": [r.prefill_s for r in rs], "decode_s": [r.decode_s for r in rs]}
    hf = rows["hf_eager"]
    for row in rows.values():
        row["prefill_vs_hf"] = row["prefill_tok_s"] / hf["prefill_tok_s"]
        row["decode_vs_hf"] = row["decode_tok_s"] / hf["decode_tok_s"]
    return rows


def print_table(results: dict, bw: dict, weight_bytes: int, args) -> None:
    roof = bw["read_GBps"] * 1e9 / weight_bytes
    print(f"\nmemory: read {bw['read_GBps']:.1f} GB/s, copy {bw['copy_GBps']:.1f} GB/s; one decode step reads "
          f"{weight_bytes / 1e9:.3f} GB of weights -> decode roof {roof:.1f} tokens/s per sequence at batch 1")
    print("\n| batch | system | prefill tok/s | decode tok/s | prefill vs HF | decode vs HF | decode / roof |")
    print("|---|---|---|---|---|---|---|")
    for batch, rows in results.items():
        for name, row in rows.items():
            print(f"| {batch} | {name} | {row['prefill_tok_s']:.1f} | {row['decode_tok_s']:.1f} | "
                  f"{row['prefill_vs_hf']:.2f}x | {row['decode_vs_hf']:.2f}x | "
                  f"{row['decode_tok_s'] / (roof * batch):.2f} |")
    print("(decode / roof: decode tokens/s over batch x the batch-1 roof, which bounds a memory-bound step)")


def plot(results: dict, path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    batches = list(results)
    names = list(next(iter(results.values())))
    width = 0.8 / len(names)
    for ax, key, label in ((axes[0], "prefill_tok_s", "prefill tokens/s"),
                           (axes[1], "decode_tok_s", "decode tokens/s")):
        for i, name in enumerate(names):
            ax.bar([b + i * width for b in range(len(batches))], [results[b][name][key] for b in batches],
                   width, label=name)
        ax.set_xticks([b + width * (len(names) - 1) / 2 for b in range(len(batches))],
                      [f"batch {b}" for b in batches])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> int:
    from pagedkv.apps import smollm2

    torch.set_num_threads(args.threads)
    print(f"[bench_e2e] {args.device}, {args.dtype}, {args.threads} threads (torch and TVM), "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {args.rounds} rounds", flush=True)
    bw = bandwidth(args.device)
    hf, tok = smollm2.load_hf(dtype=getattr(torch, args.dtype))
    hf = hf.to(args.device)
    ours = Ours.create(hf, args)
    systems = {"pagedkv": ours, "hf_eager": HFEager(hf, args.device)}
    if args.device == "cuda":
        systems["hf_static_compiled"] = HFStatic(hf, args.device)
    results = {}
    for batch in args.batches:
        ids = prompts(tok, batch, args.prompt_len)
        print(f"[bench_e2e] batch {batch} ...", flush=True)
        results[batch] = summarize(measure(systems, batch, ids, args, tok), batch, args)
    print("[bench_e2e] greedy tokens: identical for every system and batch")
    print_table(results, bw, ours.weight_bytes, args)
    out = pathlib.Path(args.out) if args.out else ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_e2e_{args.device}"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "cpu": platform.processor(),
            "load_average": os.getloadavg(), "args": {k: v for k, v in vars(args).items()},
            "bandwidth": bw, "weight_bytes": ours.weight_bytes,
            "roof_tok_s_batch1": bw["read_GBps"] * 1e9 / ours.weight_bytes}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    plot(results, stem.with_suffix(".png"), f"SmolLM2-135M {args.dtype} on {args.device}, {args.threads} threads")
    print(f"wrote {stem.with_suffix('.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
