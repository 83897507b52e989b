// PagedKVCache: one forward (begin_forward / end_forward) and the attention entry points, each a fixed
// sequence of kernel-ABI calls through the op table (docs/ARCHITECTURE.md, "One forward").
#include <tvm/ffi/error.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "ops.h"
#include "paged_kv_cache.h"

namespace pagedkv {

namespace {

std::vector<int64_t> ToVector(const ffi::Shape& shape) { return std::vector<int64_t>(shape.begin(), shape.end()); }

// The kernels take any float: a NaN, infinite, zero or negative scale gives NaN, uniform or inverted
// attention weights without an error, so the entry points reject it before any kernel runs.
void CheckScale(const char* what, double sm_scale) {
  if (!std::isfinite(sm_scale) || sm_scale <= 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv: " << what << ": sm_scale must be a finite number > 0 (the softmax "
                              << "scale, usually 1 / sqrt(head_dim)), got " << sm_scale;
  }
}

// "[a, b, c]", at most `max` entries then ", ...".
std::string ListStr(const std::vector<int64_t>& values, size_t max) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < values.size() && i < max; ++i) os << (i ? ", " : "") << values[i];
  if (values.size() > max) os << ", ... (" << values.size() << " in all)";
  os << "]";
  return os.str();
}

// The per-forward limits of begin_forward (batch size, prefill_chunk_size); returns the tokens it appends. The
// chunk limit comes before the page budget: a forward over it is wrong however many pages are free.
// Non-positive lengths are CheckAppend's to report; the sum saturates instead of overflowing.
int64_t CheckForwardSize(const KVConfig& cfg, int64_t batch, const std::vector<int64_t>& lengths) {
  if (batch < 1 || batch > cfg.max_batch_size) {
    TVM_FFI_THROW(ValueError) << "pagedkv: begin_forward batch of " << batch
                              << " sequences is outside [1, max_batch_size=" << cfg.max_batch_size << "]";
  }
  int64_t total = 0;
  bool saturated = false;
  for (int64_t l : lengths) {
    if (l > 0 && __builtin_add_overflow(total, l, &total)) {
      total = std::numeric_limits<int64_t>::max();
      saturated = true;
    }
  }
  if (total > cfg.prefill_chunk_size) {
    TVM_FFI_THROW(ValueError) << "pagedkv: begin_forward appends " << (saturated ? "more than " : "") << total
                              << " tokens in total (the sum of append_lengths), more than prefill_chunk_size="
                              << cfg.prefill_chunk_size << " (the most tokens one forward takes)";
  }
  return total;
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

void PagedKVCacheObj::BeginForward(const ffi::Shape& seq_ids, const ffi::Shape& append_lengths,
                                   const ffi::Optional<ffi::Shape>& token_tree_parent_ptr) {
  CheckNoForward("begin_forward");
  std::vector<int64_t> ids = ToVector(seq_ids), lengths = ToVector(append_lengths);
  int64_t batch = static_cast<int64_t>(ids.size());
  int64_t total = CheckForwardSize(cfg_, batch, lengths);
  pool_.CheckAppend(ids, lengths);  // ids known and unique, lengths >= 1, enough pages
  if (windows_.NumPools() > 0) windows_.CheckFree(pool_.AppendPages(ids, lengths), "begin_forward");
  CheckTokenTree(ids, lengths, token_tree_parent_ptr);
  bool graph = GraphDecode(lengths);
  if (!graph) {  // the CUDA-graph layout was reserved at creation, for max_batch_size
    int64_t fixed = AuxBuilder::Padded(batch + 1) * 4 + 2 * AuxBuilder::Padded(total);
    int64_t entries = MaxEntriesPerPass(batch, cfg_.sink_size);
    int64_t per_pass = 2 * AuxBuilder::Padded(entries + 1) + 2 * AuxBuilder::Padded(entries) + 4;
    int64_t per_pool = AuxBuilder::Padded(total) + kMaxPasses * per_pass +
                       PageValuesBound(pool_, ids, lengths, cfg_.sink_size);
    aux_.Reserve(fixed + (1 + windows_.NumPools()) * per_pool);
  }
  // Nothing below can fail on bad input: mutate.
  pool_.Append(ids, lengths);
  AfterPoolChange(std::nullopt);
  try {
    std::vector<ForwardPlan> plans = BuildPlans(ids, lengths, graph);
    if (graph) {
      UploadGraphPlan(plans[0]);
    } else {
      UploadPlan(plans);
    }
  } catch (...) {
    // A library backend's plan failed (NotifyBeginForward abandoned the forward): take the appended
    // tokens back, so the failed call leaves the cache as it was.
    TakeBack(ids, lengths);
    throw;
  }
  forward_->graph = graph;
  forward_->chains = token_tree_parent_ptr.has_value();
  forward_->written.assign(static_cast<size_t>(cfg_.num_layers), false);
  forward_->seq_ids = std::move(ids);
  forward_->lengths = std::move(lengths);
  if (poison_) PoisonTemps();
}

void PagedKVCacheObj::CheckAppend(const ffi::Shape& seq_ids, const ffi::Shape& append_lengths) const {
  std::vector<int64_t> ids = ToVector(seq_ids), lengths = ToVector(append_lengths);
  pool_.CheckAppend(ids, lengths);
  if (windows_.NumPools() > 0) windows_.CheckFree(pool_.AppendPages(ids, lengths), "check_append");
}

std::vector<ForwardPlan> PagedKVCacheObj::BuildPlans(const std::vector<int64_t>& ids,
                                                     const std::vector<int64_t>& lengths, bool graph) const {
  // A CUDA-graph decode attends each sequence's whole chain in one pass, as a windowed cache does: the
  // captured kernel sequence must not depend on which sequences share a prefix.
  // MLA keeps continuations split: its paged pass is the absorbed (latent) attention, non-causal only,
  // and the new tokens' own attention is the cheaper plain multi-head one (self_attention).
  PlanOptions options;
  options.flat = cfg_.windowed() || graph;
  options.through_continuations = !cfg_.is_mla();
  options.window = cfg_.sliding_window;
  options.sink_size = cfg_.sink_size;
  std::vector<ForwardPlan> plans;
  plans.push_back(BuildForwardPlan(pool_, ids, lengths, options));
  // Layer groups: each window pool's layers attend their chain in one through pass (as a windowed cache's),
  // from the first page their window reads, over the pool's own pages.
  for (int i = 0; i < windows_.NumPools(); ++i) {
    PlanOptions w;
    w.flat = true;
    w.window = windows_.Window(i);
    w.skip_behind_window = true;
    plans.push_back(BuildForwardPlan(pool_, ids, lengths, w));
    windows_.Translate(i, &plans.back());
  }
  return plans;
}

void PagedKVCacheObj::TakeBack(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths) {
  // Appended tokens sit in each sequence's own leaf block, so popping them frees their pages and never
  // copies one (RunCopy is a no-op then).
  for (size_t i = 0; i < ids.size(); ++i) AfterPoolChange(pool_.PopN(ids[i], lengths[i]));
}

bool PagedKVCacheObj::GraphDecode(const std::vector<int64_t>& lengths) const {
  return cfg_.cuda_graph() && std::all_of(lengths.begin(), lengths.end(), [](int64_t l) { return l == 1; });
}

// The arrays every forward has, as handles 0..3 of `aux`: q_pos, q_indptr, prior_len and the B+1 zeros of a
// ragged kv_indptr without keys. q_pos first: get_query_positions hands its view to the model, and ordinary
// compiled ops accept only tensors with byte_offset 0.
static void AddForwardArrays(AuxBuilder* aux, const ForwardPlan& plan) {
  aux->Reset();
  aux->Add(plan.q_pos);
  aux->Add(plan.q_indptr);
  aux->Add(plan.prior_len);
  aux->Add(std::vector<int32_t>(plan.q_indptr.size(), 0));
}

void PagedKVCacheObj::UploadPlan(const std::vector<ForwardPlan>& plans) {
  AddForwardArrays(&aux_, plans[0]);
  std::vector<std::vector<int>> handles;
  for (const ForwardPlan& plan : plans) {
    std::vector<int> h = {aux_.Add(plan.append_slot)};
    for (const PassPlan& p : plan.passes) {
      for (const auto* a : {&p.q_indptr, &p.page_indptr, &p.page_values, &p.last_page_len, &p.k_pos_offset}) {
        h.push_back(aux_.Add(*a));
      }
    }
    handles.push_back(std::move(h));
  }
  aux_.Upload();
  OpenForward(plans, aux_, handles);
}

// CUDA-graph decode: a replay of the captured step reads its index arrays from the device addresses and
// with the shapes the capture saw (TIR kernels derive their split counts from those shapes). So the layout
// depends on the batch size only: the arrays live in their own buffer, allocated once at creation for
// max_batch_size, page_values last with room for every page of every sequence (b * num_pages).
void PagedKVCacheObj::UploadGraphPlan(const ForwardPlan& plan) {
  TVM_FFI_ICHECK_EQ(plan.passes.size(), 1) << "pagedkv: a CUDA-graph decode forward has one pass";
  AuxBuilder& aux = *graph_aux_;
  AddForwardArrays(&aux, plan);
  const PassPlan& p = plan.passes[0];
  std::vector<int> h(6);
  h[0] = aux.Add(plan.append_slot);
  h[1] = aux.Add(p.q_indptr);
  h[2] = aux.Add(p.page_indptr);
  h[4] = aux.Add(p.last_page_len);
  h[5] = aux.Add(p.k_pos_offset);
  h[3] = aux.Add(p.page_values, GraphPageValues(cfg_, p.num_entries()));
  aux.Upload();
  OpenForward({plan}, aux, {h});
}

void PagedKVCacheObj::OpenForward(const std::vector<ForwardPlan>& plans, const AuxBuilder& aux,
                                  const std::vector<std::vector<int>>& handles) {
  const int q_pos = 0, q_indptr = 1, prior = 2, no_keys = 3;  // AddForwardArrays
  const ForwardPlan& plan = plans[0];
  Forward f;
  f.is_decode = plan.is_decode;
  f.num_tokens = plan.num_tokens;
  f.q_indptr = aux.View(q_indptr);
  f.q_pos = aux.View(q_pos);
  f.prior_len = aux.View(prior);
  f.no_keys_indptr = aux.View(no_keys);
  if (cfg_.rope_long_after > 0) {
    // LongRoPE: the long factors when the forward's longest sequence exceeds the pretraining context, as
    // transformers decides per call from max(position_ids) + 1 (python/pagedkv/rope_spec.py).
    int64_t longest = 0;
    for (int32_t p : plan.q_pos) longest = std::max<int64_t>(longest, int64_t{p} + 1);
    if (longest > cfg_.rope_long_after) f.rope_set = 2;
  }
  for (size_t k = 0; k < plans.size(); ++k) {
    const std::vector<int>& h = handles[k];
    PoolForward pool{plans[k].through, aux.View(h[0]), {}};
    for (size_t i = 0; i < plans[k].passes.size(); ++i) {
      const PassPlan& p = plans[k].passes[i];
      const int* v = h.data() + 1 + 5 * i;
      pool.passes.push_back(PassViews{aux.View(v[0]), aux.View(v[1]), aux.View(v[2]), aux.View(v[3]), aux.View(v[4]),
                                      p.all_empty, p.one_query_per_entry, p.causal});
    }
    f.pools.push_back(std::move(pool));
  }
  int64_t n = plan.num_tokens;
  if (!cfg_.is_mla()) {
    f.q = fns_.View(q_buf_, QShape(n), dtype_, 0);
    f.k = fns_.View(k_buf_, KVShape(n), dtype_, 0);
    f.v = fns_.View(v_buf_, KVShape(n), dtype_, 0);
  }
  f.o_tmp = fns_.View(o_tmp_buf_, {n, cfg_.num_qo_heads, PagedVDim()}, o_tmp_buf_.dtype(), 0);
  if (partial_states_) f.o_acc = fns_.View(o_acc_buf_, {n, cfg_.num_qo_heads, PagedVDim()}, kFloat32, 0);
  f.lse_tmp = fns_.View(lse_tmp_buf_, {n, cfg_.num_qo_heads}, kFloat32, 0);
  f.lse_own = fns_.View(lse_own_buf_, {n, cfg_.num_qo_heads}, kFloat32, 0);
  forward_ = std::move(f);
  NotifyBeginForward(plans);
}

std::vector<int64_t> PagedKVCacheObj::UnwrittenLayers() const {
  std::vector<int64_t> out;
  for (size_t l = 0; l < forward_->written.size(); ++l) {
    if (!forward_->written[l]) out.push_back(static_cast<int64_t>(l));
  }
  return out;
}

// A layer that wrote no k/v for the forward's tokens leaves their slots holding whatever the pages held
// before (often the k/v of a removed sequence), which every later forward would read as if it were this
// sequence's: so such a forward is rolled back and rejected here, the last point where it can be undone.
// A CUDA-graph decode is exempt: a replayed graph runs the model's kernels without calling the attention
// entry points that record the writes (the graph was captured from a complete step).
void PagedKVCacheObj::FinishForward(bool allow_unwritten) {
  const Forward& f = CheckForward("end_forward");
  std::vector<int64_t> unwritten = f.graph || allow_unwritten ? std::vector<int64_t>{} : UnwrittenLayers();
  if (!unwritten.empty()) {
    std::ostringstream os;
    os << "pagedkv: end_forward: layer"
       << (unwritten.size() > 1 ? "s " + ListStr(unwritten, 16) : " " + std::to_string(unwritten[0]))
       << " of " << cfg_.num_layers << " wrote no k/v in this forward (each layer's "
       << (cfg_.is_mla() ? "append_mla_kv" : "attention_with_fused_qkv")
       << " must run once per forward, or later forwards read stale k/v in its pages); the forward is rolled "
       << "back: sequences " << ListStr(f.seq_ids, 16) << " are back at their lengths before begin_forward";
    AbortForward();
    TVM_FFI_THROW(RuntimeError) << os.str();
  }
  if (f.chains) {
    for (size_t i = 0; i < f.seq_ids.size(); ++i) chains_[f.seq_ids[i]] += f.lengths[i];
  }
  forward_.reset();
  ops_.EndForward();
  // Every layer has read this forward's windows: give back the window pools' pages behind the next ones.
  windows_.Trim(pool_, chains_);
}

void PagedKVCacheObj::AbortForward() {
  if (!forward_.has_value()) return;
  std::vector<int64_t> ids = std::move(forward_->seq_ids), lengths = std::move(forward_->lengths);
  forward_.reset();
  ops_.EndForward();
  TakeBack(ids, lengths);
}

// Library backends plan here (src/backend.h ForwardInfo). A failure is a device failure: the forward
// is abandoned.
void PagedKVCacheObj::NotifyBeginForward(const std::vector<ForwardPlan>& plans) {
  const ForwardPlan& plan = plans[0];
  ForwardInfo info{&cfg_, device_, &fns_, &plan, forward_->q_indptr, forward_->no_keys_indptr, {},
                   &backend_scratch_, /*cuda_graph=*/cfg_.cuda_graph() && plan.is_decode, pdl_};
  // every pool's passes (layer groups: adapters find a pass by its index views, distinct per pool)
  for (size_t k = 0; k < plans.size(); ++k) {
    for (size_t i = 0; i < plans[k].passes.size(); ++i) {
      const PassViews& v = forward_->pools[k].passes[i];
      info.passes.push_back({&plans[k].passes[i], v.q_indptr, v.page_indptr, v.page_values, v.last_page_len,
                             v.k_pos_offset});
    }
  }
  try {
    ops_.BeginForward(info);
  } catch (...) {
    forward_.reset();
    ops_.EndForward();
    throw;
  }
}

ffi::Map<ffi::String, ffi::Tensor> PagedKVCacheObj::DebugForwardArrays() const {
  const Forward& f = CheckForward("debug_forward_arrays");
  ffi::Map<ffi::String, ffi::Tensor> out;
  out.Set("q_pos", f.q_pos);
  out.Set("q_indptr", f.q_indptr);
  out.Set("prior_len", f.prior_len);
  out.Set("no_keys_indptr", f.no_keys_indptr);
  for (size_t k = 0; k < f.pools.size(); ++k) {
    // the main pool's arrays by their names; a window pool's prefixed "window<W>."
    std::string pool = k == 0 ? "" : "window" + std::to_string(cfg_.pool_window(static_cast<int>(k))) + ".";
    out.Set(pool + "append_slot", f.pools[k].append_slot);
    AddPassArrays(f.pools[k].passes, pool, &out);
  }
  return out;
}

void PagedKVCacheObj::AddPassArrays(const std::vector<PassViews>& passes, const std::string& prefix,
                                    ffi::Map<ffi::String, ffi::Tensor>* out) {
  for (size_t i = 0; i < passes.size(); ++i) {
    const PassViews& p = passes[i];
    std::string pre = prefix + "pass" + std::to_string(i) + ".";
    out->Set(pre + "q_indptr", p.q_indptr);
    out->Set(pre + "page_indptr", p.page_indptr);
    out->Set(pre + "page_values", p.page_values);
    out->Set(pre + "last_page_len", p.last_page_len);
    out->Set(pre + "k_pos_offset", p.k_pos_offset);
  }
}

PagedKVCacheObj::Tensor PagedKVCacheObj::GetQueryPositions() { return CheckForward("get_query_positions").q_pos; }

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
