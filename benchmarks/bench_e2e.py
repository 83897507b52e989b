"""SmolLM2-135M end to end: pagedkv against HF transformers on the same prompts, in one process.

Each batch of ``b`` sequences prefills ``--prompt-len`` tokens per sequence (one forward for all of them) and
then decodes ``--new-tokens`` greedy tokens in lockstep (no stop at EOS). Reported per batch and system:
prefill tokens/s (``b * prompt_len / prefill time``), decode tokens/s (``b * (new_tokens - 1) / decode
time``; the first new token comes from the prefill's logits) and the ratio to transformers' eager run.

Fairness: both run in this process with the same thread count (``torch.set_num_threads`` and TVM's pool,
``TVM_NUM_THREADS``, set before TVM starts), the same dtype and the same token ids. Every system runs once
untimed per batch (warm-up, compilation of transformers' static-cache graph), then ``--rounds`` timed rounds
interleave the systems, alternating their order; the median round is reported. A system is timed only where
its greedy tokens equal transformers' eager tokens: a divergence prints where, with transformers' top-2
logit margin there, that system gets no time at that batch (nor does one that raises, which is also left out
of later batches), the others are still timed and the run exits 1 (``--tie-margin m`` accepts a divergence
at a margin below ``m``; by default 0.25 for float16 / bfloat16 and on the GPU, 0 for float32 on the CPU).

Memory: the host's read bandwidth (a sum over 1 GiB) and copy bandwidth (a 512 MiB copy, read + write) are
measured first; the decode roof is ``read bandwidth / bytes of weights one decode step reads`` (every
projection and the logits head, not the embedding table, of which a step reads ``b`` rows).

CPU (default): batches 1 and 4, float32. ``--device cuda`` (batches 1, 8, 32, float16): pagedkv runs the
CUDA model library ``--model-lib`` (``make gpu-bundle`` writes ``.gpu/models/smollm2-float16-cuda.so``) and,
as a second system ``pagedkv+graphs``, the CUDA-graph decode library ``--graph-lib`` (by default
``smollm2-float16-graph-cuda.so`` beside it, when it exists); transformers runs both eager and with a static
cache whose decode step is ``torch.compile(mode="reduce-overhead")`` (``--hf-static`` also on the CPU, to
check its logic there). Besides tokens/s, the table gives pagedkv+graphs / pagedkv and each pagedkv system
over transformers static compiled and over eager. llama-cpp-python is not a column: PyPI has no wheel of it
for this host (sdist only; building llama.cpp from source on the 2-core host takes far longer than a run).

Writes ``benchmarks/results/bench_e2e_<device>.json``, ``.md`` (the table) and ``.png`` (``--out`` elsewhere).

``--dtypes float32,float16,bfloat16`` runs the whole benchmark once per dtype (files ``bench_e2e_<device>_<dtype>.*``,
each dtype's transformers the reference of its tokens), then times pagedkv of every dtype whose tokens were right
again, the dtypes interleaved round by round (the per-dtype runs are minutes apart, and on a shared host the load
moves in between), prints its prefill and decode tokens/s of each dtype over the first one's, per batch
(``pagedkv float16 / float32 at batch 1: ...``), and writes them to ``bench_e2e_<device>_dtypes.json``.

Usage: ``.venv/bin/python benchmarks/bench_e2e.py [--device cuda --model-lib PATH --graph-lib PATH]
[--rounds 3]``; on the GPU host ``make bench-e2e-gpu`` (after ``make gpu-assemble``).
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
import traceback
from dataclasses import dataclass


ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The reference every system's greedy tokens are checked against.
REF = "hf_eager"
#: (numerator, denominator) of the printed ratios, where both systems ran with the right tokens.
RATIOS = [("pagedkv+graphs", "pagedkv"), ("pagedkv", "hf_static_compiled"),
          ("pagedkv+graphs", "hf_static_compiled"), ("pagedkv", "hf_eager"), ("pagedkv+graphs", "hf_eager")]


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
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=None,
                    help="comma-separated dtypes: one run per dtype, then pagedkv's tokens/s of each over the "
                         "first's (e.g. float32,float16,bfloat16)")
    ap.add_argument("--model-lib", default=None, help="CUDA: pagedkv's model library (default: "
                    "$PAGEDKV_MODEL_DIR or .gpu/models, smollm2-<dtype>-cuda.so)")
    ap.add_argument("--graph-lib", default=None,
                    help="CUDA: a second pagedkv system, pagedkv+graphs, running this model library (CUDA-graph "
                         "decode) the same way (default: smollm2-<dtype>-graph-cuda.so in $PAGEDKV_MODEL_DIR or "
                         ".gpu/models if it exists; 'none' leaves it out)")
    ap.add_argument("--hf-static", action=argparse.BooleanOptionalAction, default=None,
                    help="also time transformers with a static cache and a torch.compile(mode='reduce-overhead') "
                         "decode step (default: on CUDA only; on the CPU it has no CUDA graphs, but it checks "
                         "that system's logic)")
    ap.add_argument("--tie-margin", type=float, default=None,
                    help="accept a token divergence where transformers' top-2 margin is below this "
                         "(default 0 for float32 on the CPU, 0.25 on CUDA and for float16 / bfloat16)")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    distinct = args.dtypes is None or len(set(args.dtypes)) == len(args.dtypes) >= 2
    if args.dtypes is not None and (args.dtype is not None or not distinct):
        ap.error("--dtypes: two or more different dtypes, the first the baseline, without --dtype")
    args.batches = args.batches or ([1, 8, 32] if cuda else [1, 4])
    args.dtype = (args.dtypes[0] if args.dtypes else args.dtype) or ("float16" if cuda else "float32")
    args.tie_margin_default = args.tie_margin is None  # --dtypes: then each dtype gets its own default
    args.tie_margin = default_tie_margin(args.device, args.dtype) if args.tie_margin is None else args.tie_margin
    args.hf_static = cuda if args.hf_static is None else args.hf_static
    if args.rounds < 1 or args.new_tokens < 2 or min(args.batches) < 1:
        ap.error("--rounds >= 1, --new-tokens >= 2 and batches >= 1")
    if len(set(args.batches)) != len(args.batches):
        ap.error(f"--batches {args.batches}: each batch size once (results are keyed by it)")
    if not cuda and (args.model_lib or args.graph_lib not in (None, "none")):
        ap.error("--model-lib and --graph-lib are CUDA model libraries (the CPU compiles its own)")
    return args


def default_tie_margin(device: str, dtype: str) -> float:
    """0 for float32 on the CPU (the same sums in another order: only a real tie may differ); 0.25 on CUDA
    and for half dtypes, whose rounded logits tie or nearly tie often (a bfloat16 logit near 20 moves in
    steps of 0.125), so two correct systems part at such a token."""
    return 0.0 if device == "cpu" and dtype == "float32" else 0.25


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # TVM's thread pool reads this when it starts (first parallel call): before any TVM import.
    os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _e2e_systems import HFEager, HFStatic, Ours, Run  # noqa: E402


def model_dir() -> pathlib.Path:
    """Where the CUDA model libraries lie: ``$PAGEDKV_MODEL_DIR``, else the checkout's ``.gpu/models``."""
    return pathlib.Path(os.environ.get("PAGEDKV_MODEL_DIR") or ROOT / ".gpu" / "models")


def pagedkv_libs(args) -> dict[str, pathlib.Path | None]:
    """System name -> model library of each pagedkv system (None: compiled here, on the CPU). Checked
    before transformers loads the model, so a missing library fails in seconds, naming the path."""
    if args.device == "cpu":
        return {"pagedkv": None}
    libs = {"pagedkv": pathlib.Path(args.model_lib) if args.model_lib
            else model_dir() / f"smollm2-{args.dtype}-cuda.so"}
    if args.graph_lib is None:
        default = model_dir() / f"smollm2-{args.dtype}-graph-cuda.so"
        if default.is_file():
            libs["pagedkv+graphs"] = default
        else:
            print(f"[bench_e2e] no CUDA-graph model library at {default}: pagedkv+graphs left out", flush=True)
    elif args.graph_lib != "none":
        libs["pagedkv+graphs"] = pathlib.Path(args.graph_lib)
    for name, lib in libs.items():
        for path in (lib, lib.with_suffix(".json")):  # the .json beside it holds the parameter order
            if not path.is_file():
                raise SystemExit(f"[bench_e2e] {name}: no {path} (make gpu-bundle writes the model libraries "
                                 "into .gpu/models)")
    return libs


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


def check_tokens(runs: dict[str, Run], ref: str, tok, tie_margin: float) -> dict[str, list[str]]:
    """System name -> its problems, for each system whose greedy tokens differ from ``ref``'s (other than
    at an accepted near tie); empty when every system agrees."""
    problems, base = {}, runs[ref]
    for name, run in runs.items():
        if len(run.tokens) != len(base.tokens):
            problems.setdefault(name, []).append(f"{name}: {len(run.tokens)} sequences, {ref} {len(base.tokens)}")
            continue
        for s, (ours, theirs) in enumerate(zip(run.tokens, base.tokens)):
            j = next((k for k in range(len(theirs)) if k >= len(ours) or ours[k] != theirs[k]), None)
            if j is None:
                continue
            if j >= len(ours):
                problems.setdefault(name, []).append(f"{name}: sequence {s} has {len(ours)} tokens, "
                                                     f"{ref} {len(theirs)}")
                continue
            margin = base.margins[s][j]
            what = (f"{name} vs {ref}: sequence {s} diverges at new token {j}: {ours[j]} "
                    f"({tok.decode([ours[j]])!r}) vs {theirs[j]} ({tok.decode([theirs[j]])!r}); "
                    f"{ref}'s top-2 margin there {margin:.4f}")
            if margin >= tie_margin:
                problems.setdefault(name, []).append(what)
            else:
                print(f"[bench_e2e] accepted near tie: {what}")
    return problems


def _warm_up(systems: dict, ids, args, broken: set) -> tuple[dict[str, Run], dict[str, list[str]]]:
    """One untimed run per system (compilation, graph capture). A system that raises is reported and added
    to ``broken`` (a raise is rarely a matter of one batch, and a CUDA error can poison later calls), not
    fatal, except the reference, without which nothing can be checked."""
    warm, failed = {}, {}
    for name, system in systems.items():
        try:
            warm[name] = system.run(ids, args.new_tokens)
        except Exception as err:  # noqa: BLE001 (one broken system must not hide the others' numbers)
            if name == REF:
                raise
            traceback.print_exc()
            failed[name] = [f"{name}: raised {type(err).__name__}: {err}"]
            broken.add(name)
    return warm, failed


def measure(systems: dict, ids, args, tok, broken: set | None = None) -> tuple[dict, dict[str, list[str]]]:
    """Warm-up + token check, then ``rounds`` interleaved timed runs of each system whose tokens equal the
    reference's. Returns (system name -> its runs, for the right systems; name -> problems, for the
    others): a wrong system gets no time, and a timed round whose tokens differ from the warm-up's drops
    its system too. Systems that raised are added to ``broken``."""
    warm, failed = _warm_up(systems, ids, args, set() if broken is None else broken)
    failed.update(check_tokens(warm, REF, tok, args.tie_margin))
    good = [name for name in systems if name not in failed]
    runs: dict[str, list[Run]] = {name: [] for name in good}
    for r in range(args.rounds):
        for name in (good if r % 2 == 0 else good[::-1]):
            if name in failed:
                continue
            run = systems[name].run(ids, args.new_tokens)
            if run.tokens != warm[name].tokens:
                failed[name] = [f"{name}: round {r} produced other tokens than its warm-up"]
                continue
            runs[name].append(run)
    return {name: rs for name, rs in runs.items() if name not in failed}, failed


def summarize(runs: dict[str, list[Run]], batch: int, args) -> dict:
    """System name -> median prefill and decode tokens/s (and every round's seconds), with the ratios to
    transformers' eager run when it is there."""
    rows = {}
    for name, rs in runs.items():
        pre = statistics.median(r.prefill_s for r in rs)
        dec = statistics.median(r.decode_s for r in rs)
        rows[name] = {"prefill_tok_s": batch * args.prompt_len / pre,
                      "decode_tok_s": batch * (args.new_tokens - 1) / dec,
                      "prefill_s": [r.prefill_s for r in rs], "decode_s": [r.decode_s for r in rs],
                      "host_argmax_ms_per_step": 1e3 * statistics.median(r.host_argmax_s for r in rs)
                      / (args.new_tokens - 1)}
    hf = rows.get(REF)
    for row in rows.values():
        if hf:
            row["prefill_vs_hf"] = row["prefill_tok_s"] / hf["prefill_tok_s"]
            row["decode_vs_hf"] = row["decode_tok_s"] / hf["decode_tok_s"]
    return rows


def ratios(rows: dict) -> dict[str, dict[str, float]]:
    """``"a / b"`` -> prefill and decode tokens/s of ``a`` over ``b``, for the pairs of RATIOS that both ran
    with the right tokens."""
    return {f"{a} / {b}": {"prefill": rows[a]["prefill_tok_s"] / rows[b]["prefill_tok_s"],
                           "decode": rows[a]["decode_tok_s"] / rows[b]["decode_tok_s"]}
            for a, b in RATIOS if a in rows and b in rows}


def table(results: dict, failures: dict, bw: dict, weight_bytes: int) -> list[str]:
    """The report (Markdown): tokens/s per batch and system, then the ratios. A system that failed at a
    batch (wrong tokens, raised) shows why, never a time."""
    roof = bw["read_GBps"] * 1e9 / weight_bytes
    out = [f"memory: read {bw['read_GBps']:.1f} GB/s, copy {bw['copy_GBps']:.1f} GB/s; one decode step reads "
           f"{weight_bytes / 1e9:.3f} GB of weights -> decode roof {roof:.1f} tokens/s per sequence at batch 1",
           "", "| batch | system | prefill tok/s | decode tok/s | decode / roof |", "|---|---|---|---|---|"]
    for batch, rows in results.items():
        for name, row in rows.items():
            out.append(f"| {batch} | {name} | {row['prefill_tok_s']:.1f} | {row['decode_tok_s']:.1f} | "
                       f"{row['decode_tok_s'] / (roof * batch):.2f} |")
        for name in failures.get(batch, {}):
            out.append(f"| {batch} | {name} | failed | failed | - |")
    out.append("(decode / roof: decode tokens/s over batch x the batch-1 roof, which bounds a memory-bound step)")
    host = [f"batch {b} {row['host_argmax_ms_per_step']:.3f}" for b, rows in results.items()
            for name, row in rows.items() if name == "pagedkv" and row['host_argmax_ms_per_step'] > 0]
    if host:
        out.append("(pagedkv's decode time includes its engine's copy of the logits to the host and, of it, "
                   f"a host argmax taking ms per step: {', '.join(host)})")
    out += ["", "| batch | ratio | prefill | decode |", "|---|---|---|---|"]
    for batch, rows in results.items():
        for pair, r in ratios(rows).items():
            out.append(f"| {batch} | {pair} | {r['prefill']:.2f}x | {r['decode']:.2f}x |")
    for batch, fails in failures.items():
        for name, problems in fails.items():
            out.append(f"FAILED at batch {batch}: " + "; ".join(problems))
    return out


def plot(results: dict, path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    batches = list(results)
    names = list(dict.fromkeys(n for rows in results.values() for n in rows))  # a wrong system has no bar
    width = 0.8 / max(1, len(names))
    for ax, key, label in ((axes[0], "prefill_tok_s", "prefill tokens/s"),
                           (axes[1], "decode_tok_s", "decode tokens/s")):
        for i, name in enumerate(names):
            ax.bar([b + i * width for b in range(len(batches))],
                   [results[b][name][key] if name in results[b] else 0.0 for b in batches], width, label=name)
        ax.set_xticks([b + width * (len(names) - 1) / 2 for b in range(len(batches))],
                      [f"batch {b}" for b in batches])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_systems(args) -> tuple[dict, object, int, dict[str, list[str]]]:
    """(name -> system, tokenizer, bytes of weights a decode step reads, name -> problems of the systems
    that could not be set up): pagedkv's (one per model library), transformers eager, and transformers
    static + compiled when asked. Only pagedkv+graphs may fail to set up without ending the run."""
    from pagedkv.apps import smollm2

    libs = pagedkv_libs(args)
    hf, tok = smollm2.load_hf(dtype=getattr(torch, args.dtype))
    hf = hf.to(args.device)
    systems, broken = {}, {}
    for name, lib in libs.items():
        try:
            systems[name] = Ours.create(hf, args, lib)
        except Exception as err:  # noqa: BLE001 (a new library must not hide the other systems' numbers)
            if name == "pagedkv":
                raise
            traceback.print_exc()
            broken[name] = [f"{name}: setting up {lib} raised {type(err).__name__}: {err}"]
    weight_bytes = systems["pagedkv"].weight_bytes
    systems[REF] = HFEager(hf, args.device)
    if args.hf_static:
        systems["hf_static_compiled"] = HFStatic(hf, args.device)
    return systems, tok, weight_bytes, broken


def _meta(args, bw: dict, weight_bytes: int, systems: dict) -> dict:
    import transformers

    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "cpu": platform.processor(),
            "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_compile_counters": compile_counters(),
            "load_average": os.getloadavg(), "args": dict(vars(args)), "systems": list(systems),
            "libraries": {n: str(s.engine.lib_path) for n, s in systems.items() if isinstance(s, Ours)},
            "bandwidth": bw, "weight_bytes": weight_bytes,
            "roof_tok_s_batch1": bw["read_GBps"] * 1e9 / weight_bytes}


def compile_counters() -> dict:
    """torch.compile's counters of this process (graphs, graph breaks, CUDA-graph skips), to tell whether
    hf_static_compiled really replayed CUDA graphs."""
    from torch._dynamo.utils import counters

    keep = ("frames", "stats", "graph_break", "inductor")
    return {k: {str(n): int(v) for n, v in counters[k].items()} for k in keep if counters.get(k)}


def write_outputs(out: pathlib.Path, args, meta: dict, results: dict, failures: dict, lines: list[str]) -> None:
    """``bench_e2e_<device>.json`` (every round's times, the ratios, the failures), ``.md`` (the table) and
    ``.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (f"bench_e2e_{args.device}" + (f"_{args.dtype}" if args.dtypes else ""))
    doc = {"meta": meta, "results": results, "ratios": {b: ratios(rows) for b, rows in results.items()},
           "failures": failures}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(results, stem.with_suffix(".png"), f"SmolLM2-135M {args.dtype} on {meta['gpu'] or args.device}")
    print(f"wrote {stem}.json, .md and .png")


def dtype_ratios(per_dtype: dict[str, dict]) -> dict[str, dict]:
    """``"<dtype> / <first dtype>"`` -> batch -> pagedkv's prefill and decode tokens/s over the first dtype's,
    for the batches where both were timed (``per_dtype``: dtype -> batch -> pagedkv's row)."""
    base, *others = per_dtype
    return {f"{dt} / {base}": {b: {"prefill": row["prefill_tok_s"] / per_dtype[base][b]["prefill_tok_s"],
                                   "decode": row["decode_tok_s"] / per_dtype[base][b]["decode_tok_s"]}
                               for b, row in per_dtype[dt].items() if b in per_dtype[base]}
            for dt in others}


def interleave(ours: dict, tok, args: argparse.Namespace) -> dict[str, dict]:
    """dtype -> batch -> pagedkv's row (``summarize``), timed with the dtypes interleaved: a warm-up each, then
    ``rounds`` rounds that run every dtype once, alternating their order. A run whose tokens differ from its
    warm-up's drops its dtype at that batch. (``ours``: dtype -> its pagedkv system, tokens already checked.)"""
    out: dict[str, dict] = {dt: {} for dt in ours}
    for batch in args.batches:
        ids = prompts(tok, batch, args.prompt_len)
        warm = {dt: system.run(ids, args.new_tokens).tokens for dt, system in ours.items()}
        runs: dict[str, list | None] = {dt: [] for dt in ours}
        for r in range(args.rounds):
            for dt in (list(ours) if r % 2 == 0 else list(ours)[::-1]):
                if runs[dt] is not None:
                    run = ours[dt].run(ids, args.new_tokens)
                    runs[dt] = runs[dt] + [run] if run.tokens == warm[dt] else None
        for dt, row in summarize({dt: rs for dt, rs in runs.items() if rs}, batch, args).items():
            out[dt][batch] = row
    return out


def compare_dtypes(args: argparse.Namespace) -> int:
    """``--dtypes``: the benchmark once per dtype (tokens checked against transformers in that dtype), then
    pagedkv of each dtype right at every batch timed again with the dtypes interleaved (``interleave``: on a
    shared host the load moves between the per-dtype runs), and its ratios to the first dtype printed."""
    ours, rc, tok = {}, 0, None
    for dt in args.dtypes:
        tie = default_tie_margin(args.device, dt) if args.tie_margin_default else args.tie_margin
        outcome = bench(argparse.Namespace(**{**vars(args), "dtype": dt, "tie_margin": tie}))
        rc, tok = rc or outcome.rc, outcome.tok
        if all("pagedkv" in outcome.results.get(b, {}) for b in args.batches):
            ours[dt] = outcome.ours
    print(f"[bench_e2e] pagedkv interleaved: {', '.join(ours) or 'no dtype'} ...", flush=True)
    per_dtype = interleave(ours, tok, args) if args.dtypes[0] in ours else {}
    lines = []
    for pair, by_batch in (dtype_ratios(per_dtype) if per_dtype else {}).items():
        dt = pair.split(" / ")[0]
        for b, r in by_batch.items():
            row = per_dtype[dt][b]
            lines.append(f"pagedkv {pair} at batch {b}: prefill {r['prefill']:.2f}x, decode {r['decode']:.2f}x "
                         f"({dt}: prefill {row['prefill_tok_s']:.1f}, decode {row['decode_tok_s']:.1f} tokens/s)")
    print("\n[bench_e2e] " + "\n[bench_e2e] ".join(lines or ["no dtype pair was timed"]))
    out = pathlib.Path(args.out) if args.out else ROOT / "benchmarks" / "results"
    ratios_ = dtype_ratios(per_dtype) if per_dtype else {}
    (out / f"bench_e2e_{args.device}_dtypes.json").write_text(json.dumps(
        {"args": dict(vars(args)), "load_average": os.getloadavg(), "pagedkv": per_dtype, "ratios": ratios_,
         "lines": lines}, indent=2))
    return rc


def main(args: argparse.Namespace) -> int:
    """The benchmark (``--dtypes``: once per dtype, see ``compare_dtypes``); 1 where a system failed."""
    return compare_dtypes(args) if args.dtypes else bench(args).rc


@dataclass(frozen=True)
class Outcome:
    """One ``bench`` run: 1 where a system failed else 0, batch -> system -> its row, pagedkv's system (None
    if it could not be set up) and the tokenizer."""

    rc: int
    results: dict
    ours: object
    tok: object


def bench(args: argparse.Namespace) -> Outcome:
    """One run at ``args.dtype``."""
    torch.set_num_threads(args.threads)
    print(f"[bench_e2e] {args.device}, {args.dtype}, {args.threads} threads (torch and TVM), "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {args.rounds} rounds", flush=True)
    bw = bandwidth(args.device)
    systems, tok, weight_bytes, unset = build_systems(args)
    results, failures, broken = {}, {}, set()
    for batch in args.batches:
        ids = prompts(tok, batch, args.prompt_len)
        active = {name: s for name, s in systems.items() if name not in broken}
        print(f"[bench_e2e] batch {batch}: {', '.join(active)} ...", flush=True)
        runs, failed = measure(active, ids, args, tok, broken)
        failed = {**unset, **failed}
        results[batch] = summarize(runs, batch, args)
        if failed:
            failures[batch] = failed
            print(f"[bench_e2e] batch {batch}: failed, no time reported:\n  "
                  + "\n  ".join(p for ps in failed.values() for p in ps), flush=True)
    if not failures:
        print("[bench_e2e] greedy tokens: identical for every system and batch")
    skips = compile_counters().get("inductor", {}).get("cudagraph_skips", 0)
    if args.hf_static and args.device == "cuda" and skips:
        print(f"[bench_e2e] WARNING: torch.compile skipped CUDA graphs {skips} time(s): hf_static_compiled ran "
              "(partly) without them (TORCH_LOGS=perf_hints says why)")
    lines = table(results, failures, bw, weight_bytes)
    print("\n" + "\n".join(lines))
    out = pathlib.Path(args.out) if args.out else ROOT / "benchmarks" / "results"
    write_outputs(out, args, _meta(args, bw, weight_bytes, systems), results, failures, lines)
    return Outcome(1 if failures else 0, results, systems.get("pagedkv"), tok)


if __name__ == "__main__":
    sys.exit(main(ARGS))
