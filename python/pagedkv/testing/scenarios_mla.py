"""The MLA half of the scenario driver: one layer of a forward and the state check for MLA caches.

:class:`~pagedkv.testing.scenarios.ScenarioRunner` calls these when ``cache.config.is_mla``; the scenarios
(step lists) are the same for both layer kinds.
"""

from __future__ import annotations

import torch

from .reference import merge_states


def mla_layer(runner, layer: int, n: int) -> None:
    """Append random latents, then compare cross (absorbed), self (non-absorbed) and merge with the reference.

    As a DeepSeek model does: ``self_attention`` among the new tokens merged with the cross state projected
    to ``v_head_dim`` (a random per-head ``W_UV``). In a decode forward the cross view includes the token
    just appended and ``self_attention`` is the empty state.
    """
    cfg, cache, ref = runner.cfg, runner.cache, runner.ref
    where = f"{runner.where} layer {layer}"
    h, dl, r = cfg.num_qo_heads, cfg.latent_dim, cfg.kv_lora_rank
    kv = runner.randn(n, dl)
    kv_in = kv.clone()
    cache.append_mla_kv(layer, kv)
    ref.append_mla_kv(layer, kv.cpu())
    assert torch.equal(kv, kv_in), f"{where}: append_mla_kv modified its input"
    q = runner.randn(n, h, dl)
    o_c, lse_c = cache.cross_attention(layer, q, runner.sm_scale)
    r_oc, r_lc = ref.cross_attention(layer, q.cpu(), runner.sm_scale)
    assert tuple(o_c.shape) == (n, h, r) and o_c.dtype == runner.dtype
    runner.assert_state(o_c, lse_c, r_oc, r_lc, f"{where}: MLA cross_attention")
    # In a decode forward self_attention covers no key (the empty state); merging still checks out.
    qs, ks = runner.randn(n, h, cfg.head_dim), runner.randn(n, h, cfg.head_dim)
    vs = runner.randn(n, h, cfg.v_dim)
    o_s, lse_s = cache.self_attention(layer, qs, ks, vs, runner.sm_scale)
    r_os, r_ls = ref.self_attention(layer, qs.cpu(), ks.cpu(), vs.cpu(), runner.sm_scale)
    runner.assert_state(o_s, lse_s, r_os, r_ls, f"{where}: MLA self_attention")
    w_uv = runner.randn(h, r, cfg.v_dim).cpu().to(torch.float64) / r ** 0.5
    o_cp = torch.einsum("nhr,hrv->nhv", o_c.cpu().to(torch.float64), w_uv).to(runner.dtype).contiguous()
    o_a, lse_a = o_s.clone(), lse_s.clone()
    cache.merge_attn_output_inplace(o_a, lse_a, o_cp.to(cache.device), lse_c)
    ref_o, ref_l = merge_states(o_s.cpu(), lse_s.cpu(), o_cp, lse_c.cpu())
    runner.assert_state(o_a, lse_a, ref_o, ref_l, f"{where}: MLA merge_attn_output_inplace")


def check_mla_state(cache, ref, where: str) -> None:
    """Page accounting and every sequence's latents (bit-exact copies of the inputs)."""
    assert cache.num_available_pages == ref.num_available_pages, (
        f"{where}: num_available_pages {cache.num_available_pages} != reference {ref.num_available_pages}")
    ps = cache.config.page_size
    for seq in sorted(ref.seqs):
        length = ref.get_sequence_length(seq)
        assert cache.get_sequence_length(seq) == length, f"{where}: length of sequence {seq}"
        for start, end in [(0, length)] + ([(ps - 1, ps + 2)] if length > ps + 1 else []):
            got = cache.debug_get_mla_kv(seq, start, end).cpu().to(torch.float64)
            want = ref.debug_get_mla_kv(seq, start, end)
            assert tuple(got.shape) == tuple(want.shape), f"{where}: latent dump shape of sequence {seq}"
            assert torch.equal(got, want), f"{where}: latents of sequence {seq} [{start}, {end}) differ"
