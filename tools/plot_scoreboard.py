#!/usr/bin/env python3
"""Plots of the benchmark scoreboard (``BENCHMARKS.md``): one small PNG per area under ``docs/plots/``.

    python tools/plot_scoreboard.py [--out docs/plots]

The numbers are the scoreboard's, transcribed by hand from the run log (``benchmarks/HISTORY.md``); every
series names the run it comes from. Nothing here reads benchmark JSON or runs a benchmark: after a new run,
edit the table below (and the scoreboard's row), then rerun this script and commit the PNGs it rewrites.
Needs matplotlib only (Agg backend, no display).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

ROOT = Path(__file__).resolve().parents[1]

#: (a) pagedkv's TIR backend (auto's kernels, fp16, TIR built for sm_90a) as FlashInfer 0.7.4's best variant's
#: time over its time in the same process (>= 1: as fast or faster). H100 80GB HBM3.
#: MHA: 32 or 64 query heads over 8 kv heads, head dim 128, pages of 16 (BENCHMARKS.md's "h32" / "h64").
#: MLA: DeepSeek latents 512 + 64, against FlashInfer's MLA wrapper (fa3).
GPU_KERNELS = {
    "run": {"mha": "Run 31, H100", "mla": "Run 31, H100"},
    "mha": [  # (group, row, ratio)
        ("decode 32/8", "B1 x 32K", 0.985),
        ("decode 32/8", "B16 x 4K", 1.008),
        ("decode 32/8", "B32 x 4K", 1.013),
        ("decode 32/8", "B64 x 4K", 0.993),
        ("decode 32/8", "B64 x 8K", 1.000),
        ("decode 32/8", "B256 x 2K", 0.987),
        ("decode 32/8", "skew 128 to 16K", 1.028),
        ("decode 32/8", "skew 64+128 to 16K", 1.097),
        ("decode 64/8", "B1 x 32K", 0.979),
        ("decode 64/8", "B16 x 4K", 1.002),
        ("decode 64/8", "B32 x 4K", 1.005),
        ("decode 64/8", "B64 x 4K", 0.998),
        ("decode 64/8", "B64 x 8K", 1.002),
        ("decode 64/8", "B256 x 2K", 0.986),
        ("decode 64/8", "skew 128 to 16K", 1.365),
        ("decode 64/8", "skew 64+128 to 16K", 1.075),
        ("prefill ragged (wg1t)", "1 x 4K", 0.766),
        ("prefill ragged (wg1t)", "16 x 1K", 0.651),
        ("prefill ragged (wg1t)", "1 x 16K", 0.726),
        ("prefill paged (wg2t)", "512 over 4K", 0.633),
    ],
    "mla": [
        ("MLA decode 128 heads", "B64 x 1K", 0.924),
        ("MLA decode 128 heads", "B128 x 1K", 0.917),
        ("MLA decode 128 heads", "B64 x 8K", 0.973),
        ("MLA decode 128 heads", "B128 x 8K", 0.954),
        ("MLA decode 16 heads", "B64 x 1K", 0.938),
        ("MLA decode 16 heads", "B128 x 1K", 1.014),
        ("MLA decode 16 heads", "B64 x 8K", 0.990),
        ("MLA decode 16 heads", "B128 x 8K", 1.004),
        ("MLA prefill 128 heads", "1 x 512 over 4K", 0.973),
        ("MLA prefill 128 heads", "8 x 128 over 2K", 0.939),
        ("MLA prefill 16 heads", "1 x 512 over 4K", 0.286),
        ("MLA prefill 16 heads", "8 x 128 over 2K", 0.290),
    ],
}

#: (b) against torch SDPA (cuDNN / flash on the dense equivalent), fp16 32/8/128: pagedkv-tir's time over
#: itself as a fraction of SDPA's, i.e. SDPA ms / pagedkv ms, measured in the same process.
#: Decode rows: Run 15 (H200, 2026-12-05, make bench-gpu; both columns as ratios to FlashInfer's best, divided).
#: Prefill rows: Run 22's probe (H100, 2026-12-06, tools/prefill_probe.py, no L2 flush): auto's ragged tile wg1t.
GPU_SDPA = [  # (run, row, pagedkv-tir / FI best, torch-sdpa / FI best)
    ("Run 15, H200", "decode B1 x 32K", 0.982, 1.072),
    ("Run 15, H200", "decode B16 x 4K", 0.981, 1.105),
    ("Run 15, H200", "decode B32 x 4K", 0.973, 1.031),
    ("Run 15, H200", "decode B64 x 4K", 0.975, 1.026),
    ("Run 15, H200", "decode B64 x 8K", 0.969, 1.013),
    ("Run 15, H200", "decode B256 x 2K", 0.968, 1.035),
]
GPU_SDPA_PREFILL = [  # (run, row, SDPA ms, wg1t ms)
    ("Run 22 probe, H100", "prefill 1 x 4K (wg1t)", 0.266, 0.308),
    ("Run 22 probe, H100", "prefill 16 x 1K (wg1t)", 0.300, 0.455),
]

#: (c) SmolLM2-135M end to end on the GPU, decode tokens/s (fp16, 64-token prompts, 32 greedy new tokens).
E2E_GPU = {
    "H100 (2026-12-06 14:33)": {
        "batch": [1, 8, 32],
        "pagedkv": [721.3, 5291, 14693],
        "pagedkv + CUDA graphs": [865.8, 6205, 16617],
        "HF eager": [61.0, 473.7, 1862],
        "HF static compiled": [659.7, 5189, 17418],
    },
    "H200 (2026-12-02 00:34)": {
        "batch": [1, 8, 32],
        "pagedkv": [525.8, 3687, 13750],
        "pagedkv + CUDA graphs": [800.8, 5844, 15747],
        "HF eager": [50.1, 260.5, 1322],
        "HF static compiled": [670.1, 5200, 18359],
    },
}

#: (d) SmolLM2-135M end to end on the CPU (2026-12-01 18:41, quiet 2-core host, 2 threads each, float32).
E2E_CPU = {
    "batch": [1, 4],
    "prefill": {"pagedkv": [636.2, 780.3], "HF transformers": [405.4, 611.2]},
    "decode": {"pagedkv": [46.8, 125.2], "HF transformers": [16.0, 44.7]},
    "vs HF": {"prefill": ["1.57", "1.28"], "decode": ["2.93", "2.80"]},  # as the log prints them
}

#: (e) CPU attention kernels (TIR, llvm, znver4, 2 threads), 32/8/128, pages of 16: peer ms / ours ms, as the
#: log prints them (strings keep its digits).
CPU_KERNELS = {
    "torch SDPA (2026-12-02)": [  # (row, float32, float16)
        ("decode B4 x 1024", "3.3", "24"),
        ("ragged prefill 512", "2.3", "5.0"),
        ("paged prefill B2 x 128 over 512", "1.11", "3.5"),
        ("paged chunk 128 over 1024", "1.30", "4.1"),
    ],
    "apache-tvm 0.27 (2026-11-30)": [
        ("decode B4 x 1024", "5.0", "8.6"),
        ("ragged prefill 512", "15.5", "26"),
        ("paged prefill B2 x 128 over 512", "18.4", "24"),
    ],
}

FIG = (8, 4.5)  # inches at dpi 100: 800 x 450 px
DPI = 100
BLUE, ORANGE, GREEN, GREY = "#3b75af", "#ef8636", "#519e3e", "#8c8c8c"


def _save(fig, path: Path) -> None:
    """Write the figure as a 64-colour palette PNG (a quarter of the RGBA file's bytes, same look)."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    plt.close(fig)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=64).save(path, optimize=True)
    print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {path.stat().st_size:,} bytes")


def _hbars(ax, rows, title, colors, xmax=1.45):
    """Horizontal bars of ratios (one per row, top to bottom), a line at 1.0 and the value at each bar."""
    labels = [f"{g}: {r}" for g, r, _ in rows]
    vals = [v for _, _, v in rows]
    y = range(len(rows))[::-1]
    ax.barh(list(y), vals, color=colors, height=0.75)
    ax.axvline(1.0, color="black", lw=1)
    for yi, v in zip(y, vals):
        ax.text(min(v, xmax) + 0.01, yi, f"{v:.3f}", va="center", fontsize=6.5)
    ax.set_yticks(list(y), labels, fontsize=6.5)
    ax.set_xlim(0, xmax)
    ax.set_title(title, fontsize=8.5)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", lw=0.4, alpha=0.5)


def plot_gpu_kernels(out: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=FIG, gridspec_kw={"width_ratios": [1, 1]})
    mha = GPU_KERNELS["mha"]
    _hbars(a, mha, f"MHA, fp16: {GPU_KERNELS['run']['mha']}",
           [BLUE if g.startswith("decode") else ORANGE for g, _, _ in mha])
    mla = GPU_KERNELS["mla"]
    _hbars(b, mla, f"MLA, fp16: {GPU_KERNELS['run']['mla']}",
           [GREEN if "decode" in g else ORANGE for g, _, _ in mla])
    fig.suptitle("pagedkv TIR (auto's kernels) vs FlashInfer 0.7.4's best, same process (1.0 = as fast)",
                 fontsize=9.5)
    fig.tight_layout()
    _save(fig, out / "gpu_kernels.png")


def plot_gpu_sdpa(out: Path) -> None:
    rows = [(run, row, tir / sdpa) for run, row, tir, sdpa in GPU_SDPA]
    rows += [(run, row, sdpa_ms / ours_ms) for run, row, sdpa_ms, ours_ms in GPU_SDPA_PREFILL]
    fig, ax = plt.subplots(figsize=FIG)
    _hbars(ax, rows, "", [BLUE if r[0].startswith("Run 15") else ORANGE for r in rows], xmax=1.2)
    ax.set_yticks(ax.get_yticks(), [f"{row} [{run}]" for run, row, _ in rows], fontsize=8)
    for t in ax.texts:
        t.set_fontsize(8)
    ax.set_title("pagedkv TIR vs torch SDPA, fp16 32/8/128: SDPA time / pagedkv time (1.0 = as fast)",
                 fontsize=9.5)
    fig.tight_layout()
    _save(fig, out / "gpu_sdpa.png")


def plot_e2e_gpu(out: Path) -> None:
    systems = ["pagedkv", "pagedkv + CUDA graphs", "HF eager"]
    colors = [BLUE, GREEN, GREY]
    fig, axes = plt.subplots(1, 2, figsize=FIG, sharey=True)
    for ax, (card, d) in zip(axes, E2E_GPU.items()):
        ref = d["HF static compiled"]
        w = 0.26
        for i, (s, c) in enumerate(zip(systems, colors)):
            xs = [j + (i - 1) * w for j in range(len(d["batch"]))]
            vals = [v / r for v, r in zip(d[s], ref)]
            ax.bar(xs, vals, width=w, color=c, label=s)
            for x, v, tok in zip(xs, vals, d[s]):
                ax.text(x, v + 0.02, f"{v:.2f}\n({tok:,.0f})", ha="center", va="bottom", fontsize=6)
        ax.axhline(1.0, color="black", lw=1)
        ax.set_xticks(range(len(d["batch"])), [f"batch {b}" for b in d["batch"]], fontsize=8)
        ax.set_title(card, fontsize=9)
        ax.set_ylim(0, 1.65)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", lw=0.4, alpha=0.5)
    axes[0].set_ylabel("decode tokens/s / HF static compiled's (1.0)", fontsize=8)
    axes[1].legend(fontsize=7.5, loc="upper right")
    fig.suptitle("SmolLM2-135M fp16 end to end on the GPU, decode vs HF transformers "
                 "(bar: ratio, in brackets: tokens/s)", fontsize=9.5)
    fig.tight_layout()
    _save(fig, out / "e2e_gpu.png")


def plot_e2e_cpu(out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=FIG)
    batches = E2E_CPU["batch"]
    for ax, phase in zip(axes, ("prefill", "decode")):
        d = E2E_CPU[phase]
        top = max(max(v) for v in d.values()) * 1.3
        w = 0.38
        for i, (s, c) in enumerate(zip(d, (BLUE, GREY))):
            xs = [j + (i - 0.5) * w for j in range(len(batches))]
            ax.bar(xs, d[s], width=w, color=c, label=s)
            for x, v in zip(xs, d[s]):
                ax.text(x, v, f"{v:,.1f}", ha="center", va="bottom", fontsize=7)
        for j, (p, ratio) in enumerate(zip(d["pagedkv"], E2E_CPU["vs HF"][phase])):
            ax.text(j, p + 0.1 * top, f"{ratio}x HF", ha="center", fontsize=8.5, fontweight="bold")
        ax.set_ylim(0, top)
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches], fontsize=8)
        ax.set_title(f"{phase} tokens/s", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", lw=0.4, alpha=0.5)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("SmolLM2-135M float32 end to end on the CPU (2-core AMD znver4, 2 threads each, "
                 "2026-12-01)", fontsize=9.5)
    fig.tight_layout()
    _save(fig, out / "e2e_cpu.png")


def plot_cpu_kernels(out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=FIG, sharex=True)
    for ax, (peer, rows) in zip(axes, CPU_KERNELS.items()):
        y = list(range(len(rows)))[::-1]
        h = 0.38
        for k, (dt, c) in enumerate((("float32", BLUE), ("float16", ORANGE))):
            ys = [yi + (0.5 - k) * h for yi in y]
            vals = [r[1 + k] for r in rows]
            ax.barh(ys, [float(v) for v in vals], height=h, color=c, label=dt)
            for yy, v in zip(ys, vals):
                ax.text(float(v) * 1.06, yy, f"{v}x", va="center", fontsize=7.5)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xscale("log")
        ax.set_xlim(0.5, 80)
        ax.set_xticks([0.5, 1, 2, 5, 10, 20, 50], ["0.5", "1", "2", "5", "10", "20", "50"])
        ax.minorticks_off()
        ax.set_yticks(y, [r[0] for r in rows], fontsize=7)
        ax.set_title(f"vs {peer}", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", lw=0.4, alpha=0.5)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("CPU attention kernels (TIR, llvm): peer time / pagedkv time, log scale (1.0 = as fast)",
                 fontsize=9.5)
    fig.tight_layout()
    _save(fig, out / "cpu_kernels.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "plots", help="folder of the PNGs")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for plot in (plot_gpu_kernels, plot_gpu_sdpa, plot_e2e_gpu, plot_e2e_cpu, plot_cpu_kernels):
        plot(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
