"""What each backend supports: for one config and target, per op and backend, served (and how) or the
reasons it is not, and what automatic selection picks. ``pagedkv backends`` prints it."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from . import backends as _backends
from . import ops as _ops
from .config import ATTENTION_OPTION_FIELDS, DTYPES, FP8_KV_DTYPES, KVCacheConfig


@dataclass(frozen=True)
class Cell:
    """One (op, backend): ``how`` it serves (``reasons`` empty), or why not."""

    op: str
    backend: str
    reasons: tuple[str, ...]
    how: str = ""

    @property
    def served(self) -> bool:
        return not self.reasons


def support_matrix(config: KVCacheConfig, target: Any) -> tuple[list[Cell], dict[str, str | None]]:
    """(cells for every op of ``config``'s kind and every registered backend, op -> the backend automatic
    selection picks, or ``None`` when no backend can serve it)."""
    cells, auto = [], {}
    for op in _ops.ops_for(config):
        for tag in _backends.registered_backends():
            try:
                backend = _backends.get_backend(tag)
            except Exception as err:  # noqa: BLE001 (an unimportable backend is reported, not fatal)
                cells.append(Cell(op, tag, (f"backend cannot be imported: {type(err).__name__}: {err}",)))
                continue
            why = tuple(backend.validate_configuration(op, config, target))
            cells.append(Cell(op, tag, why, "" if why else backend.describe(op, config, target)))
        auto[op] = next((c.backend for c in cells if c.op == op and c.served), None)
    return cells, auto


def dtype_support(config: KVCacheConfig, target: Any) -> dict[str, list[str]]:
    """backend -> the storage dtypes (``pagedkv.config.DTYPES``) in which it serves at least one op of
    ``config`` with only the dtype changed (e.g. ``tir``: float16, float32, bfloat16)."""
    out = {}
    for tag in _backends.registered_backends():
        try:
            backend = _backends.get_backend(tag)
        except Exception:  # noqa: BLE001, S112 (reported by support_matrix)
            continue
        out[tag] = [dt for dt in DTYPES if any(not backend.validate_configuration(op, config.replace(dtype=dt), target)
                                                for op in _ops.ops_for(config))]
    return out


def format_matrix(config: KVCacheConfig, target: Any, *, matrix: tuple | None = None) -> str:
    """The support matrix as text: the dtypes per backend, then one block per op (``matrix``: the result of
    ``support_matrix`` when the caller has it already)."""
    cells, auto = support_matrix(config, target) if matrix is None else matrix
    dtypes = "; ".join(f"{tag} {', '.join(dts) if dts else 'none'}" for tag, dts in dtype_support(config, target).items())
    lines = [f"target {json.dumps(target) if isinstance(target, dict) else target}; config {config.to_json()}",
             f"dtypes served (some op of this config): {dtypes}", ""]
    for op in _ops.ops_for(config):
        pick = auto[op]
        lines.append(f"{op}: automatic selection -> {pick if pick else 'NONE (no backend can serve it)'}")
        for c in (c for c in cells if c.op == op):
            if c.served:
                lines.append(f"  {c.backend:12s} serves" + (f" ({c.how})" if c.how else ""))
            else:
                lines.append(f"  {c.backend:12s} cannot: " + "; ".join(c.reasons))
    return "\n".join(lines)


def _parse_target(text: str) -> Any:
    """Any spelling ``pagedkv.target.canonical`` reads, as its canonical dict."""
    from .target import canonical

    return canonical(text)


#: Defaults of the MHA shape options of ``pagedkv backends`` (given as None so that an MLA config can tell an
#: option the user gave, which it must honor or refuse, from one left at its MHA default).
MHA_DEFAULTS = {"num_kv_heads": 8, "head_dim": 128, "rope_mode": "normal"}
#: Defaults of the MLA dims (used with --kv-lora-rank only).
MLA_DEFAULTS = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64}


def config_from_args(args: argparse.Namespace) -> KVCacheConfig:
    """The config the options name. Every option given is passed to ``KVCacheConfig``, so one that does not
    fit the cache kind (``--num-kv-heads 1`` or ``--rope-mode normal`` with ``--kv-lora-rank``, an MLA dim
    without it) is refused with the config's own reason instead of being replaced."""
    common = dict(num_layers=1, num_qo_heads=args.num_qo_heads, dtype=args.dtype, page_size=args.page_size,
                  prefill_chunk_size=args.prefill_chunk_size, max_batch_size=args.max_batch_size,
                  attention_sinks=args.attention_sinks, sink_size=args.sink_size, kv_dtype=args.kv_dtype,
                  **{f: getattr(args, f) for f in ATTENTION_OPTION_FIELDS})
    if args.kv_lora_rank:
        nope, rope = (MLA_DEFAULTS[f] if getattr(args, f) is None else getattr(args, f) for f in MLA_DEFAULTS)
        given = {f: getattr(args, f) for f in MHA_DEFAULTS if getattr(args, f) is not None}
        # The MLA layout's own values where an option is not given (KVCacheConfig.mla's).
        return KVCacheConfig(**common, num_kv_heads=given.get("num_kv_heads", args.num_qo_heads),
                             head_dim=given.get("head_dim", nope + rope), v_head_dim=args.v_head_dim or nope,
                             rope_mode=given.get("rope_mode", "none"), layer_kinds=("mla",),
                             kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope)
    mha = {f: MHA_DEFAULTS[f] if getattr(args, f) is None else getattr(args, f) for f in MHA_DEFAULTS}
    mla_dims = {f: getattr(args, f) or 0 for f in MLA_DEFAULTS}  # refused by the config when given
    return KVCacheConfig(**common, **mha, **mla_dims, v_head_dim=args.v_head_dim)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedkv backends",
                                 description="Per op and backend: served or why not, and what automatic "
                                             "selection picks, for one config and target. Exits 1 when "
                                             "some op of the config has no backend.")
    ap.add_argument("--target", default="llvm", help="'llvm', 'cuda' (this host's GPU, else sm_90a), "
                                                      "'cuda -arch=sm_80', a TVM tag such as nvidia/nvidia-h100, "
                                                      "or a JSON dict")
    ap.add_argument("--num-qo-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=None, help="default 8 (MLA: --num-qo-heads)")
    ap.add_argument("--head-dim", type=int, default=None, help="default 128 (MLA: nope + rope)")
    ap.add_argument("--v-head-dim", type=int, default=None)
    ap.add_argument("--dtype", default="float16", choices=DTYPES, help="storage dtype of q/k/v/o and pages")
    ap.add_argument("--rope-mode", default=None, choices=("normal", "inline", "none"),
                    help="default normal (MLA: none)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefill-chunk-size", type=int, default=2048)
    ap.add_argument("--max-batch-size", type=int, default=1)
    defaults = KVCacheConfig(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=2)
    for f in ATTENTION_OPTION_FIELDS:  # every attention option, by its config field (default: off)
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(getattr(defaults, f)), default=getattr(defaults, f))
    ap.add_argument("--attention-sinks", action="store_true",
                    help="learnable attention sinks (gpt-oss): adds the sink ops")
    ap.add_argument("--sink-size", type=int, default=0,
                    help="StreamingLLM sink tokens beside --sliding-window (changes no kernel)")
    ap.add_argument("--kv-dtype", default=None, choices=FP8_KV_DTYPES,
                    help="page storage dtype (default: --dtype); float8_e4m3fn: FP8 pages, per op who serves them")
    ap.add_argument("--kv-lora-rank", type=int, default=0, help="MLA: > 0 makes an MLA cache")
    ap.add_argument("--qk-nope-head-dim", type=int, default=None, help="MLA only; default 128")
    ap.add_argument("--qk-rope-head-dim", type=int, default=None, help="MLA only; default 64")
    ap.add_argument("--json", action="store_true", help="print the matrix as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    """``pagedkv backends``: 0 when every op of the config has a backend, 1 when some op has none (named on
    stderr), 2 for options that make no valid config."""
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as err:
        ap.error(str(err))
    target = _parse_target(args.target)
    cells, auto = support_matrix(config, target)
    if args.json:
        print(json.dumps({"config": config.to_dict(), "target": target, "auto": auto,
                          "dtypes": dtype_support(config, target), "cells": [c.__dict__ for c in cells]}, indent=1))
    else:
        print(format_matrix(config, target, matrix=(cells, auto)))
    unserved = [op for op, tag in auto.items() if tag is None]
    if unserved:
        print(f"pagedkv backends: no backend can serve {', '.join(unserved)} for this config and target "
              "(reasons above)", file=sys.stderr)
        return 1
    return 0


__all__ = ["Cell", "dtype_support", "format_matrix", "support_matrix"]
