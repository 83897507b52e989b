// Shared pieces of the FlashInfer adapters (src/flashinfer_*.cc): argument packing, tensor re-description,
// workspaces, plan bookkeeping and the adapter base class. See src/flashinfer_adapter.cc for the design.
#ifndef PAGEDKV_FLASHINFER_COMMON_H_
#define PAGEDKV_FLASHINFER_COMMON_H_

#include <dlfcn.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <array>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "flashinfer_abi.h"
#include "ops.h"

namespace pagedkv {
namespace fi {

namespace abi = flashinfer_abi;

constexpr int64_t kFloatWorkspaceBytes = 128LL << 20;  // flashinfer's recommended float workspace
constexpr int64_t kIntWorkspaceBytes = 8LL << 20;      // flashinfer's int workspace (plan metadata)
constexpr int64_t kLayoutNHD = 0;                      // flashinfer QKVLayout::kNHD: [n, head, dim]
constexpr int64_t kLayoutHND = 1;                      // QKVLayout::kHND: [page, head, slot, dim]
constexpr int64_t kMaskNone = 0, kMaskCausal = 1;      // flashinfer MaskMode::kNone / kCausal
constexpr DLDataType kUInt8 = {kDLUInt, 8, 1};
constexpr const char* kFloatWorkspaceKey = "flashinfer.float_workspace";
// MLA: the planner sizes its work arrays for 16384 work items (scheduler.cuh MLAPlan max_total_num_works);
// src/flashinfer_mla.cc splits a pass into sub-plans that fit.
constexpr int64_t kMLAMaxWorks = 16384;
// Upper bound on the KV splits MLAPlan adds to the query tiles (at most one per cluster, <= SMs per GPU).
constexpr int64_t kMLAMaxSplits = 1024;

// Fills an AnyView argument array by the generated index constants; Call checks every slot was set, so a
// function is never called with fewer arguments than its pinned list.
template <int N>
class ArgPack {
 public:
  template <typename T>
  void Set(int index, T&& value) {
    args_[index] = ffi::AnyView(std::forward<T>(value));
    set_[index] = true;
  }
  void SetNone(int index) {
    args_[index] = ffi::AnyView(nullptr);
    set_[index] = true;
  }
  ffi::Any Call(const ffi::Function& f, const char* what) {
    for (int i = 0; i < N; ++i) {
      if (!set_[i]) TVM_FFI_THROW(InternalError) << "pagedkv flashinfer: " << what << " argument " << i << " unset";
    }
    ffi::Any rv;
    f.CallPacked(ffi::PackedArgs(args_.data(), N), &rv);
    return rv;
  }

 private:
  std::array<ffi::AnyView, N> args_{};
  std::array<bool, N> set_{};
};

inline int64_t ElemBytes(DLDataType t) { return (t.bits * t.lanes + 7) / 8; }

// A tensor as FlashInfer must see it: byte_offset folded into data (see the header comment). Shape and
// strides still point into the source tensor, which outlives the call.
struct Flat {
  DLTensor t{};
  explicit Flat(const DLTensor& src) : t(src) {
    t.data = static_cast<char*>(src.data) + src.byte_offset;
    t.byte_offset = 0;
  }
  explicit Flat(ffi::AnyView v) : Flat(*v.cast<DLTensor*>()) {}
  DLTensor* get() { return &t; }
};

// A strided view of a contiguous tensor's memory starting `elem_offset` elements in, offset folded into data.
struct StridedView {
  std::array<int64_t, 4> shape{}, strides{};
  DLTensor t{};
  StridedView(const DLTensor& base, std::initializer_list<int64_t> shp, std::initializer_list<int64_t> str,
              int64_t elem_offset) {
    t = base;
    t.ndim = static_cast<int32_t>(shp.size());
    std::copy(shp.begin(), shp.end(), shape.begin());
    std::copy(str.begin(), str.end(), strides.begin());
    t.shape = shape.data();
    t.strides = strides.data();
    t.data = static_cast<char*>(base.data) + base.byte_offset + elem_offset * ElemBytes(base.dtype);
    t.byte_offset = 0;
  }
  DLTensor* get() { return &t; }
};

// A DLTensor describing host memory (no ownership): plan's indptr arguments are host arrays. Strides are
// set: tvm-ffi's TensorView::stride() reads them unchecked.
struct HostInt32 {
  int64_t shape, stride = 1;
  DLTensor t{};
  explicit HostInt32(const std::vector<int32_t>& v) : shape(static_cast<int64_t>(v.size())) {
    t.data = const_cast<int32_t*>(v.data());
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = kInt32;
    t.shape = &shape;
    t.strides = &stride;
  }
  DLTensor* get() { return &t; }
};

// Row-major without gaps (strides NULL or the compact ones): a row offset is then an element offset.
inline bool IsCompact(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expect = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expect) return false;
    expect *= t.shape[i];
  }
  return true;
}

// Loads cudaMemcpyAsync from the libcudart the FlashInfer objects are linked against (already loaded).
using MemcpyAsyncFn = int (*)(void*, const void*, size_t, int, void*);
inline MemcpyAsyncFn CudaMemcpyAsync() {
  static MemcpyAsyncFn fn = [] {
    for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"}) {
      if (void* h = dlopen(name, RTLD_LAZY | RTLD_NOLOAD)) {
        if (void* sym = dlsym(h, "cudaMemcpyAsync")) return reinterpret_cast<MemcpyAsyncFn>(sym);
      }
    }
    return reinterpret_cast<MemcpyAsyncFn>(dlsym(RTLD_DEFAULT, "cudaMemcpyAsync"));
  }();
  return fn;
}

// Workspaces of one adapter: the cache's shared float workspace and an (int, page-locked int) pair per
// planned pass index.
class Workspaces {
 public:
  struct Int {
    ffi::Tensor device, pinned;
  };
  void Attach(const ForwardInfo& info) {
    fns_ = info.fns;
    device_ = info.device;
    ffi::Tensor* shared = info.scratch ? &(*info.scratch)[kFloatWorkspaceKey] : &own_float_ws_;
    if (!shared->defined()) *shared = fns_->Alloc({kFloatWorkspaceBytes}, kUInt8, device_);
    float_ws_ = *shared;
  }
  const ffi::Tensor& float_ws() const { return float_ws_; }
  const Int& Slot(size_t i) {
    auto it = int_ws_.find(i);
    if (it == int_ws_.end()) {
      // Page-locked host memory next to a CUDA device (plain host memory otherwise: the CPU adapter test).
      DLDevice host{device_.device_type == kDLCUDA ? kDLCUDAHost : kDLCPU, 0};
      it = int_ws_.emplace(i, Int{fns_->Alloc({kIntWorkspaceBytes}, kUInt8, device_),
                                  fns_->Alloc({kIntWorkspaceBytes}, kUInt8, host)}).first;
    }
    return it->second;
  }
  // MLA's plan leaves its metadata in the page-locked workspace and returns the byte count; it goes to the
  // device workspace on the stream FlashInfer's kernels run on (TVM's env stream), as the decode/prefill
  // planners do themselves (scheduler.cuh: cudaMemcpyAsync(int_buffer, page_locked_int_buffer, ...)).
  void StageToDevice(const Int& ws, int64_t bytes) const {
    if (bytes <= 0) return;
    if (bytes > kIntWorkspaceBytes) {
      TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: MLA plan staged " << bytes
                                  << " bytes, more than the " << kIntWorkspaceBytes << "-byte int workspace";
    }
    const DLTensor* dev = ws.device.GetDLTensorPtr();
    const DLTensor* pin = ws.pinned.GetDLTensorPtr();
    if (device_.device_type == kDLCUDA) {
      void* stream = TVMFFIEnvGetStream(kDLCUDA, device_.device_id);
      if (MemcpyAsyncFn copy = CudaMemcpyAsync()) {
        int rc = copy(static_cast<char*>(dev->data) + dev->byte_offset,
                      static_cast<char*>(pin->data) + pin->byte_offset, static_cast<size_t>(bytes),
                      /*cudaMemcpyHostToDevice=*/1, stream);
        if (rc != 0) TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: cudaMemcpyAsync failed (" << rc << ")";
        return;
      }
      if (stream != nullptr) {
        TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: cudaMemcpyAsync not found in the loaded libcudart, "
                                    << "and TVM's copy would not be ordered with the current stream";
      }
    }
    // CPU (tests), or CUDA on the default stream: TVM's copy.
    fns_->Copy(fns_->View(ws.pinned, {bytes}, kUInt8, 0), fns_->View(ws.device, {bytes}, kUInt8, 0));
  }

 private:
  const TensorFns* fns_ = nullptr;
  DLDevice device_{};
  ffi::Tensor own_float_ws_, float_ws_;
  std::map<size_t, Int> int_ws_;
};

// One plan: what Run needs to find and use it.
struct Planned {
  size_t slot = 0;                // int workspace slot
  ffi::Array<int64_t> info;       // plan info (unset when all_empty)
  bool all_empty = false;         // no entry has keys: FlashInfer is not called, empty_rows writes the state
  bool has_empty = false;         // some entry has no keys: lse is floored at -1e30 after the run
  bool causal = false;
  uint64_t q_key = 0;             // ragged: the q_indptr view planned for
  ffi::Tensor q_indptr;           // decode on the prefill kernel: the pass's device q_indptr (0..B)
};

// Plans of one forward by the device view Run is given (ViewKey); P: what one pass planned.
template <typename P>
class PlanMap {
 public:
  void Clear() { plans_.clear(); }
  void Put(uint64_t key, P p) { plans_[key] = std::move(p); }
  const P& Find(uint64_t key, const char* op) const {
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: " << op << " called for a pass that begin_forward did "
                                  << "not plan";
    }
    return it->second;
  }
  size_t size() const { return plans_.size(); }

 private:
  std::map<uint64_t, P> plans_;
};
using PlanTable = PlanMap<Planned>;

inline void CheckCausal(const Planned& p, int64_t causal, const char* op) {
  if ((causal != 0) != p.causal) {
    TVM_FFI_THROW(ValueError) << "pagedkv flashinfer: " << op << " was planned " << (p.causal ? "causal" : "non-causal")
                              << " in begin_forward but called with causal=" << causal;
  }
}

// The runtime calls every op with its kernel ABI (src/ops.h); anything else is a bug of ours.
inline void CheckArgCount(const ffi::PackedArgs& in, int expected, const char* op) {
  if (in.size() != expected) {
    TVM_FFI_THROW(InternalError) << "pagedkv flashinfer: " << op << " takes " << expected << " arguments, got "
                                 << in.size();
  }
}

inline void CheckNoInlineRope(int64_t apply_rope, const char* op) {
  if (apply_rope != 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv flashinfer: " << op << " cannot apply RoPE inside the kernel (rope_mode "
                              << "'inline'): the FlashInfer modules are built without in-kernel RoPE, and the "
                              << "backend refuses this config at compile time";
  }
}

// Base for every FlashInfer adapter: the functions, the workspaces, the plans, and the empty-state kernel.
class FlashInferAdapter : public OpAdapter {
 public:
  FlashInferAdapter(const char* op, ffi::Function empty_rows, ffi::Function plan, ffi::Function run)
      : op_(op), empty_rows_(std::move(empty_rows)), plan_(std::move(plan)), run_(std::move(run)) {}
  void EndForward() override { plans_.Clear(); }

 protected:
  // o = 0, lse = -1e30 on every row (fill), or lse = max(lse, -1e30) with NaN kept (floor).
  void EmptyRows(ffi::AnyView o, ffi::AnyView lse, bool fill) const { empty_rows_(o, lse, fill ? 1 : 0); }
  // Runs `run` unless every entry is empty, then fixes up the empty rows.
  template <int N>
  void RunPlanned(const Planned& p, ArgPack<N>* args, ffi::AnyView o, ffi::AnyView lse) {
    if (p.all_empty) {
      EmptyRows(o, lse, true);
      return;
    }
    args->Call(run_, op_);
    if (p.has_empty) EmptyRows(o, lse, false);
  }
  static Planned EmptyFlags(const std::vector<int32_t>& kv_lens, size_t slot, bool causal) {
    Planned p;
    p.slot = slot;
    p.causal = causal;
    p.all_empty = std::all_of(kv_lens.begin(), kv_lens.end(), [](int32_t l) { return l == 0; });
    p.has_empty = std::any_of(kv_lens.begin(), kv_lens.end(), [](int32_t l) { return l == 0; });
    return p;
  }

  // A CUDA-graph decode forward replays the launches recorded at capture, whose grid sizes and workspace
  // offsets came from the plan info of that batch size's first forward. FlashInfer's enable_cuda_graph plans
  // promise the same info for every forward of a batch size; this holds them to it (a changed plan would
  // replay stale launches: wrong results, never an error).
  void CheckGraphPlan(const ForwardInfo& info, size_t slot, int64_t batch, const ffi::Array<int64_t>& plan) {
    if (!info.cuda_graph) return;
    std::vector<int64_t> now(plan.begin(), plan.end());
    auto [it, fresh] = graph_plans_.emplace(std::make_pair(slot, batch), now);
    if (!fresh && it->second != now) {
      TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: " << op_ << " planned a CUDA-graph decode forward of "
                                  << batch << " sequences with a launch configuration other than the first "
                                  << "forward of that batch size, which a captured graph replays";
    }
  }

  const char* op_;
  ffi::Function empty_rows_, plan_, run_;
  Workspaces ws_;
  PlanTable plans_;
  std::map<std::pair<size_t, int64_t>, std::vector<int64_t>> graph_plans_;  // CheckGraphPlan
  // The config's attention options in flashinfer's terms, passed to plan and run. window_left counts the
  // keys before the query's own (-1: off), so a window of W positions is W - 1; the cap is as given (0: off).
  // The modules are built with use_sliding_window / use_logits_soft_cap exactly when the options are on
  // (python/pagedkv/backends/flashinfer.py module_spec).
  void ReadOptions(const ForwardInfo& info) {
    const KVConfig& c = *info.config;
    window_left_ = c.sliding_window > 0 ? c.sliding_window - 1 : -1;
    logits_soft_cap_ = c.logits_soft_cap;
    pdl_ = info.pdl;
  }
  int64_t window_left_ = -1;
  double logits_soft_cap_ = 0.0;
  bool pdl_ = false;  // run with enable_pdl (ForwardInfo::pdl)
};


// Adapters per module family (src/flashinfer_decode.cc, _prefill.cc, _mla.cc).
std::unique_ptr<OpAdapter> MakeDecodeAdapter(ffi::Function empty_rows, ffi::Function plan, ffi::Function run);
// op: attn_prefill_ragged, attn_prefill_paged, or attn_decode_paged (run on the paged prefill kernel).
std::unique_ptr<OpAdapter> MakePrefillAdapter(const std::string& op, bool fa3, ffi::Function empty_rows,
                                              ffi::Function plan, ffi::Function run);
std::unique_ptr<OpAdapter> MakeMLAAdapter(bool decode, ffi::Function empty_rows, ffi::Function plan,
                                          ffi::Function run);

}  // namespace fi
}  // namespace pagedkv

#endif  // PAGEDKV_FLASHINFER_COMMON_H_
