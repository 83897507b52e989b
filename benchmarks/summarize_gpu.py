"""``python benchmarks/summarize_gpu.py bench_gpu.json``: the markdown tables of one ``bench_gpu.py`` run, for
its section in the run log ``benchmarks/HISTORY.md``: per workload FlashInfer's best variant, pagedkv (FlashInfer
and TIR backends), apache-tvm 0.27's kernels and torch SDPA as ratios to that best (>= 1: as fast or faster), a
text plot of the pagedkv columns against 1.0, and the host cost. The run's key ratios then go into the GPU rows of
the scoreboard ``BENCHMARKS.md`` and the table of ``tools/plot_scoreboard.py`` (replot)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def peers(rows: list[dict]) -> list[str]:
    """The columns: every implementation the run timed but FlashInfer's own variants, in the run's order."""
    return list(dict.fromkeys(r["impl"] for r in rows if not r["impl"].startswith("fi:")))


def _cell(r) -> str:
    return f"{r['vs_fi_best']:.3f}" if r and "vs_fi_best" in r else "-"


def fi_best(impls: dict) -> dict | None:
    """FlashInfer's fastest variant among those that count (``in_fi_best``; JSON of older runs has no flag)."""
    fi = [r for k, r in impls.items() if k.startswith("fi:") and "ms" in r and r.get("in_fi_best", True)]
    return min(fi, key=lambda r: r["ms"]) if fi else None


def _by_workload(rows: list[dict]) -> dict:
    by = {}
    for r in rows:
        by.setdefault(r["workload"], {})[r["impl"]] = r
    return by


def text_plot(rows: list[dict], labels=("pagedkv-fi", "pagedkv-tir"), width: int = 40) -> str:
    """One bar per workload and label: its speed as a fraction of FlashInfer's best, ``|`` at 1.0 (bars
    past it are capped at 1.25)."""
    out = ["```", f"speed / FlashInfer's best ({', '.join(labels)}); '|' marks 1.0"]
    for name, impls in _by_workload(rows).items():
        for label in labels:
            r = impls.get(label)
            if not r or not math.isfinite(r.get("vs_fi_best", math.nan)):
                continue
            v = r["vs_fi_best"]
            n = round(min(v, 1.25) * width)
            bar = "".join("|" if i == width else ("#" if i < n else " ") for i in range(max(n, width + 1)))
            out.append(f"{name:34s} {label:12s} {bar} {v:.3f}")
    out.append("```")
    return "\n".join(out)


def workload_table(rows: list[dict]) -> str:
    by, cols = _by_workload(rows), peers(rows)
    out = ["| workload | FI best (ms) | rate | " + " | ".join(cols) + " |",
           "|---|---|---|" + "---|" * len(cols)]
    for name, impls in by.items():
        best = fi_best(impls)
        if best is None:
            continue
        rate = f"{best['TBps']:.2f} TB/s" if "TBps" in best else f"{best['TFLOPs']:.0f} TFLOP/s"
        out.append(f"| {name} | {best['impl'][3:]} {best['ms']:.4f} | {rate} | "
                   + " | ".join(_cell(impls.get(p)) for p in cols) + " |")
    return "\n".join(out)


def host_table(host: list[dict]) -> str:
    out = ["| batch x keys | layers | begin_forward | 32-layer dispatch | cross_attention / layer | GPU attention "
           "| host share | token-id check |", "|---|---|---|---|---|---|---|---|"]
    for h in host:
        graph = h.get("cuda_graph", False)
        cross = "-" if graph else f"{h['cross_attention_call_us']:.1f} us"
        check = f"{h['check_indices_us']:.1f} us" if "check_indices_us" in h else "-"  # runs before run 32: none
        out.append(f"| {h['batch']} x {h['length']} | {'CUDA graph replay' if graph else 'one call each'} | "
                   f"{h['begin_forward_us']:.0f} us | {h['dispatch_us']:.0f} us | {cross} | "
                   f"{h['gpu_attention_us']:.0f} us | {h['host_share']:.1%} | {check} |")
    return "\n".join(out)


def main(argv=None) -> int:
    d = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    print(f"{d['date']}, {d['gpu']}, torch {d['torch']}, flashinfer {d['flashinfer']}; ceilings: copy "
          f"{d['ceilings']['copy_TBps']:.2f} TB/s, bf16 matmul {d['ceilings']['bf16_matmul_TFLOPs']:.0f} TFLOP/s\n")
    print(workload_table(d["rows"]))
    print()
    print(text_plot(d["rows"]))
    print()
    print(host_table(d["host_cost"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
