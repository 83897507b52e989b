// PagedKVCache: the attention entry points of a forward, each a fixed sequence of kernel-ABI calls through the op
// table (docs/ARCHITECTURE.md, "One forward"). The forward itself (begin_forward / end_forward, its plans and index
// arrays) is in forward.cc.
#include <tvm/ffi/error.h>

#include <cmath>
#include <vector>

#include "ops.h"
#include "paged_kv_cache.h"

namespace pagedkv {

namespace {

// The kernels take any float: a NaN, infinite, zero or negative scale gives NaN, uniform or inverted
// attention weights without an error, so the entry points reject it before any kernel runs.
void CheckScale(const char* what, double sm_scale) {
  if (!std::isfinite(sm_scale) || sm_scale <= 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv: " << what << ": sm_scale must be a finite number > 0 (the softmax "
                              << "scale, usually 1 / sqrt(head_dim)), got " << sm_scale;
  }
}

// Calls attention op A, or its partial-state variant P (the same argument names and positions, o float32) when
// `partial`, with the arguments `fill` sets on a fresh argument struct.
template <typename A, typename P, typename F>
void CallVariant(const OpTable& table, bool partial, F&& fill) {
  if (partial) {
    table.Call(fill(P()));
  } else {
    table.Call(fill(A()));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Kernel sequences

void PagedKVCacheObj::RunRagged(int64_t layer, const ffi::Tensor& q, const ffi::Tensor& k, const ffi::Tensor& v,
                                const ffi::Tensor& o, const ffi::Tensor& lse, double sm_scale, bool partial) {
  const Forward& f = *forward_;
  // New tokens attend causally to the new tokens of their own sequence; keys start at the prior length.
  CallVariant<ops::AttnPrefillRagged, ops::AttnPrefillRaggedPartial>(AttnOps(layer), partial, [&](auto a) {
    return a.q(q).k(k).v(v).q_indptr(f.q_indptr).kv_indptr(f.q_indptr).q_pos(f.q_pos).k_pos_offset(f.prior_len)
        .o(o).lse(lse).causal(1).apply_rope(apply_rope_inline()).rope_scale(cfg_.rope_scale_arg())
        .rope_theta(cfg_.rope_theta).sm_scale(sm_scale);
  });
}

void PagedKVCacheObj::RunPass(int64_t layer, const PassViews& p, const ffi::Tensor& q, const ffi::Tensor& o,
                              const ffi::Tensor& lse, double sm_scale, bool partial) {
  const Forward& f = *forward_;
  bool decode = f.is_decode && p.one_query_per_entry;
  if (cfg_.is_mla()) {
    // Absorbed MLA: keys are the latents, values their first kv_lora_rank elements; no RoPE arguments
    // (the model rotated the rope part before append_mla_kv).
    auto paged = [&](auto a) {
      return a.q(q).pages(pages_[layer]).page_indptr(p.page_indptr).page_values(p.page_values)
          .last_page_len(p.last_page_len).o(o).lse(lse).sm_scale(sm_scale);
    };
    if (decode) {
      CallVariant<ops::MLAAttnDecodePaged, ops::MLAAttnDecodePagedPartial>(ops_, partial, paged);
    } else {
      CallVariant<ops::MLAAttnPrefillPaged, ops::MLAAttnPrefillPagedPartial>(
          ops_, partial, [&](auto a) { return paged(a).q_indptr(p.q_indptr).causal(0); });
    }
    return;
  }
  auto paged = [&](auto a) {
    return a.q(q).pages(pages_[layer]).page_indptr(p.page_indptr).page_values(p.page_values)
        .last_page_len(p.last_page_len).k_pos_offset(p.k_pos_offset).q_pos(f.q_pos).o(o).lse(lse)
        .apply_rope(apply_rope_inline()).rope_scale(cfg_.rope_scale_arg()).rope_theta(cfg_.rope_theta)
        .sm_scale(sm_scale);
  };
  const OpTable& table = AttnOps(layer);
  if (decode) {
    CallVariant<ops::AttnDecodePaged, ops::AttnDecodePagedPartial>(table, partial, paged);
  } else {
    // Multi-query entries (prefill, or decode queries grouped on a shared prefix): every key precedes
    // every query of the entry and the pass is non-causal, except the own pass of a through prefill, whose
    // entries end with their queries' own tokens.
    CallVariant<ops::AttnPrefillPaged, ops::AttnPrefillPagedPartial>(
        table, partial, [&](auto a) { return paged(a).q_indptr(p.q_indptr).causal(p.causal ? 1 : 0); });
  }
}

// The sinks (one logit per query head, value 0) count once per query whatever the passes: they are merged into
// the final state only, by apply_sinks after the last pass or merge, or inside the last float32 merge
// (RunPartialStates). Library kernels that return their lse (FlashInfer's) need no sink variant.
void PagedKVCacheObj::RunAttention(int64_t layer, const ffi::Tensor& q, const ffi::Tensor& o,
                                   const ffi::Tensor& lse, double sm_scale, bool ragged, const ffi::Tensor* sinks) {
  const Forward& f = *forward_;
  int states = ragged ? 1 : 0;
  for (const PassViews& p : PlanOf(layer).passes) states += p.all_empty ? 0 : 1;
  if (states >= 2 && partial_states_) {
    RunPartialStates(layer, q, o, lse, sm_scale, ragged, states, sinks);
    return;
  }
  if (ragged) RunRagged(layer, f.q, f.k, f.v, o, lse, sm_scale, /*partial=*/false);
  RunPasses(layer, q, o, lse, sm_scale, /*output_written=*/ragged);
  if (sinks != nullptr) ops_.Call(ops::ApplySinks().o(o).lse(lse).sinks(*sinks));
}

// Two states or more, on the partial-state ops: the first goes to (o_acc, lse), each later one to the temps
// (o_tmp float32, lse_tmp), merged into (o_acc, lse) in float32 by merge_state_partial, which also writes the
// merged o rounded to the storage dtype: after the last merge, o is the whole attention rounded once. With
// sinks, the last merge is merge_state_partial_sinks: the sinks join that float32 merge, before the rounding.
void PagedKVCacheObj::RunPartialStates(int64_t layer, const ffi::Tensor& q, const ffi::Tensor& o,
                                       const ffi::Tensor& lse, double sm_scale, bool ragged, int states,
                                       const ffi::Tensor* sinks) {
  const Forward& f = *forward_;
  int done = 0;
  auto state = [&](auto&& run) {
    bool first = done == 0, last = ++done == states;
    run(first ? f.o_acc : f.o_tmp, first ? lse : f.lse_tmp);
    if (first) return;
    if (last && sinks != nullptr) {
      ops_.Call(ops::MergeStatePartialSinks().o_a(f.o_acc).lse_a(lse).o_b(f.o_tmp).lse_b(f.lse_tmp)
                    .sinks(*sinks).o(o));
    } else {
      ops_.Call(ops::MergeStatePartial().o_a(f.o_acc).lse_a(lse).o_b(f.o_tmp).lse_b(f.lse_tmp).o(o));
    }
  };
  if (ragged) {
    state([&](const ffi::Tensor& so, const ffi::Tensor& sl) {
      RunRagged(layer, f.q, f.k, f.v, so, sl, sm_scale, true);
    });
  }
  for (const PassViews& p : PlanOf(layer).passes) {
    if (p.all_empty) continue;
    state([&](const ffi::Tensor& so, const ffi::Tensor& sl) { RunPass(layer, p, q, so, sl, sm_scale, true); });
  }
}

// Runs every non-empty pass in the storage dtype (one state, or a table without the partial-state ops): the first
// result goes to (o, lse) unless `output_written`, later ones go to the temps and are merged in (each rounded).
// If nothing was written, the last pass runs anyway to write the empty state.
void PagedKVCacheObj::RunPasses(int64_t layer, const ffi::Tensor& q, const ffi::Tensor& o,
                                const ffi::Tensor& lse, double sm_scale, bool output_written) {
  const Forward& f = *forward_;
  const std::vector<PassViews>& passes = PlanOf(layer).passes;
  for (size_t i = 0; i < passes.size(); ++i) {
    const PassViews& p = passes[i];
    bool last = i + 1 == passes.size();
    if (p.all_empty && (output_written || !last)) continue;
    if (!output_written) {
      RunPass(layer, p, q, o, lse, sm_scale, /*partial=*/false);
      output_written = true;
    } else {
      RunPass(layer, p, q, f.o_tmp, f.lse_tmp, sm_scale, /*partial=*/false);
      ops_.Call(ops::MergeState().o_a(o).lse_a(lse).o_b(f.o_tmp).lse_b(f.lse_tmp));
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Entry points

void PagedKVCacheObj::AttentionWithFusedQKV(int64_t layer, Tensor qkv, ffi::Optional<Tensor> mask, Tensor o,
                                            double sm_scale) {
  FusedAttention(layer, qkv, mask, o, sm_scale, /*sinks=*/nullptr);
}

void PagedKVCacheObj::AttentionWithFusedQKVSinks(int64_t layer, Tensor qkv, Tensor sinks, Tensor o, double sm_scale) {
  FusedAttention(layer, qkv, std::nullopt, o, sm_scale, &sinks);
}

void PagedKVCacheObj::FusedAttention(int64_t layer, const Tensor& qkv, const ffi::Optional<Tensor>& mask,
                                     const Tensor& o, double sm_scale, const Tensor* sinks) {
  const Forward& f = CheckForward("attention_with_fused_qkv");
  ++attention_calls_;
  CheckKind("attention_with_fused_qkv", false);
  if (mask.has_value()) {
    TVM_FFI_THROW(NotImplementedError) << "not supported by pagedkv: attention masks (AttentionWithFusedQKV "
                                       << "with a mask; pagedkv's masks are causal, and its window the config's)";
  }
  CheckLayer(layer);
  CheckScale("attention_with_fused_qkv", sm_scale);
  int64_t n = f.num_tokens;
  CheckTensor(qkv, "qkv", {n, cfg_.num_qo_heads + 2 * cfg_.num_kv_heads, cfg_.head_dim}, dtype_, device_);
  CheckTensor(o, "o", QShape(n), dtype_, device_);
  if (sinks != nullptr) CheckSinks("attention_with_fused_qkv", *sinks);
  int apply_rope = cfg_.rope_mode == "normal" ? f.rope_set : 0;  // "inline": k is stored unrotated
  ops_.Call(ops::SplitRotary()
                .qkv(qkv).q_pos(f.q_pos).q(f.q).k(f.k).v(f.v).apply_rope(apply_rope)
                .rope_scale(cfg_.rope_scale_arg()).rope_theta(cfg_.rope_theta));
  const PoolForward& plan = PlanOf(layer);
  auto append = [&] {
    ops_.Call(ops::AppendKV().pages(pages_[layer]).k(f.k).v(f.v).slot(plan.append_slot));
  };
  if (plan.through) {
    append();  // the passes include the new tokens
    RunAttention(layer, f.q, o, f.lse_own, sm_scale, /*ragged=*/false, sinks);
  } else {
    RunAttention(layer, f.q, o, f.lse_own, sm_scale, /*ragged=*/true, sinks);
    append();
  }
  forward_->written[layer] = true;
}

void PagedKVCacheObj::SelfAttention(int64_t layer, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                                    double sm_scale) {
  const Forward& f = CheckForward("self_attention");
  ++attention_calls_;
  CheckLayer(layer);
  CheckScale("self_attention", sm_scale);
  int64_t n = f.num_tokens;
  CheckTensor(q, "q", QShape(n), dtype_, device_);
  CheckTensor(k, "k", KVShape(n), dtype_, device_);
  CheckTensor(v, "v", {n, cfg_.num_kv_heads, cfg_.v_head_dim}, dtype_, device_);
  CheckTensor(o, "o", {n, cfg_.num_qo_heads, cfg_.v_head_dim}, dtype_, device_);
  CheckTensor(lse, "lse", {n, cfg_.num_qo_heads}, kFloat32, device_);
  if (PlanOf(layer).through) {
    // cross_attention's view of a decode forward (or of any forward of a windowed cache) already holds the
    // new tokens, so self_attention covers no key: the ragged kernel over zero keys writes the empty state
    // (o = 0, lse = -1e30), and merging self and cross is the full attention whichever path the model takes.
    AttnOps(layer).Call(ops::AttnPrefillRagged()
                  .q(q).k(k).v(v).q_indptr(f.q_indptr).kv_indptr(f.no_keys_indptr).q_pos(f.q_pos)
                  .k_pos_offset(f.prior_len).o(o).lse(lse).causal(1).apply_rope(apply_rope_inline())
                  .rope_scale(cfg_.rope_scale_arg()).rope_theta(cfg_.rope_theta).sm_scale(sm_scale));
    return;
  }
  RunRagged(layer, q, k, v, o, lse, sm_scale, /*partial=*/false);
}

void PagedKVCacheObj::CrossAttention(int64_t layer, Tensor q, Tensor o, Tensor lse, double sm_scale) {
  PagedAttention(layer, q, o, lse, sm_scale, /*sinks=*/nullptr);
}

void PagedKVCacheObj::CrossAttentionSinks(int64_t layer, Tensor q, Tensor sinks, Tensor o, Tensor lse,
                                          double sm_scale) {
  PagedAttention(layer, q, o, lse, sm_scale, &sinks);
}

void PagedKVCacheObj::PagedAttention(int64_t layer, const Tensor& q, const Tensor& o, const Tensor& lse,
                                     double sm_scale, const Tensor* sinks) {
  const Forward& f = CheckForward("cross_attention");
  ++attention_calls_;
  CheckLayer(layer);
  CheckScale("cross_attention", sm_scale);
  int64_t n = f.num_tokens;
  CheckTensor(q, "q", {n, cfg_.num_qo_heads, PagedQDim()}, dtype_, device_);
  CheckTensor(o, "o", {n, cfg_.num_qo_heads, PagedVDim()}, dtype_, device_);
  CheckTensor(lse, "lse", {n, cfg_.num_qo_heads}, kFloat32, device_);
  if (sinks != nullptr) CheckSinks("cross_attention", *sinks);
  if (PlanOf(layer).through && !f.written[layer]) {
    // Its passes read the forward's own token slots, which would still hold the pages' earlier contents.
    TVM_FFI_THROW(RuntimeError) << "pagedkv: cross_attention of layer " << layer << " attends over this forward's "
                                << "new tokens (a decode, continuation or sliding-window forward), whose k/v layer "
                                << layer << " has not written yet: call "
                                << (cfg_.is_mla() ? "append_mla_kv" : "attention_with_fused_qkv") << " of layer "
                                << layer << " first";
  }
  RunAttention(layer, q, o, lse, sm_scale, /*ragged=*/false, sinks);
}

ffi::Array<PagedKVCacheObj::Tensor> PagedKVCacheObj::MergeAttnOutputInplace(Tensor o_a, Tensor lse_a, Tensor o_b,
                                                                          Tensor lse_b) {
  CheckDefined(o_a, "o_a");
  if (o_a.ndim() != 3) {
    TVM_FFI_THROW(ValueError) << "pagedkv: tensor 'o_a' must be [n, H, D], given ndim " << o_a.ndim();
  }
  std::vector<int64_t> o_shape(o_a.shape().begin(), o_a.shape().end());
  if (o_shape[1] != cfg_.num_qo_heads) {
    TVM_FFI_THROW(ValueError) << "pagedkv: tensor 'o_a' must have num_qo_heads=" << cfg_.num_qo_heads
                              << " heads (dim 1), given " << o_shape[1];
  }
  CheckTensor(o_a, "o_a", o_shape, dtype_, device_);
  CheckTensor(o_b, "o_b", o_shape, dtype_, device_);
  CheckTensor(lse_a, "lse_a", {o_shape[0], o_shape[1]}, kFloat32, device_);
  CheckTensor(lse_b, "lse_b", {o_shape[0], o_shape[1]}, kFloat32, device_);
  ops_.Call(ops::MergeState().o_a(o_a).lse_a(lse_a).o_b(o_b).lse_b(lse_b));
  return {o_a, lse_a};
}

void PagedKVCacheObj::AppendMLAKV(int64_t layer, Tensor kv) {
  const Forward& f = CheckForward("append_mla_kv");
  ++attention_calls_;
  CheckKind("append_mla_kv", true);
  CheckLayer(layer);
  CheckTensor(kv, "kv", {f.num_tokens, cfg_.latent_dim()}, dtype_, device_);
  ops_.Call(ops::MLAAppendKV().pages(pages_[layer]).kv(kv).slot(PlanOf(layer).append_slot));
  forward_->written[layer] = true;
}

}  // namespace pagedkv
