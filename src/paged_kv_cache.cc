// PagedKVCache: creation, sequence management, debug access and poisoning.
// Forward and attention orchestration is in attention.cc.
#include "paged_kv_cache.h"

#include <tvm/ffi/error.h>

#include "ops.h"

namespace pagedkv {

namespace {

// Initial aux staging size: a forward of max_batch_size sequences and prefill_chunk_size tokens whose
// chains together list every page once. Larger plans (heavy prefix sharing) grow it in begin_forward.
int64_t InitialAuxElems(const KVConfig& c) {
  int64_t b = c.max_batch_size, n = c.prefill_chunk_size;
  int64_t per_pass = 2 * AuxBuilder::Padded(b + 1) + 2 * AuxBuilder::Padded(b) + 4;
  return 2 * AuxBuilder::Padded(b + 1) + 2 * AuxBuilder::Padded(n) + AuxBuilder::Padded(b) +
         kMaxPasses * per_pass + c.num_pages() + b;
}

}  // namespace

PagedKVCacheObj::PagedKVCacheObj(KVConfig config, OpTable ops, DLDevice device)
    : cfg_(std::move(config)),
      ops_(std::move(ops)),
      device_(device),
      dtype_(cfg_.dl_dtype()),
      pool_(cfg_.num_pages(), cfg_.page_size),
      aux_(&fns_, device, InitialAuxElems(cfg_)) {
  int64_t hq = cfg_.num_qo_heads, hkv = cfg_.num_kv_heads, d = cfg_.head_dim, n = cfg_.prefill_chunk_size;
  std::vector<int64_t> pages_shape = PageShape();
  pages_shape.insert(pages_shape.begin(), cfg_.num_pages());
  for (int64_t l = 0; l < cfg_.num_layers; ++l) pages_.push_back(fns_.Alloc(pages_shape, dtype_, device_));
  // The split q/k/v buffers serve attention_with_fused_qkv, which MLA layers do not have.
  int64_t split_n = cfg_.is_mla() ? 1 : n;
  q_buf_ = fns_.Alloc({split_n, hq, d}, dtype_, device_);
  k_buf_ = fns_.Alloc({split_n, hkv, d}, dtype_, device_);
  v_buf_ = fns_.Alloc({split_n, hkv, d}, dtype_, device_);
  o_tmp_buf_ = fns_.Alloc({n, hq, PagedVDim()}, dtype_, device_);
  lse_tmp_buf_ = fns_.Alloc({n, hq}, kFloat32, device_);
  lse_own_buf_ = fns_.Alloc({n, hq}, kFloat32, device_);
}

PagedKVCache CreatePagedKVCache(const std::string& config_json, const ffi::Shape& runtime_values,
                                const ffi::Array<ffi::Any>& op_table, const ffi::Tensor& device_ref) {
  KVConfig config = ParseConfig(config_json, runtime_values);
  OpTable ops = ParseOpTable(op_table, config.layer_kind());
  return PagedKVCache(ffi::make_object<PagedKVCacheObj>(std::move(config), std::move(ops), device_ref.device()));
}

// ---------------------------------------------------------------------------------------------------
// Checks

void PagedKVCacheObj::CheckNoForward(const char* what) const {
  if (forward_.has_value()) {
    TVM_FFI_THROW(RuntimeError) << "pagedkv: " << what << " is not allowed between begin_forward and "
                                << "end_forward (the forward's index arrays refer to the current pages)";
  }
}

const PagedKVCacheObj::Forward& PagedKVCacheObj::CheckForward(const char* what) const {
  if (!forward_.has_value()) {
    TVM_FFI_THROW(RuntimeError) << "pagedkv: " << what << " needs an open forward (call begin_forward first)";
  }
  return *forward_;
}

void PagedKVCacheObj::CheckKind(const char* what, bool mla) const {
  if (cfg_.is_mla() != mla) {
    TVM_FFI_THROW(ValueError) << "pagedkv: " << what << " is for " << (mla ? "mla" : "mha")
                              << " layers; this cache's layers are " << cfg_.layer_kind();
  }
}

std::vector<int64_t> PagedKVCacheObj::PageShape() const {
  if (cfg_.is_mla()) return {1, 1, cfg_.page_size, cfg_.latent_dim()};
  return {2, cfg_.num_kv_heads, cfg_.page_size, cfg_.head_dim};
}

void PagedKVCacheObj::CheckLayer(int64_t layer) const {
  if (layer < 0 || layer >= cfg_.num_layers) {
    TVM_FFI_THROW(ValueError) << "pagedkv: layer " << layer << " is out of range [0, " << cfg_.num_layers << ")";
  }
}

// ---------------------------------------------------------------------------------------------------
// Sequences

void PagedKVCacheObj::AddSequence(int64_t seq_id) {
  CheckNoForward("add_sequence");
  pool_.Add(seq_id);
}

void PagedKVCacheObj::RemoveSequence(int64_t seq_id) {
  CheckNoForward("remove_sequence");
  pool_.Remove(seq_id);
}

void PagedKVCacheObj::ForkSequence(int64_t parent_id, int64_t child_id, int64_t fork_pos) {
  CheckNoForward("fork_sequence");
  std::optional<PageCopy> copy = pool_.Fork(parent_id, child_id, fork_pos);
  PoisonNewPages();  // before the copy, so the copied tokens survive
  RunCopy(copy);
}

void PagedKVCacheObj::PopN(int64_t seq_id, int64_t n) {
  CheckNoForward("popn");
  std::optional<PageCopy> copy = pool_.PopN(seq_id, n);
  PoisonNewPages();
  RunCopy(copy);
}

void PagedKVCacheObj::Clear() {
  if (forward_.has_value()) ops_.EndForward();
  forward_.reset();  // clearing also abandons an open forward
  pool_.Clear();
  if (poison_) {
    for (int32_t page : pool_.FreePages()) PoisonPage(page);
  }
}

void PagedKVCacheObj::RunCopy(const std::optional<PageCopy>& copy) {
  if (!copy.has_value()) return;
  for (const ffi::Tensor& pages : pages_) {
    ops_.Call(ops::CopyPage()
                  .pages(pages).src_page(static_cast<int64_t>(copy->src)).dst_page(static_cast<int64_t>(copy->dst))
                  .num_tokens(copy->num_tokens));
  }
}

// ---------------------------------------------------------------------------------------------------
// Debug access: slot maps computed on the host, one gather/append call per layer on views of the dumps.

void PagedKVCacheObj::CheckDebugRange(const char* what, int64_t seq_id, int64_t start, int64_t count) const {
  int64_t length = pool_.Get(seq_id).length;  // throws naming an unknown id
  if (start < 0 || count < 0 || start + count > length) {
    TVM_FFI_THROW(ValueError) << "pagedkv: " << what << " range [" << start << ", " << start + count
                              << ") is not inside sequence " << seq_id << " of length " << length;
  }
}

ffi::Tensor PagedKVCacheObj::SlotsOnDevice(int64_t seq_id, int64_t start, int64_t count) {
  std::vector<int32_t> pages = pool_.ChainPages(seq_id);
  std::vector<int32_t> slots;
  int64_t ps = cfg_.page_size;
  for (int64_t t = start; t < start + count; ++t) slots.push_back(static_cast<int32_t>(pages[t / ps] * ps + t % ps));
  if (!debug_aux_) debug_aux_ = std::make_unique<AuxBuilder>(&fns_, device_, AuxBuilder::Padded(count));
  debug_aux_->Reserve(AuxBuilder::Padded(count));
  debug_aux_->Reset();
  int handle = debug_aux_->Add(slots);
  debug_aux_->Upload();
  return debug_aux_->View(handle);
}

void PagedKVCacheObj::DebugGetKV(int64_t seq_id, int64_t start, int64_t end, const ffi::Tensor& k_out,
                                 const ffi::Tensor& v_out) {
  CheckDebugRange("debug_get_kv", seq_id, start, end - start);
  CheckKind("debug_get_kv", false);
  int64_t m = end - start;
  std::vector<int64_t> shape = {cfg_.num_layers, m, cfg_.num_kv_heads, cfg_.head_dim};
  CheckTensor(k_out, "k_out", shape, dtype_, device_);
  CheckTensor(v_out, "v_out", shape, dtype_, device_);
  ops_.Get(ops::kGatherKV);  // an optional op: fails naming it when the table lacks it, even for m == 0
  if (m == 0) return;
  ffi::Tensor slots = SlotsOnDevice(seq_id, start, m);
  uint64_t layer_bytes = NumBytes(KVShape(m), dtype_);
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    ffi::Tensor k = fns_.View(k_out, KVShape(m), dtype_, l * layer_bytes);
    ffi::Tensor v = fns_.View(v_out, KVShape(m), dtype_, l * layer_bytes);
    ops_.Call(ops::GatherKV().pages(pages_[l]).slot(slots).k(k).v(v));
  }
}

void PagedKVCacheObj::DebugSetKV(int64_t seq_id, int64_t start, const ffi::Tensor& k, const ffi::Tensor& v) {
  CheckKind("debug_set_kv", false);
  int64_t m = k.ndim() == 4 ? k.shape()[1] : -1;
  std::vector<int64_t> shape = {cfg_.num_layers, m, cfg_.num_kv_heads, cfg_.head_dim};
  CheckTensor(k, "k", shape, dtype_, device_);
  CheckTensor(v, "v", shape, dtype_, device_);
  CheckDebugRange("debug_set_kv", seq_id, start, m);
  if (m == 0) return;
  ffi::Tensor slots = SlotsOnDevice(seq_id, start, m);
  uint64_t layer_bytes = NumBytes(KVShape(m), dtype_);
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    ffi::Tensor k_l = fns_.View(k, KVShape(m), dtype_, l * layer_bytes);
    ffi::Tensor v_l = fns_.View(v, KVShape(m), dtype_, l * layer_bytes);
    ops_.Call(ops::AppendKV().pages(pages_[l]).k(k_l).v(v_l).slot(slots));
  }
}

void PagedKVCacheObj::DebugGetMLAKV(int64_t seq_id, int64_t start, int64_t end, const ffi::Tensor& kv_out) {
  CheckKind("debug_get_mla_kv", true);
  CheckDebugRange("debug_get_mla_kv", seq_id, start, end - start);
  int64_t m = end - start;
  CheckTensor(kv_out, "kv_out", {cfg_.num_layers, m, cfg_.latent_dim()}, dtype_, device_);
  ops_.Get(ops::kMLAGatherKV);  // an optional op: fails naming it when the table lacks it, even for m == 0
  if (m == 0) return;
  ffi::Tensor slots = SlotsOnDevice(seq_id, start, m);
  std::vector<int64_t> layer_shape = {m, cfg_.latent_dim()};
  uint64_t layer_bytes = NumBytes(layer_shape, dtype_);
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    ffi::Tensor kv_l = fns_.View(kv_out, layer_shape, dtype_, l * layer_bytes);
    ops_.Call(ops::MLAGatherKV().pages(pages_[l]).slot(slots).kv(kv_l));
  }
}

void PagedKVCacheObj::DebugSetMLAKV(int64_t seq_id, int64_t start, const ffi::Tensor& kv) {
  CheckKind("debug_set_mla_kv", true);
  int64_t m = kv.ndim() == 3 ? kv.shape()[1] : -1;
  CheckTensor(kv, "kv", {cfg_.num_layers, m, cfg_.latent_dim()}, dtype_, device_);
  CheckDebugRange("debug_set_mla_kv", seq_id, start, m);
  if (m == 0) return;
  ffi::Tensor slots = SlotsOnDevice(seq_id, start, m);
  std::vector<int64_t> layer_shape = {m, cfg_.latent_dim()};
  uint64_t layer_bytes = NumBytes(layer_shape, dtype_);
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    ffi::Tensor kv_l = fns_.View(kv, layer_shape, dtype_, l * layer_bytes);
    ops_.Call(ops::MLAAppendKV().pages(pages_[l]).kv(kv_l).slot(slots));
  }
}

// ---------------------------------------------------------------------------------------------------
// Poisoning: pages fresh from the free list hold NaN in every layer, so reading unwritten memory fails
// loudly in tests instead of silently reading stale tokens.

void PagedKVCacheObj::DebugPoisonPages(bool on) {
  poison_ = on;
  if (!on) return;
  for (int32_t page : pool_.FreePages()) PoisonPage(page);
  PoisonTemps();
}

void PagedKVCacheObj::PoisonNewPages() {
  std::vector<int32_t> pages = pool_.TakeNewPages();  // drained even when off, so it never grows
  if (!poison_) return;
  for (int32_t page : pages) PoisonPage(page);
}

void PagedKVCacheObj::PoisonPage(int32_t page) {
  std::vector<int64_t> shape = PageShape();
  size_t bytes = NumBytes(shape, dtype_);
  std::vector<uint8_t> nan = NaNBytes(dtype_, bytes / ((dtype_.bits + 7) / 8));
  for (const ffi::Tensor& pages : pages_) {
    fns_.CopyFromBytes(fns_.View(pages, shape, dtype_, static_cast<uint64_t>(page) * bytes), nan.data(), bytes);
  }
}

void PagedKVCacheObj::PoisonTemps() {
  for (const ffi::Tensor* t : {&o_tmp_buf_, &lse_tmp_buf_, &lse_own_buf_, &q_buf_, &k_buf_, &v_buf_}) {
    size_t count = static_cast<size_t>((*t).numel());
    std::vector<uint8_t> nan = NaNBytes((*t).dtype(), count);
    fns_.CopyFromBytes(*t, nan.data(), nan.size());
  }
}

ffi::Map<ffi::String, ffi::String> PagedKVCacheObj::OpBackends() const {
  ffi::Map<ffi::String, ffi::String> out;
  for (const auto& [op, tag] : ops_.backends) out.Set(op, tag);
  return out;
}

}  // namespace pagedkv
