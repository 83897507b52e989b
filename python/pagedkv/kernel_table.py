"""Which TIR CUDA kernel serves which configuration: one selection table per op, as data.

Every op with several CUDA kernels has a path switch (``pagedkv.kernel_spec.SWITCHES``) whose values name its
variants. This module is the one place that says, per op, which variants exist, what each serves (arch,
dtypes, head dims, GQA groups, heads), the order in which automatic selection tries them, and what a
variant's PrimFunc runs where its fast path cannot read the operands at run time. The kernel factories
(``choose``), the TIR backend's description (``pagedkv backends``: the chosen variant and why the faster ones
were not taken) and the docs table (``python -m pagedkv.kernel_table --markdown``, in docs/ARCHITECTURE.md)
all read it. Forcing a variant (tests) goes through the path switch; a forced variant that does not serve
the spec raises with the reasons, never runs something else.

The table is TVM-free: its data limits are checked here; ``Variant.check`` names the kernel module's own
limit function (shared memory, tile fits), imported only when a choice is made on a host with TVM.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Mapping

from .kernel_spec import TC_PREFILL_HEAD_DIMS, TCQ_PREFILL_HEAD_DIMS, WG_PREFILL_HEAD_DIMS, forced
from .ops import ATTN_DECODE_PAGED, ATTN_PREFILL_PAGED, ATTN_PREFILL_RAGGED, MLA_ATTN_DECODE_PAGED, \
    MLA_ATTN_PREFILL_PAGED

#: The wgmma / TMA kernels' arch (their instructions exist there only); sm_90 canonicalises to it.
HOPPER = "sm_90a"
#: The oldest arch of the mma.sync / cp.async kernels.
AMPERE = 80
HALF = ("float16", "bfloat16")
ANY_DTYPE = ("float16", "bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel of an op: a row of the selection table.

    Parameters
    ----------
    name : str
        The path switch's value that forces it.
    what : str
        One line: what the kernel is.
    priority : Mapping[str, int]
        op -> rank in automatic selection (1 is tried first); an op absent here runs it only when forced.
    arch : str
        ``"sm_90a"`` (that arch only), ``"sm_80+"`` (the mma.sync generation and later) or ``"any"``.
    dtypes : tuple of str
        Storage dtypes served.
    head_dims : tuple of int or None
        qk (= v) head dims served; None: any the op takes.
    max_group : int or None
        Largest GQA group (query heads per kv head) served; None: any.
    min_heads : int
        Automatic selection takes it from this many query heads (MLA: rows of its m64 tile).
    fallback : str
        What its PrimFunc runs where the fast path cannot read the operands at run time ("" = none).
    check : str
        ``module:function`` of the kernel's own limits, ``(spec, op, name, rope) -> list[str]``, beyond the data
        ("" = none).
    """

    name: str
    what: str
    priority: Mapping[str, int]
    arch: str = "sm_80+"
    dtypes: tuple = HALF
    head_dims: tuple | None = None
    max_group: int | None = None
    min_heads: int = 0
    fallback: str = ""
    check: str = ""

    def data_reasons(self, spec, *, auto: bool) -> list[str]:
        """Why the data columns refuse ``spec`` (a ``KernelSpec``; its ``target_arch`` "" = unknown)."""
        out = []
        arch = spec.target_arch
        if self.arch == HOPPER and arch != HOPPER:
            out.append(f"target arch {arch or 'unknown'} (needs {HOPPER}: wgmma / TMA)")
        elif self.arch == "sm_80+" and arch and int(arch[3:5]) < AMPERE:
            out.append(f"target arch {arch} (needs sm_{AMPERE} or newer)")
        if spec.dtype not in self.dtypes:
            out.append(f"dtype {spec.dtype} (takes {', '.join(self.dtypes)})")
        if self.head_dims is not None and (spec.head_dim not in self.head_dims
                                           or spec.v_head_dim not in self.head_dims):
            out.append(f"head dims {spec.head_dim}/{spec.v_head_dim} (takes {', '.join(map(str, self.head_dims))})")
        if self.max_group is not None and spec.group_size > self.max_group:
            out.append(f"GQA group {spec.group_size} (takes up to {self.max_group})")
        if auto and spec.num_qo_heads < self.min_heads:
            out.append(f"{spec.num_qo_heads} heads (auto takes it from {self.min_heads})")
        return out


def _check_fn(path: str) -> Callable:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def unserved(variant: Variant, spec, op: str, *, rope: bool = False, auto: bool = True) -> list[str]:
    """Why ``variant`` does not serve ``op`` of ``spec`` (empty: it does): the data, then the kernel's own
    limits (``Variant.check``, which imports the kernels)."""
    out = variant.data_reasons(spec, auto=auto)
    if rope and getattr(spec, "rope", None) is not None and variant.name not in ROPE_TABLE_VARIANTS.get(op, ()):
        out.append(f"inline RoPE of a RoPE variant (KernelSpec.rope; {op}'s "
                   f"{' / '.join(ROPE_TABLE_VARIANTS.get(op, ())) or 'none'} kernel takes its table)")
    if variant.check and (not out or not auto):  # forced: every reason, the kernel's own ones too
        said = {r.split(" (")[0] for r in out}
        out += [r for r in _check_fn(variant.check)(spec, op, variant.name, rope) if r.split(" (")[0] not in said]
    return out


#: op -> the kernels whose inline RoPE takes a RoPE variant's table (``KernelSpec.rope``: whole head, halves; the
#: others rotate with the plain formula only). The prefill's inline RoPE always runs the SIMT kernel; the decode's,
#: with a table, always the lane-group kernel (``cuda_decode_kernel`` then forces the plain kernel only).
ROPE_TABLE_VARIANTS = {ATTN_DECODE_PAGED: ("lanes",), ATTN_PREFILL_RAGGED: ("simt",), ATTN_PREFILL_PAGED: ("simt",)}

_TK = "pagedkv.tir_kernels._kernel_limits"
PREFILL_OPS = (ATTN_PREFILL_RAGGED, ATTN_PREFILL_PAGED)
MLA_OPS = (MLA_ATTN_DECODE_PAGED, MLA_ATTN_PREFILL_PAGED)

#: switch -> its variants (the ops each serves are its ``priority`` keys and ``SWITCH_OPS``).
TABLE: dict[str, tuple[Variant, ...]] = {
    "cuda_prefill_kernel": (
        Variant("wg1t", "wgmma, 64 rows (one warpgroup), K/V tiles by TMA, three stages, two blocks an SM",
                {ATTN_PREFILL_RAGGED: 1}, arch=HOPPER, head_dims=WG_PREFILL_HEAD_DIMS, max_group=32,
                fallback="tc3 where k / v are not 16-byte aligned", check=f"{_TK}:prefill_tile"),
        Variant("wg2t", "wgmma, 128 rows (two warpgroups sharing each K/V tile), K/V boxes by TMA, four stages",
                {ATTN_PREFILL_PAGED: 1}, arch=HOPPER, head_dims=WG_PREFILL_HEAD_DIMS, max_group=32,
                fallback="tc2 where the pages are not 16-byte aligned or hold a count of keys not a multiple of 8",
                check=f"{_TK}:prefill_tile"),
        Variant("tc3", "mma.sync, 128 rows (4 warps of two m16 tiles, Q in shared memory), two stages of 32 keys",
                {ATTN_PREFILL_RAGGED: 2}, head_dims=TC_PREFILL_HEAD_DIMS, max_group=32, check=f"{_TK}:prefill_tile"),
        Variant("tc2", "mma.sync, 128 rows (8 warps), two stages of 64 keys in dynamic shared memory",
                {ATTN_PREFILL_PAGED: 2}, head_dims=TC_PREFILL_HEAD_DIMS, max_group=32, check=f"{_TK}:prefill_tile"),
        Variant("tcq", "mma.sync, 128 rows (8 warps, Q in shared memory), two stages of 32 keys: head dim 256",
                {ATTN_PREFILL_RAGGED: 3, ATTN_PREFILL_PAGED: 3}, head_dims=TCQ_PREFILL_HEAD_DIMS, max_group=32,
                check=f"{_TK}:prefill_tile"),
        Variant("simt", "FP32 FMA (CUDA cores): every dtype, head dim and group the op takes; inline RoPE",
                {ATTN_PREFILL_RAGGED: 9, ATTN_PREFILL_PAGED: 9}, arch="any", dtypes=ANY_DTYPE),
    ),
    "cuda_decode_kernel": (
        Variant("tc", "mma.sync, 4 warps per (entry, kv head, split), 64-key tiles in a 3-slot cp.async ring",
                {ATTN_DECODE_PAGED: 1}, head_dims=(64, 128), max_group=16),
        Variant("staged", "CUDA cores, 16 KB K/V tiles staged through shared memory, the whole GQA group a block",
                {ATTN_DECODE_PAGED: 2}, arch="any", dtypes=ANY_DTYPE, check=f"{_TK}:decode_staged"),
        Variant("lanes", "CUDA cores, lane groups reading K/V straight from the pages",
                {ATTN_DECODE_PAGED: 3}, arch="any", dtypes=ANY_DTYPE),
    ),
    "cuda_mla_decode_kernel": (
        Variant("wgq", "wgmma, Q in shared memory, a score and a value warpgroup, latent tiles by TMA",
                {MLA_ATTN_DECODE_PAGED: 1}, arch=HOPPER, min_heads=16,
                fallback="wg (wgmma, cp.async tiles) where the pages are not 16-byte aligned or hold a count of "
                         "keys not a multiple of 8", check=f"{_TK}:mla_wgq"),
        Variant("tc", "mma.sync, 8 warps, 16 / 32 heads a block, 64-key latent tiles in a 2-stage cp.async ring",
                {MLA_ATTN_DECODE_PAGED: 2}, check=f"{_TK}:mla_tc"),
        Variant("simt", "FP32 FMA row tiles (CUDA cores): every dtype and latent the op takes",
                {MLA_ATTN_DECODE_PAGED: 9}, arch="any", dtypes=ANY_DTYPE),
    ),
}
# The paged MLA prefill runs the MLA decodes' blocks, one query token's heads a block: the same rows.
TABLE["cuda_mla_prefill_kernel"] = tuple(
    dataclasses.replace(v, priority={MLA_ATTN_PREFILL_PAGED: p for p in v.priority.values()})
    for v in TABLE["cuda_mla_decode_kernel"])

#: op -> its switch.
SWITCH_OF_OP = {ATTN_PREFILL_RAGGED: "cuda_prefill_kernel", ATTN_PREFILL_PAGED: "cuda_prefill_kernel",
                ATTN_DECODE_PAGED: "cuda_decode_kernel", MLA_ATTN_DECODE_PAGED: "cuda_mla_decode_kernel",
                MLA_ATTN_PREFILL_PAGED: "cuda_mla_prefill_kernel"}


@dataclasses.dataclass(frozen=True)
class Choice:
    """The outcome of ``choose``: the variant, whether it was forced, and the variants tried before it with
    why each was not taken."""

    op: str
    variant: Variant
    forced: bool
    skipped: tuple = ()

    @property
    def name(self) -> str:
        return self.variant.name

    def explain(self) -> str:
        """One line: the variant, its fallback, and why the faster ones were not taken."""
        head = f"{self.variant.name}" + (" (forced)" if self.forced else "")
        if self.variant.fallback:
            head += f"; falls back to {self.variant.fallback}"
        if self.skipped:
            head += "; not taken: " + "; ".join(f"{v.name}: {', '.join(why)}" for v, why in self.skipped)
        return head


def variants(op: str) -> tuple[Variant, ...]:
    """The variants of ``op`` (its switch's rows), whether auto takes them or not."""
    return TABLE[SWITCH_OF_OP[op]]


def auto_order(op: str) -> list[Variant]:
    """The variants automatic selection tries for ``op``, first first."""
    return sorted((v for v in variants(op) if op in v.priority), key=lambda v: v.priority[op])


def choose(op: str, spec, *, rope: bool = False) -> Choice:
    """The variant serving ``op`` of ``spec`` (a ``KernelSpec`` with its ``target_arch``).

    A variant forced through the op's path switch (``spec.paths``) is taken, or raises
    ``NotImplementedError`` with the reasons it does not serve; else the first of ``auto_order(op)`` that
    serves. ``rope``: the inline-RoPE kernel of ``attn_decode_paged`` (its own limits).
    """
    switch = SWITCH_OF_OP[op]
    value = forced(spec.paths, switch)
    if value != "auto":
        variant = next((v for v in variants(op) if v.name == value), None)
        if variant is None:
            raise NotImplementedError(f"pagedkv.tir_kernels: {switch}={value} has no kernel for {op!r}")
        why = unserved(variant, spec, op, rope=rope, auto=False)
        if why:
            raise NotImplementedError(f"pagedkv.tir_kernels: {switch}={value}: the {value} kernel of {op!r} "
                                      f"does not serve {'; '.join(why)}")
        return Choice(op, variant, True)
    skipped = []
    for variant in auto_order(op):
        why = unserved(variant, spec, op, rope=rope)
        if not why:
            return Choice(op, variant, False, tuple(skipped))
        skipped.append((variant, why))
    raise NotImplementedError(f"pagedkv.tir_kernels: no CUDA kernel serves {op!r}: "
                              + "; ".join(f"{v.name}: {', '.join(w)}" for v, w in skipped))


def markdown() -> str:
    """The "which kernel runs" table of docs/ARCHITECTURE.md."""
    lines = ["| op | auto order | variant | arch | dtypes | head dims | GQA group | heads | falls back to | kernel |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for switch, rows in TABLE.items():
        ops = [op for op, s in SWITCH_OF_OP.items() if s == switch]
        for op in ops:
            ranked = auto_order(op) + [v for v in rows if op not in v.priority]
            for v in ranked:
                rank = str(v.priority[op]) if op in v.priority else "forced only"
                lines.append(f"| `{op}` | {rank} | `{v.name}` | {v.arch} | {', '.join(v.dtypes)} | "
                             f"{', '.join(map(str, v.head_dims)) if v.head_dims else 'any'} | "
                             f"{v.max_group or 'any'} | {f'{v.min_heads}+' if v.min_heads else 'any'} | "
                             f"{v.fallback or '-'} | {v.what} |")
    return "\n".join(lines)


#: The markers of the generated block in docs/ARCHITECTURE.md.
BEGIN, END = "<!-- BEGIN GENERATED: kernel-table -->", "<!-- END GENERATED: kernel-table -->"


def with_table(text: str) -> str:
    """``text`` (a document holding the markers) with the generated table between them."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{markdown()}\n{END}{tail}"


def main(argv=None) -> int:
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m pagedkv.kernel_table", description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print the docs table")
    ap.add_argument("--write", metavar="DOC", help="rewrite the generated block of DOC (docs/ARCHITECTURE.md)")
    a = ap.parse_args(argv)
    if a.write:
        Path(a.write).write_text(with_table(Path(a.write).read_text()))
    else:
        print(markdown())
    return 0


__all__ = ["BEGIN", "END", "Choice", "SWITCH_OF_OP", "TABLE", "Variant", "auto_order", "choose", "markdown", "unserved",
           "variants", "with_table"]

if __name__ == "__main__":
    raise SystemExit(main())
