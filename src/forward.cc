// PagedKVCache: one forward (begin_forward / end_forward): the checks before it, its plans uploaded as index
// arrays, the library backends' planning, and the rollback of a forward that cannot finish (docs/ARCHITECTURE.md,
// "One forward"). The attention entry points that run inside it are in attention.cc.
#include <tvm/ffi/error.h>

#include <algorithm>
#include <limits>
#include <sstream>
#include <string>

#include "ops.h"
#include "paged_kv_cache.h"

namespace pagedkv {

namespace {

std::vector<int64_t> ToVector(const ffi::Shape& shape) { return std::vector<int64_t>(shape.begin(), shape.end()); }

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
    w.sink_size = cfg_.sink_size;  // each sliding group reads the sink tokens (their pages are kept: Trim)
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

}  // namespace pagedkv
