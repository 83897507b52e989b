// PagedKVCache: creation, sequence management, debug access and poisoning.
// The forward is in forward.cc, the attention entry points in attention.cc.
#include "paged_kv_cache.h"

#include <tvm/ffi/error.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <new>
#include <sstream>

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

// One page of one layer: MHA [2 (K, V), Hkv, ps, D]; MLA [1, 1, ps, latent_dim].
std::vector<int64_t> PageShapeOf(const KVConfig& c) {
  if (c.is_mla()) return {1, 1, c.page_size, c.latent_dim()};
  return {2, c.num_kv_heads, c.page_size, c.head_dim};
}

// Products and sums of sizes that stick at UINT64_MAX instead of wrapping (no device holds that much).
struct Size {
  uint64_t value = 0;
  bool overflow = false;
  Size operator*(uint64_t b) const {
    Size out{0, overflow};
    out.overflow |= __builtin_mul_overflow(value, b, &out.value);
    return out;
  }
  Size operator+(const Size& b) const {
    Size out{0, overflow || b.overflow};
    out.overflow |= __builtin_add_overflow(value, b.value, &out.value);
    return out;
  }
};

// int32 elements of the CUDA-graph decode layout (forward.cc UploadGraphPlan) for max_batch_size sequences:
// nine arrays of b or b + 1 entries, then page_values with room for GraphPageValues = b * num_pages (padded).
// A Size, because ComputeDeviceBytes counts it before CheckCapacity has bounded the config.
Size GraphAuxElems(const KVConfig& c, const Size& num_pages) {
  uint64_t b = static_cast<uint64_t>(c.max_batch_size);
  Size fixed{static_cast<uint64_t>(4 * AuxBuilder::Padded(c.max_batch_size + 1) + 5 * AuxBuilder::Padded(c.max_batch_size))};
  return fixed + Size{b, num_pages.overflow} * num_pages.value + Size{3};
}

// Whether a cache of `c` with `table` keeps multi-pass states in float32 (PagedKVCacheObj::partial_states_): the
// table holds every partial-state op of its kind, and its storage dtype is not float32 already (then the plain
// kernels write float32 and merge_state merges in it: nothing to gain, and no o_acc buffer).
bool UsesPartialStates(const OpTable& table, const KVConfig& c) {
  auto all = [&table](const auto& names) {
    return std::all_of(names.begin(), names.end(), [&table](const char* op) { return table.adapters.count(op) > 0; });
  };
  return c.dtype != "float32" && (c.is_mla() ? all(ops::kPartialMLAOps) : all(ops::kPartialMHAOps));
}

// A sinks config's table holds the sink ops its forwards call: apply_sinks after a single state (or a storage-dtype
// merge), and merge_state_partial_sinks as the last merge where multi-pass states are float32 (`partial`).
void CheckSinkOps(const OpTable& table, const KVConfig& c, bool partial) {
  if (!c.attention_sinks) return;
  for (const char* op : {ops::kApplySinks, ops::kMergeStatePartialSinks}) {
    if (op == ops::kMergeStatePartialSinks && !partial) continue;
    if (!table.adapters.count(op)) {
      TVM_FFI_THROW(ValueError) << "pagedkv.create: the config has attention_sinks = true but the op table has no '"
                                << op << "' (it merges the sinks into "
                                << (op == ops::kApplySinks ? "a single state" : "a multi-pass forward's float32 state")
                                << "); build the table for this config (pagedkv.ops.ops_for)";
    }
  }
}

// Layer groups (schema 7): the op table holds a sub-table for each window of the groups, and only those, with the
// window ops the main table holds (so every layer's attention finds its kernels).
void CheckWindowTables(const OpTable& table, const KVConfig& c) {
  for (const auto& [window, sub] : table.windows) {
    if (!std::count(c.group_windows.begin(), c.group_windows.end(), window)) {
      TVM_FFI_THROW(ValueError) << "pagedkv.create: the op table has kernels for window " << window
                                << ", which no layer group of the config has";
    }
  }
  for (size_t i = 0; i < c.group_windows.size(); ++i) {
    int64_t window = c.group_windows[i];
    auto it = table.windows.find(window);
    for (const char* op : ops::kWindowOps) {
      if (!table.adapters.count(op) || (it != table.windows.end() && it->second->adapters.count(op))) continue;
      TVM_FFI_THROW(ValueError) << "pagedkv.create: the op table has no '" << op << "' for window " << window
                                << " (layer groups " << c.PoolGroupNames(static_cast<int>(i) + 1)
                                << "): build it with the config's layer_groups (pagedkv.ops.WINDOW_OPS)";
    }
  }
}

// The device memory a cache of `c` allocates: every layer's pages and the chunk-sized work buffers
// (the constructor's allocations, in the same order). `partial`: float32 partial states (o_tmp in float32 and
// the o_acc buffer).
struct DeviceBytes {
  Size num_pages, page, pages, work, total;
};

DeviceBytes ComputeDeviceBytes(const KVConfig& c, bool partial) {
  uint64_t elem = (c.page_dl_dtype().bits + 7) / 8;  // FP8 pages: one byte an element
  DeviceBytes b;
  // ceil(max_total_seq_len / page_size) + max_batch_size, without the overflow of the plain formula
  b.num_pages = Size{static_cast<uint64_t>((c.max_total_seq_len - 1) / c.page_size + 1)} +
                Size{static_cast<uint64_t>(c.max_batch_size)};
  b.page = Size{elem};
  for (int64_t d : PageShapeOf(c)) b.page = b.page * static_cast<uint64_t>(d);
  // a layer of a window pool (layer groups) holds WindowPoolPages <= num_pages pages, computed once num_pages fits
  Size layer_pages{0, b.num_pages.overflow};
  for (int64_t l = 0; l < c.num_layers; ++l) {
    int pool = c.pool_of(l);
    uint64_t pages = pool == 0 || b.num_pages.overflow ? b.num_pages.value
                                                       : static_cast<uint64_t>(WindowPoolPages(c, c.pool_window(pool)));
    layer_pages = layer_pages + Size{pages};
  }
  b.pages = Size{b.page.value, b.page.overflow || layer_pages.overflow} * layer_pages.value;
  uint64_t n = static_cast<uint64_t>(c.prefill_chunk_size), hq = static_cast<uint64_t>(c.num_qo_heads);
  uint64_t split_n = c.is_mla() ? 1 : n, kv = static_cast<uint64_t>(c.num_kv_heads * c.head_dim);
  uint64_t v_dim = static_cast<uint64_t>(c.is_mla() ? c.kv_lora_rank : c.head_dim);
  Size split = (Size{split_n} * hq * static_cast<uint64_t>(c.head_dim) + Size{split_n} * kv * 2) * elem;
  // q, k, v; o_tmp (and o_acc: float32 partial states); lse_tmp, lse_own
  b.work = split + Size{n} * hq * v_dim * (partial ? 8 : elem) + Size{n} * hq * 8;
  if (c.cuda_graph()) b.work = b.work + GraphAuxElems(c, b.num_pages) * 4;
  b.total = b.pages + b.work;
  return b;
}

std::string HumanBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f %s", v, units[u]);
  return buf;
}

std::string BytesStr(const Size& s) {
  if (s.overflow) return "over 2^64 bytes";
  return std::to_string(s.value) + " bytes (" + HumanBytes(s.value) + ")";
}

// Before anything is allocated: the cache fits the device's memory (when the TVM runtime reports it), and
// its token slots fit the kernel ABI's int32 slot indices.
void CheckCapacity(const KVConfig& c, const DeviceBytes& b, DLDevice device) {
  std::optional<int64_t> memory = DeviceTotalMemory(device);
  if (b.total.overflow || (memory.has_value() && b.total.value > static_cast<uint64_t>(*memory))) {
    std::ostringstream os;
    os << "pagedkv: the cache needs " << BytesStr(b.total) << " of device memory, more than " << DeviceStr(device);
    if (memory.has_value()) {
      os << " holds (" << *memory << " bytes, " << HumanBytes(static_cast<uint64_t>(*memory)) << ")";
    } else {
      os << " can hold";
    }
    os << ": pages " << c.num_layers << " layers x "
       << (b.num_pages.overflow ? "over 2^64" : std::to_string(b.num_pages.value)) << " pages x "
       << BytesStr(b.page) << " = " << BytesStr(b.pages) << " (max_total_seq_len=" << c.max_total_seq_len
       << ", page_size=" << c.page_size << ", max_batch_size=" << c.max_batch_size << "), work buffers "
       << BytesStr(b.work) << " (prefill_chunk_size=" << c.prefill_chunk_size << ")";
    TVM_FFI_THROW(ValueError) << os.str();
  }
  constexpr uint64_t kMaxSlots = std::numeric_limits<int32_t>::max();
  Size slots = b.num_pages * static_cast<uint64_t>(c.page_size);
  if (slots.overflow || slots.value > kMaxSlots) {
    TVM_FFI_THROW(ValueError) << "pagedkv: max_total_seq_len=" << c.max_total_seq_len << " with page_size="
                              << c.page_size << " and max_batch_size=" << c.max_batch_size << " needs "
                              << b.num_pages.value << " pages of " << c.page_size << " token slots; slot indices "
                              << "are int32 in the kernel ABI, so a cache holds at most " << kMaxSlots << " slots";
  }
}

}  // namespace

int64_t GraphPageValues(const KVConfig& c, int64_t batch) { return batch * c.num_pages(); }

ffi::Tensor PagedKVCacheObj::AllocDevice(const std::vector<int64_t>& shape, DLDataType dtype, const char* what) {
  auto context = [&]() {
    std::ostringstream os;
    os << "pagedkv: allocating " << what << " " << ShapeStr(shape) << " " << DTypeName(dtype) << " ("
       << BytesStr(Size{NumBytes(shape, dtype)}) << ") on " << DeviceStr(device_) << " failed (the cache needs "
       << BytesStr(ComputeDeviceBytes(cfg_, partial_states_).total) << " in all): ";
    return os.str();
  };
  try {
    return fns_.Alloc(shape, dtype, device_);
  } catch (const std::bad_alloc&) {
    TVM_FFI_THROW(MemoryError) << context() << "std::bad_alloc";
  } catch (const ffi::Error& e) {  // the device allocator's own error: its kind is kept, the sizes added
    throw ffi::Error(e.kind(), context() + e.message(), e.backtrace());
  }
}

PagedKVCacheObj::PagedKVCacheObj(KVConfig config, OpTable ops, DLDevice device)
    : cfg_(std::move(config)),
      ops_(std::move(ops)),
      device_(device),
      dtype_(cfg_.dl_dtype()),
      page_dtype_(cfg_.page_dl_dtype()),
      pool_(cfg_.num_pages(), cfg_.page_size),
      windows_(cfg_),
      aux_(&fns_, device, InitialAuxElems(cfg_)),
      pdl_(DeviceSupportsPDL(device)) {
  int64_t hq = cfg_.num_qo_heads, hkv = cfg_.num_kv_heads, d = cfg_.head_dim, n = cfg_.prefill_chunk_size;
  partial_states_ = UsesPartialStates(ops_, cfg_);
  std::vector<int64_t> pages_shape = PageShape();
  pages_shape.insert(pages_shape.begin(), cfg_.num_pages());
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    int pool = cfg_.pool_of(l);
    pages_shape[0] = pool == 0 ? cfg_.num_pages() : windows_.Capacity(pool - 1);
    pages_.push_back(AllocDevice(pages_shape, page_dtype_, "the pages of a layer"));
  }
  // The split q/k/v buffers serve attention_with_fused_qkv, which MLA layers do not have.
  int64_t split_n = cfg_.is_mla() ? 1 : n;
  q_buf_ = AllocDevice({split_n, hq, d}, dtype_, "work buffer q");
  k_buf_ = AllocDevice({split_n, hkv, d}, dtype_, "work buffer k");
  v_buf_ = AllocDevice({split_n, hkv, d}, dtype_, "work buffer v");
  o_tmp_buf_ = AllocDevice({n, hq, PagedVDim()}, partial_states_ ? kFloat32 : dtype_, "work buffer o_tmp");
  if (partial_states_) o_acc_buf_ = AllocDevice({n, hq, PagedVDim()}, kFloat32, "work buffer o_acc");
  lse_tmp_buf_ = AllocDevice({n, hq}, kFloat32, "work buffer lse_tmp");
  lse_own_buf_ = AllocDevice({n, hq}, kFloat32, "work buffer lse_own");
  if (cfg_.cuda_graph()) {  // CheckCapacity has bounded the sizes: no overflow here
    int64_t elems = static_cast<int64_t>(GraphAuxElems(cfg_, Size{static_cast<uint64_t>(cfg_.num_pages())}).value);
    graph_aux_ = std::make_unique<AuxBuilder>(&fns_, device, elems);
  }
}

PagedKVCache CreatePagedKVCache(const std::string& config_json, const ffi::Shape& runtime_values,
                                const ffi::Array<ffi::Any>& op_table, const ffi::Tensor& device_ref) {
  KVConfig config = ParseConfig(config_json, runtime_values);
  OpTable ops = ParseOpTable(op_table, config.layer_kind());
  bool partial = UsesPartialStates(ops, config);
  CheckSinkOps(ops, config, partial);
  CheckWindowTables(ops, config);
  DeviceBytes bytes = ComputeDeviceBytes(config, partial);
  CheckCapacity(config, bytes, device_ref.device());
  int64_t num_pages = config.num_pages();
  try {
    return PagedKVCache(ffi::make_object<PagedKVCacheObj>(std::move(config), std::move(ops), device_ref.device()));
  } catch (const std::bad_alloc&) {  // host bookkeeping: the free page list and the index staging buffer
    TVM_FFI_THROW(MemoryError) << "pagedkv: out of host memory creating a cache of " << num_pages
                               << " pages (its free page list and index staging buffer hold an int32 per page; "
                               << "its device memory is " << BytesStr(bytes.total) << ")";
  }
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

std::vector<int64_t> PagedKVCacheObj::PageShape() const { return PageShapeOf(cfg_); }

void PagedKVCacheObj::CheckSinks(const char* what, const ffi::Tensor& sinks) const {
  if (!cfg_.attention_sinks) {
    TVM_FFI_THROW(ValueError) << "pagedkv: " << what << " got sinks, but this cache's config has attention_sinks = "
                              << "false (its op table holds no sink ops): build the cache with attention_sinks=True";
  }
  CheckTensor(sinks, "sinks", {cfg_.num_qo_heads}, kFloat32, device_);
}

void PagedKVCacheObj::CheckLayer(int64_t layer) const {
  if (layer < 0 || layer >= cfg_.num_layers) {
    TVM_FFI_THROW(ValueError) << "pagedkv: layer " << layer << " is out of range [0, " << cfg_.num_layers << ")";
  }
}

// ---------------------------------------------------------------------------------------------------
// Sequences

int32_t PagedKVCacheObj::GetSequenceLength(int64_t seq_id) const {
  return static_cast<int32_t>(pool_.Get(seq_id).length);
}

int32_t PagedKVCacheObj::GetNumAvailablePages() const {
  int64_t free = pool_.NumFreePages();
  for (int i = 0; i < windows_.NumPools(); ++i) free = std::min(free, windows_.NumFree(i));
  return static_cast<int32_t>(free);
}

ffi::Shape PagedKVCacheObj::PoolPages() const {
  std::vector<int64_t> out = {pool_.NumPages(), pool_.NumFreePages()};
  for (int i = 0; i < windows_.NumPools(); ++i) {
    out.push_back(windows_.Capacity(i));
    out.push_back(windows_.NumFree(i));
  }
  return ffi::Shape(out);
}

const OpTable& PagedKVCacheObj::AttnOps(int64_t layer) const {
  int pool = cfg_.pool_of(layer);
  return pool == 0 ? ops_ : *ops_.windows.at(cfg_.pool_window(pool));
}

void PagedKVCacheObj::CheckWindows(int64_t seq_id, int64_t pos, int64_t pages, const std::string& what) const {
  if (windows_.NumPools() == 0) return;
  windows_.CheckFree(pages, what);
  windows_.CheckResident(pool_.ChainPages(seq_id), pos, what);
}

int32_t PagedKVCacheObj::GetTotalSequenceLength() const { return static_cast<int32_t>(pool_.TotalLength()); }

void PagedKVCacheObj::AddSequence(int64_t seq_id) {
  CheckNoForward("add_sequence");
  pool_.Add(seq_id);
}

void PagedKVCacheObj::RemoveSequence(int64_t seq_id) {
  CheckNoForward("remove_sequence");
  pool_.Remove(seq_id);
  AfterPoolChange(std::nullopt);  // the window pools give back their pages of the freed blocks
  chains_.erase(seq_id);
  // and of shared blocks that only this sequence's window still reached (a fork behind its parent): without it
  // they stayed until the next end_forward, and num_available_pages undercounted until then
  windows_.Trim(pool_, chains_);
}

void PagedKVCacheObj::ForkSequence(int64_t parent_id, int64_t child_id, int64_t fork_pos) {
  CheckNoForward("fork_sequence");
  // The chain's tokens would become shared, and its commit could then need a page it cannot be refused.
  CheckNoChain("fork_sequence", parent_id);
  int64_t length = pool_.Get(parent_id).length, pos = fork_pos == -1 ? length : fork_pos;
  if (pos >= 0 && pos <= length && !pool_.Has(child_id)) {  // else pool_.Fork names the error
    CheckWindows(parent_id, pos, pool_.ForkPages(parent_id, pos),
                 "fork_sequence of sequence " + std::to_string(parent_id) + " at position " + std::to_string(pos));
  }
  AfterPoolChange(pool_.Fork(parent_id, child_id, fork_pos));
}

void PagedKVCacheObj::PopN(int64_t seq_id, int64_t n) {
  CheckNoForward("popn");
  int64_t length = pool_.Get(seq_id).length;
  if (n >= 0 && n <= length) {  // else pool_.PopN names the error
    CheckWindows(seq_id, length - n, pool_.PopNPages(seq_id, n),
                 "popn of " + std::to_string(n) + " tokens of sequence " + std::to_string(seq_id));
  }
  AfterPoolChange(pool_.PopN(seq_id, n));
  auto chain = chains_.find(seq_id);  // popped chain tokens are no longer the chain's
  if (chain != chains_.end() && (chain->second -= std::min(n, chain->second)) == 0) chains_.erase(chain);
}

void PagedKVCacheObj::Clear() {
  if (forward_.has_value()) ops_.EndForward();
  forward_.reset();  // clearing also abandons an open forward
  pool_.Clear();
  windows_.Clear();
  chains_.clear();
  if (poison_) DebugPoisonPages(true);
}

void PagedKVCacheObj::AfterPoolChange(const std::optional<PageCopy>& copy) {
  std::vector<int32_t> fresh = pool_.TakeNewPages();  // drained even when not poisoning, so it never grows
  windows_.Map(fresh);
  for (int pool = 0; pool <= windows_.NumPools(); ++pool) {
    std::vector<int32_t> pages = pool == 0 ? fresh : windows_.TakeNewPages(pool - 1);
    if (!poison_) continue;
    for (int32_t page : pages) PoisonPage(pool, page);  // before the copy, so the copied tokens survive
  }
  RunCopy(copy);
  windows_.Unmap(pool_.TakeFreedPages());  // after the copy: its source may be among them
}

void PagedKVCacheObj::RunCopy(const std::optional<PageCopy>& copy) {
  if (!copy.has_value()) return;
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    int pool = cfg_.pool_of(l);
    int64_t src = pool == 0 ? copy->src : windows_.Phys(pool - 1, copy->src);
    int64_t dst = pool == 0 ? copy->dst : windows_.Phys(pool - 1, copy->dst);
    TVM_FFI_ICHECK(src >= 0 && dst >= 0) << "pagedkv: a page copy of layer " << l << " reads a released page";
    ops_.Call(ops::CopyPage().pages(pages_[l]).src_page(src).dst_page(dst).num_tokens(copy->num_tokens));
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

std::vector<ffi::Tensor> PagedKVCacheObj::SlotsOnDevice(int64_t seq_id, int64_t start, int64_t count,
                                                        const char* what) {
  std::vector<int32_t> pages = pool_.ChainPages(seq_id);
  int64_t ps = cfg_.page_size, pools = 1 + windows_.NumPools();
  std::vector<std::vector<int32_t>> slots(static_cast<size_t>(pools));
  for (int64_t t = start; t < start + count; ++t) {
    for (int pool = 0; pool < pools; ++pool) {
      int32_t page = pool == 0 ? pages[t / ps] : windows_.Phys(pool - 1, pages[t / ps]);
      if (page < 0) {
        TVM_FFI_THROW(ValueError) << "pagedkv: " << what << ": token " << t << " of sequence " << seq_id
                                  << " is behind the window of layer group " << cfg_.PoolGroupNames(pool)
                                  << " (sliding_window " << cfg_.pool_window(pool) << "), which gave its page back";
      }
      slots[pool].push_back(static_cast<int32_t>(page * ps + t % ps));
    }
  }
  int64_t elems = pools * AuxBuilder::Padded(count);
  if (!debug_aux_) debug_aux_ = std::make_unique<AuxBuilder>(&fns_, device_, elems);
  debug_aux_->Reserve(elems);
  debug_aux_->Reset();
  std::vector<int> handles;
  for (const auto& s : slots) handles.push_back(debug_aux_->Add(s));
  debug_aux_->Upload();
  std::vector<ffi::Tensor> out;
  for (int h : handles) out.push_back(debug_aux_->View(h));
  return out;
}

void PagedKVCacheObj::DebugGetKV(int64_t seq_id, int64_t start, int64_t end, Tensor k_out, Tensor v_out) {
  CheckDebugRange("debug_get_kv", seq_id, start, end - start);
  CheckKind("debug_get_kv", false);
  int64_t m = end - start;
  std::vector<int64_t> shape = {cfg_.num_layers, m, cfg_.num_kv_heads, cfg_.head_dim};
  CheckTensor(k_out, "k_out", shape, dtype_, device_);
  CheckTensor(v_out, "v_out", shape, dtype_, device_);
  ops_.Get(ops::kGatherKV);  // an optional op: fails naming it when the table lacks it, even for m == 0
  if (m == 0) return;
  std::vector<ffi::Tensor> slots = SlotsOnDevice(seq_id, start, m, "debug_get_kv");
  uint64_t layer_bytes = NumBytes(KVShape(m), dtype_);
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    ffi::Tensor k = fns_.View(k_out, KVShape(m), dtype_, l * layer_bytes);
    ffi::Tensor v = fns_.View(v_out, KVShape(m), dtype_, l * layer_bytes);
    ops_.Call(ops::GatherKV().pages(pages_[l]).slot(slots[cfg_.pool_of(l)]).k(k).v(v));
  }
}

void PagedKVCacheObj::DebugSetKV(int64_t seq_id, int64_t start, Tensor k, Tensor v) {
  CheckKind("debug_set_kv", false);
  CheckDefined(k, "k");
  int64_t m = k.ndim() == 4 ? k.shape()[1] : -1;
  std::vector<int64_t> shape = {cfg_.num_layers, m, cfg_.num_kv_heads, cfg_.head_dim};
  CheckTensor(k, "k", shape, dtype_, device_);
  CheckTensor(v, "v", shape, dtype_, device_);
  CheckDebugRange("debug_set_kv", seq_id, start, m);
  if (m == 0) return;
  std::vector<ffi::Tensor> slots = SlotsOnDevice(seq_id, start, m, "debug_set_kv");
  uint64_t layer_bytes = NumBytes(KVShape(m), dtype_);
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    ffi::Tensor k_l = fns_.View(k, KVShape(m), dtype_, l * layer_bytes);
    ffi::Tensor v_l = fns_.View(v, KVShape(m), dtype_, l * layer_bytes);
    ops_.Call(ops::AppendKV().pages(pages_[l]).k(k_l).v(v_l).slot(slots[cfg_.pool_of(l)]));
  }
}

void PagedKVCacheObj::DebugGetKVMLA(int64_t seq_id, int64_t start, int64_t end, Tensor kv_out) {
  CheckKind("debug_get_mla_kv", true);
  CheckDebugRange("debug_get_mla_kv", seq_id, start, end - start);
  int64_t m = end - start;
  CheckTensor(kv_out, "kv_out", {cfg_.num_layers, m, cfg_.latent_dim()}, dtype_, device_);
  ops_.Get(ops::kMLAGatherKV);  // an optional op: fails naming it when the table lacks it, even for m == 0
  if (m == 0) return;
  std::vector<ffi::Tensor> slots = SlotsOnDevice(seq_id, start, m, "debug_mla_kv");
  std::vector<int64_t> layer_shape = {m, cfg_.latent_dim()};
  uint64_t layer_bytes = NumBytes(layer_shape, dtype_);
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    ffi::Tensor kv_l = fns_.View(kv_out, layer_shape, dtype_, l * layer_bytes);
    ops_.Call(ops::MLAGatherKV().pages(pages_[l]).slot(slots[0]).kv(kv_l));
  }
}

void PagedKVCacheObj::DebugSetMLAKV(int64_t seq_id, int64_t start, const ffi::Tensor& kv) {
  CheckKind("debug_set_mla_kv", true);
  CheckDefined(kv, "kv");
  int64_t m = kv.ndim() == 3 ? kv.shape()[1] : -1;
  CheckTensor(kv, "kv", {cfg_.num_layers, m, cfg_.latent_dim()}, dtype_, device_);
  CheckDebugRange("debug_set_mla_kv", seq_id, start, m);
  if (m == 0) return;
  std::vector<ffi::Tensor> slots = SlotsOnDevice(seq_id, start, m, "debug_mla_kv");
  std::vector<int64_t> layer_shape = {m, cfg_.latent_dim()};
  uint64_t layer_bytes = NumBytes(layer_shape, dtype_);
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    ffi::Tensor kv_l = fns_.View(kv, layer_shape, dtype_, l * layer_bytes);
    ops_.Call(ops::MLAAppendKV().pages(pages_[l]).kv(kv_l).slot(slots[0]));
  }
}

// ---------------------------------------------------------------------------------------------------
// Poisoning: pages fresh from the free list hold NaN in every layer, so reading unwritten memory fails
// loudly in tests instead of silently reading stale tokens.

void PagedKVCacheObj::DebugPoisonPages(bool on) {
  poison_ = on;
  if (!on) return;
  for (int32_t page : pool_.FreePages()) PoisonPage(0, page);
  for (int i = 0; i < windows_.NumPools(); ++i) {
    for (int32_t page : windows_.FreePages(i)) PoisonPage(i + 1, page);
  }
  PoisonTemps();
}

void PagedKVCacheObj::PoisonPage(int pool, int32_t page) {
  std::vector<int64_t> shape = PageShape();
  size_t bytes = NumBytes(shape, page_dtype_);
  std::vector<uint8_t> nan = NaNBytes(page_dtype_, bytes / ((page_dtype_.bits + 7) / 8));
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    if (cfg_.pool_of(l) != pool) continue;
    fns_.CopyFromBytes(fns_.View(pages_[l], shape, page_dtype_, static_cast<uint64_t>(page) * bytes), nan.data(), bytes);
  }
}

void PagedKVCacheObj::PoisonTemps() {
  for (const ffi::Tensor* t : {&o_tmp_buf_, &o_acc_buf_, &lse_tmp_buf_, &lse_own_buf_, &q_buf_, &k_buf_, &v_buf_}) {
    if (!t->defined()) continue;  // o_acc: partial states only
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
