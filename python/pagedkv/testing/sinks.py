"""The attention-sink checks shared by the CPU and GPU suites (``tests/cpu/test_sinks.py``,
``tests/gpu/test_sinks_gpu.py``): a cache with learnable sinks run beside three float64 references, with the
sinks, without them and with each counted twice (a sink ``s`` merged twice is one sink ``s + ln 2``), so that
every output is checked to be within tolerance of the first and far from the other two: a dropped or doubled
sink fails, whatever pass structure, backend or layer kind lost or doubled it.

Sinks alternate +8, -8, +3, -3 over the heads: a +8 sink takes most of its row's softmax mass (dropping it
multiplies the row's ``o`` by ~e^8 / row mass), a +3 one about as much as the keys (doubling it moves ``o`` by
a third), the negative ones next to nothing (they check that a sink that does not matter does no harm).
"""

from __future__ import annotations

import math

import torch

from ..config import KVCacheConfig
from .reference_mla import reference_for

#: Relative error (per head) within which an output must match the reference with the sinks.
TOL = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-4}
#: A dropped or doubled sink must miss the reference by this many tolerances at least.
SHARP = 5

#: Configs of the GPU suite with sinks (``pagedkv.apps.gpu_bundle`` prebuilds their TIR kernels): gpt-oss's
#: attention (64 q / 8 kv heads, head dim 64, window 128; one pass per sequence), FlashInfer's prefill shape
#: in fp16 (prefix-shared passes, float32 states), and DeepSeek-V2-Lite's MLA latent.
SINK_GPU_CONFIGS = {
    "gptoss-h64x8-d64-bf16-w128": KVCacheConfig(
        num_layers=1, num_qo_heads=64, num_kv_heads=8, head_dim=64, dtype="bfloat16", page_size=16,
        max_batch_size=8, max_total_seq_len=1024, prefill_chunk_size=256, sliding_window=128, attention_sinks=True),
    "h32x8-d128-f16": KVCacheConfig(
        num_layers=1, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16,
        max_batch_size=8, max_total_seq_len=1024, prefill_chunk_size=256, attention_sinks=True),
    "mla-h16-r512-f16": KVCacheConfig.mla(
        num_layers=1, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        dtype="float16", page_size=16, max_batch_size=8, max_total_seq_len=1024, prefill_chunk_size=256,
        attention_sinks=True),
}
#: Those whose FlashInfer modules the bundle already builds for other configs (fp16 head dim 128 without options;
#: the DeepSeek MLA dims): their FlashInfer libraries only link. (gpt-oss's head dim 64 with a window would be a
#: cold fa2 module build of 10-20 minutes: its FlashInfer case skips unless a bundle holds it.)
SINK_FLASHINFER_IDS = ("h32x8-d128-f16", "mla-h16-r512-f16")


def sinks_for(num_heads: int) -> torch.Tensor:
    """float32 ``[num_heads]``: +8, -8, +3, -3, repeated."""
    return torch.tensor([8.0, -8.0, 3.0, -3.0] * (num_heads // 4 + 1))[:num_heads]


def per_head_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest relative error over the query heads of ``[n, H, D]`` states (a +8 head's small rows count as
    much as the others)."""
    got, want = got.double().cpu().transpose(0, 1).flatten(1), want.double().transpose(0, 1).flatten(1)
    return ((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-6)).max().item()


class SinkRun:
    """``cache`` (an ``attention_sinks`` cache) with its sinks, and its three references kept in step.

    Parameters
    ----------
    cache : pagedkv.cache.KVCache
        A fresh cache; inputs are drawn on the CPU by ``gen`` and moved to its device.
    gen : torch.Generator
    sm_scale : float
    """

    def __init__(self, cache, gen: torch.Generator, sm_scale: float = 0.3):
        self.cache, self.cfg, self.gen, self.sm_scale = cache, cache.config, gen, sm_scale
        self.tol = TOL[self.cfg.dtype]
        self.sinks = sinks_for(self.cfg.num_qo_heads)
        self.refs = {name: (reference_for(self.cfg), s) for name, s in
                     (("sinks", self.sinks), ("none", None), ("doubled", self.sinks + math.log(2)))}
        self.dtype = getattr(torch, self.cfg.dtype)

    def each(self, method: str, *args) -> None:
        """``method(*args)`` on the cache and every reference (tensors to the CPU for those)."""
        getattr(self.cache, method)(*args)
        for ref, _s in self.refs.values():
            getattr(ref, method)(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype).to(self.cache.device)

    def _answers(self, method: str, layer: int, x: torch.Tensor) -> dict:
        """Each reference's ``method(layer, x, sm_scale)`` with its sinks."""
        return {name: getattr(ref, method)(layer, x.cpu(), self.sm_scale, **({} if s is None else {"sinks": s}))
                for name, (ref, s) in self.refs.items()}

    def check(self, got, answers: dict, what: str, lse=None) -> None:
        """``got`` (and ``lse``: an lse error of 0.1 counts as 1 relative error) within tolerance of the reference
        with the sinks, and at least ``SHARP`` tolerances from the ones without them and with them doubled."""
        def miss(name):
            want = answers[name] if lse is None else answers[name][0]
            err = per_head_error(got, want)
            return err if lse is None else max(err, (lse.double().cpu() - answers[name][1]).abs().max().item() / 10)

        assert miss("sinks") < self.tol, f"{what}: {miss('sinks'):.3g} from the reference with the sinks"
        for name in ("none", "doubled"):
            assert miss(name) > SHARP * self.tol, (
                f"{what}: {miss(name):.3g} from the reference with sinks {name}: a wrong sink would pass")

    def fused(self, batch: dict, layer: int = 0) -> None:
        """One forward of ``attention_with_fused_qkv`` with the sinks (every layer; ``layer`` checked)."""
        self.each("begin_forward", list(batch), list(batch.values()))
        c = self.cfg
        for lyr in range(c.num_layers):
            qkv = self.randn(sum(batch.values()), c.num_qo_heads + 2 * c.num_kv_heads, c.head_dim)
            got = self.cache.attention_with_fused_qkv(lyr, qkv, self.sm_scale, sinks=self.sinks.to(qkv.device))
            answers = self._answers("attention_with_fused_qkv", lyr, qkv)
            if lyr == layer:
                self.check(got, answers, f"attention_with_fused_qkv {batch}")
        self.each("end_forward")

    def mla(self, batch: dict) -> None:
        """One MLA forward: every layer appends its latents; layer 0's ``cross_attention`` with the sinks (o and
        lse) is checked."""
        self.each("begin_forward", list(batch), list(batch.values()))
        n, c = sum(batch.values()), self.cfg
        for lyr in range(c.num_layers):
            self.each("append_mla_kv", lyr, self.randn(n, c.latent_dim))
        q = self.randn(n, c.num_qo_heads, c.latent_dim)
        o, lse = self.cache.cross_attention(0, q, self.sm_scale, sinks=self.sinks.to(q.device))
        self.check(o, self._answers("cross_attention", 0, q), f"MLA cross_attention {batch}", lse=lse)
        self.each("end_forward")
