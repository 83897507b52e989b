"""Workloads of ``bench_gpu.py``: what each one is, its inputs (dense and paged, shared by every
implementation), its byte and FLOP counts, and its float32 reference.

MHA shapes: ``hq`` q heads over 8 kv heads, head dim 128, page 16. MLA: DeepSeek's latent (kv_lora_rank
512 + rope 64), page 64. Sequence ``b`` has ``lens[b]`` cached tokens; prefill adds ``qlen`` new tokens to
each (causal over cache + new, bottom-right aligned), decode adds one (its own key included in ``lens``). The
MLA prefill rows time a prefill's paged (absorbed) pass: ``qlen`` new tokens a sequence over its ``lens[b]``
cached latents, not causal (the new tokens' own attention is the ragged MHA kernel's, timed by the prefill rows).

Inline RoPE pairs (``rope=True``, name ``<plain name>-rope``): the same decode with the keys stored unrotated
and rotated in the kernel (cache ``rope_mode="inline"``, theta 10000, scale 1: key ``j`` at position ``j``,
the query at ``lens[b] - 1``); ``rope_pairs`` names each with its plain twin (``bench_gpu`` prints the time
ratio of the TIR backend, inline / plain).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HKV, D, PS = 8, 128, 16
MLA_R, MLA_ROPE, MLA_PS = 512, 64, 64
MLA_DL = MLA_R + MLA_ROPE
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SHORT = {"float16": "f16", "bfloat16": "bf16"}
#: the skewed decode batch: 128 ... 16K tokens, four sequences of each power of two
SKEW = tuple(128 << (i % 8) for i in range(32))
#: ... twice as many: past one wave of the tc decode at 8 kv heads (512 blocks on 264 slots), where the split
#: rule needs the runtime's max_kv_len to tell it from a balanced batch
SKEW64 = SKEW * 2


@dataclass(frozen=True)
class Workload:
    """One benchmark row group. ``kind``: "decode", "prefill", "mla_decode" or "mla_prefill"."""

    kind: str
    dtype: str
    hq: int
    lens: tuple[int, ...]
    qlen: int = 1
    label: str = ""
    #: decode with inline RoPE (keys rotated in the kernel)
    rope: bool = False

    @property
    def name(self) -> str:
        shape = self.label or (f"B{len(self.lens)}xL{self.lens[0]}" if self.qlen == 1
                               else f"{len(self.lens)}x{self.qlen}" + (f"+{self.lens[0]}" if self.lens[0] else ""))
        return f"{self.kind}-h{self.hq}-{SHORT[self.dtype]}-{shape}" + ("-rope" if self.rope else "")

    @property
    def plain(self) -> "Workload":
        """The same workload without RoPE."""
        return Workload(self.kind, self.dtype, self.hq, self.lens, self.qlen, self.label)

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def mla(self) -> bool:
        return self.kind in ("mla_decode", "mla_prefill")

    @property
    def keys(self) -> list[int]:
        """Keys per sequence once the forward's tokens are in (decode: ``lens`` already counts the new one)."""
        return [n + (self.qlen if self.kind == "prefill" else 0) for n in self.lens]

    @property
    def held(self) -> list[int]:
        """Tokens per sequence the cache holds once the forward's are appended (the MLA prefill's paged pass
        reads the cached ``lens`` only, but its forward appends ``qlen`` more)."""
        return [n + self.qlen for n in self.lens] if self.kind == "mla_prefill" else self.keys

    def kv_bytes(self) -> int:
        per_token = MLA_DL * 2 if self.mla else 2 * HKV * D * 2
        return sum(self.keys) * per_token

    def flops(self) -> float:
        """Attention FLOPs (2 per multiply-add; QK and PV), causal pairs only for prefill."""
        if self.mla:
            return 2.0 * self.hq * (MLA_DL + MLA_R) * sum(self.keys) * self.qlen
        if self.kind == "decode":
            return 4.0 * self.hq * D * sum(self.keys)
        pairs = sum(self.qlen * n + self.qlen * (self.qlen + 1) // 2 for n in self.lens)
        return 4.0 * self.hq * D * pairs

    def dense_ok(self) -> bool:
        """torch SDPA runs on a dense batch: every sequence the same length."""
        return len(set(self.lens)) == 1 and not self.mla


#: (B, L) of the inline-RoPE decode pairs (fp16, 32 q heads)
ROPE_SHAPES = ((64, 4096), (1, 32768))


def workloads(dtypes=("float16", "bfloat16")) -> list[Workload]:
    out = []
    for dt in dtypes:
        for hq in (32, 64):
            for b, n in ((1, 32768), (16, 4096), (32, 4096), (64, 4096), (64, 8192), (256, 2048)):
                out.append(Workload("decode", dt, hq, (n,) * b))
                if dt == "float16" and hq == 32 and (b, n) in ROPE_SHAPES:
                    out.append(Workload("decode", dt, hq, (n,) * b, rope=True))
            out.append(Workload("decode", dt, hq, SKEW, label="skew128-16K"))
            out.append(Workload("decode", dt, hq, SKEW64, label="skew64x128-16K"))
        for b, q, cached in ((1, 4096, 0), (16, 1024, 0), (1, 16384, 0), (1, 512, 4096)):
            out.append(Workload("prefill", dt, 32, (cached,) * b, qlen=q))
        for h in (128, 16):
            for b in (64, 128):
                for n in (1024, 8192):
                    out.append(Workload("mla_decode", dt, h, (n,) * b))
            for b, q, cached in ((1, 512, 4096), (8, 128, 2048)):
                out.append(Workload("mla_prefill", dt, h, (cached,) * b, qlen=q))
    return out


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    """Dense per-sequence K/V (``k[b]``, ``v[b]``: ``[keys_b, Hkv, D]``; MLA: ``kv[b]``: ``[keys_b, DL]``),
    the new tokens' q (``[n, Hq, D|DL]``), and one shuffled page layout of the same K/V for the paged peers."""

    q: torch.Tensor
    k: list
    v: list
    pages: torch.Tensor        # MHA [P, 2, Hkv, PS, D]; MLA [P, MLA_PS, DL]
    indptr: torch.Tensor       # int32 [B+1] pages per sequence
    indices: torch.Tensor      # int32 [nnz]
    last: torch.Tensor         # int32 [B]
    kv_lens: torch.Tensor      # int32 [B]
    qo_indptr: torch.Tensor    # int32 [B+1]


def make_inputs(w: Workload, gen: torch.Generator, device="cuda") -> Inputs:
    dt = TORCH_DTYPES[w.dtype]
    ps = MLA_PS if w.mla else PS
    keys = w.keys
    per = [-(-n // ps) for n in keys]
    total = sum(per)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    if w.mla:
        kv = [rnd(n, MLA_DL) for n in keys]
        k, v = kv, kv
        pages = rnd(total + 1, ps, MLA_DL)
    else:
        k = [rnd(n, HKV, D) for n in keys]
        v = [rnd(n, HKV, D) for n in keys]
        pages = rnd(total + 1, 2, HKV, ps, D)
    order = torch.randperm(total + 1, generator=gen, device=device)[:total].to(torch.int32)
    start = 0
    for b, n in enumerate(keys):
        ids = order[start:start + per[b]].long()
        start += per[b]
        pad = per[b] * ps - n
        if w.mla:
            flat = torch.cat([k[b], k[b].new_zeros(pad, MLA_DL)])
            pages[ids] = flat.view(per[b], ps, MLA_DL)
        else:
            for j, src in ((0, k[b]), (1, v[b])):
                flat = torch.cat([src, src.new_zeros(pad, HKV, D)])
                pages[ids, j] = flat.view(per[b], ps, HKV, D).transpose(1, 2)
    nq = w.batch * w.qlen
    q = rnd(nq, w.hq, MLA_DL if w.mla else D)
    ints = dict(dtype=torch.int32, device=device)
    indptr = torch.tensor([0] + list(torch.tensor(per).cumsum(0).tolist()), **ints)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(keys, per)], **ints)
    return Inputs(q=q, k=k, v=v, pages=pages, indptr=indptr, indices=order, last=last,
                  kv_lens=torch.tensor(keys, **ints),
                  qo_indptr=torch.arange(0, nq + 1, w.qlen, **ints))


def sm_scale(w: Workload) -> float:
    return (192 if w.mla else D) ** -0.5  # MLA: DeepSeek's qk head dim (nope 128 + rope 64)


# --------------------------------------------------------------------------------------------------
# the float32 reference
# --------------------------------------------------------------------------------------------------
#: RoPE parameters of the inline-RoPE workloads (the cache's defaults)
ROPE_THETA, ROPE_SCALE = 10000.0, 1.0


def _rotated(w: Workload, x: Inputs, b: int):
    """q and k of sequence ``b`` rotated (float64 RoPE, then float32): q at ``keys - 1``, key ``j`` at ``j``."""
    from pagedkv.testing.reference_ops import rope

    n = w.keys[b]
    q = rope(x.q[b:b + 1], [n - 1], ROPE_THETA, ROPE_SCALE).float()
    return q, rope(x.k[b], range(n), ROPE_THETA, ROPE_SCALE).float()


def reference(w: Workload, x: Inputs) -> torch.Tensor:
    """float32 attention output ``[n, Hq, D|R]`` (bottom-right causal for prefill; q and k rotated first for
    the inline-RoPE workloads)."""
    scale = sm_scale(w)
    outs = []
    for b in range(w.batch):
        q = x.q[b * w.qlen:(b + 1) * w.qlen].float()  # [m, H, *]
        kb = x.k[b]
        if w.rope:
            q, kb = _rotated(w, x, b)
        if w.mla:
            kv = x.k[b].float()
            s = torch.einsum("mhd,ld->hml", q, kv) * scale
            outs.append(torch.einsum("hml,ld->mhd", torch.softmax(s, -1), kv[:, :MLA_R]))
            continue
        g = w.hq // HKV
        k = kb.float().repeat_interleave(g, dim=1)  # [L, H, D]
        v = x.v[b].float().repeat_interleave(g, dim=1)
        m, n = q.shape[0], k.shape[0]
        for r0 in range(0, m, 1024):  # query chunks: a 16K prefill's full score matrix would be 32 GB
            rows = torch.arange(r0, min(m, r0 + 1024), device=q.device)
            s = torch.einsum("mhd,lhd->hml", q[rows], k) * scale
            if w.kind == "prefill":
                s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > (n - m + rows)[:, None], float("-inf"))
            outs.append(torch.einsum("hml,lhd->mhd", torch.softmax(s, -1), v))
    return torch.cat(outs)


def rope_pairs(ws: list[Workload]) -> list[tuple[Workload, Workload]]:
    """(plain, inline RoPE) pairs among ``ws``."""
    names = {w.name: w for w in ws}
    return [(names[w.plain.name], w) for w in ws if w.rope and w.plain.name in names]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref))
