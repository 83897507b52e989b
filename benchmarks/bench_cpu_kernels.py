"""Time pagedkv's CPU attention kernels against apache-tvm's CPU kernels and torch SDPA.

Cases (float32 by default, D = 128, GQA 32 query / 8 kv heads unless changed on the command line):

* ``decode``          B sequences of L cached tokens, one query each (``attn_decode_paged``);
* ``prefill_ragged``  one causal prefill of L new tokens (``attn_prefill_ragged``);
* ``prefill_paged``   B entries of Lq new queries over L cached tokens, non-causal, as the runtime calls it
                      for the cached prefix (``attn_prefill_paged``);
* ``prefill_chunk``   the same kernel on one chunk of Lq queries over a longer prefix (B=1 Lq=128 L=1024:
                      the GPU table's Lq=512 over 4096, scaled to the CPU).

apache-tvm's kernels (``tvm.relax.frontend.nn.llm``: ``_attention_decode_cpu``, ``_attention_prefill_cpu``,
``_attention_prefill_ragged_cpu``) are compiled for the same target.

``--sliding-window W`` / ``--soft-cap C`` compile our kernels with those options; torch SDPA then gets the
window as a mask (it has no soft-cap), apache-tvm's kernels still attend to every key (their ABI takes no
window per call), and the check is against ``pagedkv.testing.reference.attention`` with both options. Every case checks our output against
torch first. Timings are interleaved (ours, upstream, torch per round) and the median round is reported,
because this box is shared. Writes ``benchmarks/results/bench_cpu_kernels.json`` and ``.png``
(``bench_cpu_kernels_float16.*`` with ``--dtype float16``).

Usage: ``.venv/bin/python benchmarks/bench_cpu_kernels.py [--hq 32 --hkv 8 --dim 128 --dtype float32]``
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import statistics
import time

import numpy as np
import torch
import tvm

ROOT = pathlib.Path(__file__).resolve().parents[1]
from pagedkv import tir_kernels as tk  # noqa: E402
from tvm.relax.frontend.nn.llm import _decode_kernels as up_decode  # noqa: E402
from tvm.relax.frontend.nn.llm import _prefill_kernels as up_prefill  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
UPSTREAM_PAGE_SIZE = 16  # apache-tvm's CPU kernels hard-code the page size at compile time


def compile_one(func, target, name):
    lib = tvm.compile(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target=target)
    return lib[name]


def tensors(*arrays):
    return [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays]


def paged_layout(batch, length, hkv, d, ps, dtype, rng):
    """Pages holding ``batch`` sequences of ``length`` tokens on shuffled pages, plus the dense K/V."""
    per = -(-length // ps)
    pool = batch * per + 1
    pages = rng.standard_normal((pool, 2, hkv, ps, d)).astype(dtype)
    values = rng.permutation(pool)[: batch * per].astype(np.int32)
    indptr = (np.arange(batch + 1) * per).astype(np.int32)
    last = np.full(batch, length - (per - 1) * ps, np.int32)
    seq_pages = pages[values].reshape(batch, per, 2, hkv, ps, d)
    kv = seq_pages.transpose(0, 2, 3, 1, 4, 5).reshape(batch, 2, hkv, per * ps, d)[:, :, :, :length]
    return pages, values, indptr, last, torch.from_numpy(np.ascontiguousarray(kv[:, 0])), \
        torch.from_numpy(np.ascontiguousarray(kv[:, 1]))


def time_round(fn, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def measure(runners, rounds, min_time=0.2):
    """Median seconds per call of each runner, interleaving runners round by round."""
    reps = {}
    for name, fn in runners.items():
        fn()  # warm up (and first-touch the workspace pools)
        once = max(time_round(fn, 1), 1e-6)
        reps[name] = max(1, int(min_time / once))
    samples = {name: [] for name in runners}
    for _ in range(rounds):
        for name, fn in runners.items():
            samples[name].append(time_round(fn, reps[name]))
    return {name: statistics.median(v) for name, v in samples.items()}


def window_mask(n, m, window, causal):
    """``[n, m]`` bool mask of the keys query ``i`` (at key position ``m - n + i``) sees, or None."""
    if not window and not causal:
        return None
    pos = torch.arange(m)[None, :] - (m - n + torch.arange(n))[:, None]  # key minus query position
    keep = torch.ones(n, m, dtype=torch.bool)
    if causal:
        keep &= pos <= 0
    if window:
        keep &= pos > -window
    return keep


def sdpa(q, k, v, sm, window, causal):
    """torch SDPA on ``[B, H, n, D]`` tensors (GQA), with the window as a mask."""
    mask = window_mask(q.shape[2], k.shape[2], window, causal) if window else None
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and not window,
                                                            scale=sm, enable_gqa=True)


def options_ref(cfg, q, k, v, sm, causal):
    """float64 reference of one batch of entries with the kernel's options: ``q[B, Hq, n, D]``, ``k/v[B, Hkv, m, D]``."""
    from pagedkv.testing.reference import attention

    outs = [attention(qb.transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1), sm, causal,
                      sliding_window=cfg.sliding_window, logits_soft_cap=cfg.logits_soft_cap)[0]
            for qb, kb, vb in zip(q, k, v)]
    return torch.stack(outs).transpose(1, 2)  # [B, Hq, n, D]


def check(ours, ref, what):
    err = float(np.linalg.norm(ours.astype(np.float64) - ref) / np.linalg.norm(ref))
    if not err < 1e-3:
        raise AssertionError(f"{what}: our output differs from torch SDPA (rel err {err:.2e})")
    return err


def case_decode(cfg, args, target, rng):
    """B sequences of L tokens, one query each."""
    hq, hkv, d, dtype = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
    b, length, sm = args.batch, args.decode_len, 1.0 / math.sqrt(cfg.head_dim)
    pages, values, indptr, last, k, v = paged_layout(b, length, hkv, d, UPSTREAM_PAGE_SIZE, dtype, rng)
    q = rng.standard_normal((b, hq, d)).astype(dtype)
    zeros = np.zeros(b, np.int32)
    o, lse = np.zeros((b, hq, d), dtype), np.zeros((b, hq), np.float32)
    ours = compile_one(tk.make_attn_decode_paged(cfg, target), target, "ours")
    up = compile_one(up_decode._attention_decode_cpu(hkv, hq, d, dtype, False, {}, UPSTREAM_PAGE_SIZE),
                     target, "upstream")
    a_ours = tensors(q, pages, indptr, values, last, zeros, zeros, o, lse)
    a_up = tensors(q, pages, indptr, values, last, zeros, zeros, o, lse)
    qt = torch.from_numpy(q).unsqueeze(2)
    runners = {
        "ours": lambda: ours(*a_ours, 0, 1.0, 1e4, sm),
        "upstream": lambda: up(*a_up, 0, 1.0, 1e4, sm),
        "torch": lambda: sdpa(qt, k, v, sm, cfg.sliding_window, False),
    }
    runners["ours"]()
    ref = options_ref(cfg, qt, k, v, sm, False) if _options(cfg) else runners["torch"]()
    return f"decode B={b} L={length}{_options(cfg)}", runners, check(a_ours[7].numpy(), ref.squeeze(2).double().numpy(), "decode")


def case_prefill_ragged(cfg, args, target, rng):
    """One causal prefill of L new tokens."""
    hq, hkv, d, dtype = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
    n, sm = args.prefill_len, 1.0 / math.sqrt(cfg.head_dim)
    q = rng.standard_normal((n, hq, d)).astype(dtype)
    k, v = (rng.standard_normal((n, hkv, d)).astype(dtype) for _ in range(2))
    indptr, zeros, pos = np.array([0, n], np.int32), np.zeros(1, np.int32), np.arange(n, dtype=np.int32)
    o, lse = np.zeros((n, hq, d), dtype), np.zeros((n, hq), np.float32)
    ours = compile_one(tk.make_attn_prefill_ragged(cfg, target), target, "ours")
    up = compile_one(up_prefill._attention_prefill_ragged_cpu(hkv, hq, d, d, dtype, {}), target, "upstream")
    a_ours = tensors(q, k, v, indptr, indptr, pos, zeros, o, lse)
    a_up = tensors(q, indptr, k, v, indptr, pos, zeros, o, lse)  # upstream's argument order
    qt, kt, vt = (torch.from_numpy(x).transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    runners = {
        "ours": lambda: ours(*a_ours, 1, 0, 1.0, 1e4, sm),
        "upstream": lambda: up(*a_up, 1, 0, 1.0, 1e4, sm),
        "torch": lambda: sdpa(qt, kt, vt, sm, cfg.sliding_window, True),
    }
    runners["ours"]()
    ref = options_ref(cfg, qt, kt, vt, sm, True) if _options(cfg) else runners["torch"]()
    return (f"prefill_ragged causal L={n}{_options(cfg)}", runners,
            check(a_ours[7].numpy(), ref[0].transpose(0, 1).double().numpy(), "prefill_ragged"))


def case_prefill_paged(cfg, args, target, rng):
    """B entries of Lq new queries over L cached tokens (non-causal)."""
    return _paged_prefill(cfg, target, rng, args.batch_paged, args.paged_q_len, args.paged_kv_len)


def case_prefill_chunk(cfg, args, target, rng):
    """One chunk of Lq new queries over a longer cached prefix (the GPU table's Lq=512 over 4096, scaled)."""
    return _paged_prefill(cfg, target, rng, 1, args.chunk_q_len, args.chunk_kv_len)


def _paged_prefill(cfg, target, rng, b, lq, length):
    """``attn_prefill_paged`` of B entries of Lq queries over L cached tokens (non-causal) and its peers."""
    hq, hkv, d, dtype = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
    sm = 1.0 / math.sqrt(cfg.head_dim)
    pages, values, indptr, last, k, v = paged_layout(b, length, hkv, d, UPSTREAM_PAGE_SIZE, dtype, rng)
    q = rng.standard_normal((b * lq, hq, d)).astype(dtype)
    q_indptr = (np.arange(b + 1) * lq).astype(np.int32)
    zeros, pos = np.zeros(b, np.int32), np.zeros(b * lq, np.int32)
    o, lse = np.zeros((b * lq, hq, d), dtype), np.zeros((b * lq, hq), np.float32)
    ours = compile_one(tk.make_attn_prefill_paged(cfg, target), target, "ours")
    up = compile_one(up_prefill._attention_prefill_cpu(hkv, hq, d, dtype, False, {}, UPSTREAM_PAGE_SIZE),
                     target, "upstream")
    a_ours = tensors(q, q_indptr, pages, indptr, values, last, zeros, pos, o, lse)
    a_up = tensors(q, q_indptr, pages, indptr, values, last, zeros, pos, o, lse)
    qt = torch.from_numpy(q).view(b, lq, hq, d).transpose(1, 2)
    runners = {
        "ours": lambda: ours(*a_ours, 0, 0, 1.0, 1e4, sm),
        "upstream": lambda: up(*a_up, 0, 0, 1.0, 1e4, sm),
        "torch": lambda: sdpa(qt, k, v, sm, cfg.sliding_window, False),
    }
    runners["ours"]()
    ref = options_ref(cfg, qt, k, v, sm, False) if _options(cfg) else runners["torch"]()
    ref = ref.transpose(1, 2).reshape(b * lq, hq, d).double().numpy()
    return f"prefill_paged B={b} Lq={lq} L={length}{_options(cfg)}", runners, check(a_ours[8].numpy(), ref, "prefill_paged")


def _options(cfg) -> str:
    """Case-label suffix of the kernel options ("" without)."""
    return ((f" w{cfg.sliding_window}" if cfg.sliding_window else "")
            + (f" cap{cfg.logits_soft_cap:g}" if cfg.logits_soft_cap else ""))


def plot(rows, path):
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        print("matplotlib not available: skipping the plot")
        return
    names = [r["case"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, who in enumerate(("ours", "upstream", "torch")):
        speed = [r["ms"]["torch"] / r["ms"][who] for r in rows]
        ax.bar(x + (i - 1) * 0.27, speed, 0.27, label=who)
    ax.set_yscale("log")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("speed relative to torch SDPA (higher is better)")
    ax.set_title(rows[0]["config"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hq", type=int, default=32)
    parser.add_argument("--hkv", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--batch", type=int, default=4, help="decode sequences")
    parser.add_argument("--decode-len", type=int, default=1024)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--batch-paged", type=int, default=2)
    parser.add_argument("--paged-q-len", type=int, default=128)
    parser.add_argument("--paged-kv-len", type=int, default=512)
    parser.add_argument("--chunk-q-len", type=int, default=128)
    parser.add_argument("--chunk-kv-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--target", default="host", help='"host" (llvm with this CPU\'s mcpu) or a target string')
    parser.add_argument("--cases", default="decode,prefill_ragged,prefill_paged,prefill_chunk")
    parser.add_argument("--sliding-window", type=int, default=0, help="our kernels' sliding window (0: off)")
    parser.add_argument("--soft-cap", type=float, default=0.0, help="our kernels' logits soft-cap (0: off)")
    args = parser.parse_args(argv)

    target = tk.host_target() if args.target == "host" else tvm.target.Target(args.target)
    cfg = tk.KernelSpec(args.hq, args.hkv, args.dim, args.dim, args.dtype, sliding_window=args.sliding_window,
                          logits_soft_cap=args.soft_cap)
    config = f"Hq={args.hq} Hkv={args.hkv} D={args.dim} {args.dtype}{_options(cfg)}, {target}"
    rng = np.random.default_rng(0)
    cases = {"decode": case_decode, "prefill_ragged": case_prefill_ragged, "prefill_paged": case_prefill_paged,
             "prefill_chunk": case_prefill_chunk}
    rows = []
    print(f"{config}; torch threads {torch.get_num_threads()}")
    print(f"{'case':34s} {'ours ms':>9s} {'upstr ms':>9s} {'torch ms':>9s} {'ours/upstr':>11s} "
          f"{'ours/torch':>11s} {'upstr/torch':>12s}")
    for name in args.cases.split(","):
        label, runners, err = cases[name](cfg, args, target, rng)
        sec = measure(runners, args.rounds)
        ms = {k: v * 1e3 for k, v in sec.items()}
        row = {"case": label, "config": config, "ms": ms, "rel_err_vs_torch": err,
               "speedup_vs_upstream": ms["upstream"] / ms["ours"],
               "speed_vs_torch": ms["torch"] / ms["ours"], "upstream_speed_vs_torch": ms["torch"] / ms["upstream"]}
        rows.append(row)
        print(f"{label:34s} {ms['ours']:9.3f} {ms['upstream']:9.3f} {ms['torch']:9.3f} "
              f"{row['speedup_vs_upstream']:10.2f}x {row['speed_vs_torch']:10.2f}x {row['upstream_speed_vs_torch']:11.3f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"machine": platform.processor() or platform.machine(), "cpus": torch.get_num_threads(),
           "tvm": tvm.__version__, "torch": torch.__version__, "rows": rows}
    stem = "bench_cpu_kernels" if args.dtype == "float32" else f"bench_cpu_kernels_{args.dtype}"
    if _options(cfg):
        stem += f"_w{cfg.sliding_window}_cap{cfg.logits_soft_cap:g}"
    json_path = RESULTS / f"{stem}.json"
    json_path.write_text(json.dumps(out, indent=2))
    print(f"wrote {json_path}")
    plot(rows, RESULTS / f"{stem}.png")


if __name__ == "__main__":
    main()
