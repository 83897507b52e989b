// The "flashinfer" backend: adapters from pagedkv's kernel ABI to the functions of FlashInfer 0.7.4 JIT
// modules linked into the model library (python/pagedkv/flashinfer). Argument positions come from
// src/flashinfer_abi.h, generated from the pinned table python/pagedkv/flashinfer/abi.py that the CI test
// checks against compiled modules.
//
// Ops and modules (docs/FLASHINFER.md):
//   attn_decode_paged       decode module          plan per decode pass, run per layer
//   attn_prefill_ragged     prefill_fa2 or _fa3    plan once per prefill forward (causal), run per layer
//   attn_prefill_paged      prefill_fa2 or _fa3    plan per pass it serves (non-causal), run per layer
//   mla_attn_decode_paged   mla module             plan per decode pass, run per layer
//   mla_attn_prefill_paged  mla module             plan per pass it serves (non-causal), run per layer
// An op-table entry is [op, "flashinfer", module_kind, empty_rows, plan, run]: the module kind string
// ("decode", "prefill_fa2", "prefill_fa3", "mla") says which pinned argument lists plan and run take, and
// empty_rows is the backend's small TIR kernel `pagedkv_empty_rows(o, lse, fill)` (below).
//
// Plan once per forward and pass, run per layer:
// - BeginForward (the runtime's begin_forward, after the index arrays reached the device) calls `plan` for
//   every pass (or the ragged call) this op will serve, with the host index arrays, and keeps the plan info
//   keyed by the device view the runtime will pass to Run (page_indptr; kv_indptr for the ragged op);
// - Run (per layer) finds the plan by that tensor and calls `run`. A Run with an index tensor no plan was
//   made for, or with a causal flag other than the planned one, is an error naming the op, never a silent
//   re-plan.
//
// Three facts of FlashInfer 0.7.4 this adapter is built around (sources under flashinfer/data/):
// - LSE: every kernel writes base-2 LSE, pagedkv's convention: prefill.cuh writes
//   `math::ptx_log2(d) + m` with m in sm_scale*log2(e) units (fa2), hopper/attention_updater.cuh
//   `row_max * sm_scale_log2 + ptx_log2(sum)` (fa3), decode.cuh `state_t::get_lse()` = `m + ptx_log2(d)`
//   (state.cuh), mla.cuh the same unless return_lse_base_on_e (we pass false). No conversion.
// - Entries with no keys: FlashInfer writes o = 0 but lse = -inf (prefill.cuh init_states m = -inf, d = 1
//   and OutputTransform's d_rcp = 0 for m = -inf; decode.cuh the same through state_t; hopper
//   epilogue.cuh store_zero; mla.cuh write_empty_o), where pagedkv wants the finite -1e30 (merge_state
//   must never see inf - inf). So a plan records whether its entries include empty ones: a call whose
//   entries are all empty does not reach FlashInfer (empty_rows writes o = 0, lse = -1e30); a call with
//   some empty entries runs FlashInfer and then empty_rows floors lse at -1e30 (-inf becomes -1e30, every
//   real lse is far above it).
// - Tensor offsets: FlashInfer's bindings read `TensorView::data_ptr()`, which is `DLTensor::data`
//   without `byte_offset` (tvm-ffi 0.1.15 container/tensor.h), while TVM's views (the runtime's index
//   arrays, Relax-planned tensors) keep their offset in byte_offset. Every tensor handed to FlashInfer is
//   therefore re-described with the offset folded into `data` (Flat below); K/V/ckv/kpe views are built
//   the same way.
//
// Workspaces: the 128 MB float workspace (split-k partials, only used while a run executes) is shared by
// every FlashInfer adapter of the cache (ForwardInfo::scratch); the int workspaces (plan metadata, read by
// every layer's run) are per adapter and pass, a device one and a page-locked host one each, allocated the
// first time that pass index is planned.
#include <dlfcn.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <array>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "flashinfer_abi.h"
#include "ops.h"

namespace pagedkv {
namespace {

namespace abi = flashinfer_abi;

constexpr int64_t kFloatWorkspaceBytes = 128LL << 20;  // flashinfer's recommended float workspace
constexpr int64_t kIntWorkspaceBytes = 8LL << 20;      // flashinfer's int workspace (plan metadata)
constexpr int64_t kLayoutNHD = 0;                      // flashinfer QKVLayout::kNHD: [n, head, dim]
constexpr int64_t kLayoutHND = 1;                      // QKVLayout::kHND: [page, head, slot, dim]
constexpr int64_t kMaskNone = 0, kMaskCausal = 1;      // flashinfer MaskMode::kNone / kCausal
constexpr DLDataType kUInt8 = {kDLUInt, 8, 1};
constexpr const char* kFloatWorkspaceKey = "flashinfer.float_workspace";
// MLA: the planner sizes its work arrays for 16384 work items (scheduler.cuh MLAPlan max_total_num_works).
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

int64_t ElemBytes(DLDataType t) { return (t.bits * t.lanes + 7) / 8; }

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

uint64_t ViewKey(ffi::AnyView v) {
  const DLTensor* d = v.cast<DLTensor*>();
  return reinterpret_cast<uint64_t>(d->data) + d->byte_offset;
}
uint64_t ViewKey(const ffi::Tensor& t) { return ViewKey(ffi::AnyView(t)); }

// Keys of each entry of a paged pass: 0 for an empty entry, else (pages - 1) * page_size + last_page_len.
std::vector<int32_t> PagedKvLens(const PassPlan& p, int64_t page_size) {
  std::vector<int32_t> out(p.num_entries());
  for (int64_t e = 0; e < p.num_entries(); ++e) {
    int32_t pages = p.page_indptr[e + 1] - p.page_indptr[e];
    out[e] = pages == 0 ? 0 : static_cast<int32_t>((pages - 1) * page_size + p.last_page_len[e]);
  }
  return out;
}

// Loads cudaMemcpyAsync from the libcudart the FlashInfer objects are linked against (already loaded).
using MemcpyAsyncFn = int (*)(void*, const void*, size_t, int, void*);
MemcpyAsyncFn CudaMemcpyAsync() {
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
};

class PlanTable {
 public:
  void Clear() { plans_.clear(); }
  void Put(uint64_t key, Planned p) { plans_[key] = std::move(p); }
  const Planned& Find(uint64_t key, const char* op) const {
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: " << op << " called for a pass that begin_forward did "
                                  << "not plan";
    }
    return it->second;
  }
  size_t size() const { return plans_.size(); }

 private:
  std::map<uint64_t, Planned> plans_;
};

void CheckCausal(const Planned& p, int64_t causal, const char* op) {
  if ((causal != 0) != p.causal) {
    TVM_FFI_THROW(ValueError) << "pagedkv flashinfer: " << op << " was planned " << (p.causal ? "causal" : "non-causal")
                              << " in begin_forward but called with causal=" << causal;
  }
}

void CheckNoInlineRope(int64_t apply_rope, const char* op) {
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
  void EndForward() final { plans_.Clear(); }

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

  const char* op_;
  ffi::Function empty_rows_, plan_, run_;
  Workspaces ws_;
  PlanTable plans_;
  // Until KVConfig has sliding-window and soft-cap fields these are flashinfer's "off" values, passed to
  // plan and run from here.
  int64_t window_left_ = -1;
  double logits_soft_cap_ = 0.0;
};

// ---------------------------------------------------------------------------------------------------------
// attn_decode_paged on FlashInfer's batch decode.
class DecodeAdapter : public FlashInferAdapter {
 public:
  DecodeAdapter(ffi::Function e, ffi::Function plan, ffi::Function run)
      : FlashInferAdapter(ops::kAttnDecodePaged, std::move(e), std::move(plan), std::move(run)) {}

  void BeginForward(const ForwardInfo& info) final {
    plans_.Clear();
    if (!info.plan->is_decode) return;
    const KVConfig& c = *info.config;
    ws_.Attach(info);
    // pagedkv: angle = p * rope_scale / theta^(2i/D); flashinfer: p * rope_rcp_scale * rope_rcp_theta^(2i/D).
    // (flashinfer's own names a divisor "rope_scale"; pagedkv's rope_scale multiplies.)
    rope_rcp_scale_ = c.rope_scale;
    rope_rcp_theta_ = 1.0 / c.rope_theta;
    // dtype carriers (flashinfer dispatches on their dtype only)
    int64_t zero = 0, one = 1;
    DLTensor empty{};
    empty.device = info.device;
    empty.ndim = 1;
    empty.shape = &zero;
    empty.strides = &one;
    empty.dtype = c.dl_dtype();
    for (size_t i = 0; i < info.passes.size(); ++i) {
      const ForwardInfo::Pass& p = info.passes[i];
      if (!p.host->one_query_per_entry) continue;  // the runtime sends those to attn_prefill_paged
      Planned planned = EmptyFlags(PagedKvLens(*p.host, c.page_size), i, false);
      if (!planned.all_empty) {
        namespace a = abi::decode_plan;
        HostInt32 indptr(p.host->page_indptr);
        const Workspaces::Int& iws = ws_.Slot(i);
        ArgPack<a::kNumArgs> args;
        args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
        args.Set(a::kIntWorkspaceBuffer, iws.device);
        args.Set(a::kPageLockedIntWorkspaceBuffer, iws.pinned);
        args.Set(a::kIndptr, indptr.get());
        args.Set(a::kBatchSize, p.host->num_entries());
        args.Set(a::kNumQoHeads, c.num_qo_heads);
        args.Set(a::kNumKvHeads, c.num_kv_heads);
        args.Set(a::kPageSize, c.page_size);
        args.Set(a::kEnableCudaGraph, false);
        args.Set(a::kWindowLeft, window_left_);
        args.Set(a::kLogitsSoftCap, logits_soft_cap_);
        args.Set(a::kHeadDimQk, c.head_dim);
        args.Set(a::kHeadDimVo, c.v_head_dim);
        args.Set(a::kEmptyQData, &empty);
        args.Set(a::kEmptyKvData, &empty);
        planned.info = args.Call(plan_, "decode plan").cast<ffi::Array<int64_t>>();
      }
      plans_.Put(ViewKey(p.page_indptr), std::move(planned));
    }
  }

  // Kernel ABI: q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse,
  //             apply_rope, rope_scale, rope_theta, sm_scale
  void Run(ffi::PackedArgs in) final {
    if (in.size() != 13) TVM_FFI_THROW(InternalError) << "pagedkv flashinfer: attn_decode_paged takes 13 arguments";
    CheckNoInlineRope(in[9].cast<int64_t>(), op_);
    const Planned& p = plans_.Find(ViewKey(in[2]), op_);
    const DLTensor& pages = *in[1].cast<DLTensor*>();
    int64_t np = pages.shape[0], h = pages.shape[2], s = pages.shape[3], d = pages.shape[4];
    // K and V of pages[P, 2, Hkv, ps, D] as strided [P, Hkv, ps, D] (HND) views, without a copy.
    StridedView k(pages, {np, h, s, d}, {2 * h * s * d, s * d, d, 1}, 0);
    StridedView v(pages, {np, h, s, d}, {2 * h * s * d, s * d, d, 1}, h * s * d);
    Flat q(in[0]), indptr(in[2]), indices(in[3]), last(in[4]), o(in[7]), lse(in[8]);
    namespace a = abi::decode_run;
    ArgPack<a::kNumArgs> args;
    if (!p.all_empty) {
      args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(a::kIntWorkspaceBuffer, ws_.Slot(p.slot).device);
      args.Set(a::kPlanInfoVec, p.info);
      args.Set(a::kQ, q.get());
      args.Set(a::kPagedKCache, k.get());
      args.Set(a::kPagedVCache, v.get());
      args.Set(a::kPagedKvIndptr, indptr.get());
      args.Set(a::kPagedKvIndices, indices.get());
      args.Set(a::kPagedKvLastPageLen, last.get());
      args.Set(a::kO, o.get());
      args.Set(a::kMaybeLse, lse.get());
      args.Set(a::kKvLayoutCode, kLayoutHND);
      args.Set(a::kWindowLeft, window_left_);
      args.Set(a::kEnablePdl, false);
      args.SetNone(a::kMaybeAlibiSlopes);
      args.Set(a::kLogitsSoftCap, logits_soft_cap_);
      args.Set(a::kSmScale, in[12].cast<double>());
      args.Set(a::kRopeRcpScale, rope_rcp_scale_);
      args.Set(a::kRopeRcpTheta, rope_rcp_theta_);
    }
    RunPlanned(p, &args, in[7], in[8]);
  }

 private:
  double rope_rcp_scale_ = 1.0, rope_rcp_theta_ = 1e-4;
};

// ---------------------------------------------------------------------------------------------------------
// attn_prefill_ragged / attn_prefill_paged on FlashInfer's batch prefill (fa2, or fa3 on Hopper).

// The fa2 and fa3 lists share their heads (python/pagedkv/flashinfer/abi.py: _PREFILL_PLAN_HEAD,
// _RAGGED_RUN_HEAD, _PAGED_RUN_HEAD); the head is filled through the fa2 names.
namespace p2 = abi::prefill_fa2_plan;
namespace p3 = abi::prefill_fa3_plan;
namespace r2 = abi::prefill_fa2_ragged_run;
namespace r3 = abi::prefill_fa3_ragged_run;
namespace g2 = abi::prefill_fa2_paged_run;
namespace g3 = abi::prefill_fa3_paged_run;
static_assert(p2::kWindowLeft == p3::kWindowLeft && p3::kNumArgs == p3::kWindowLeft + 1 &&
              p2::kCausal == p3::kCausal && p2::kKvLenArr == p3::kKvLenArr);
static_assert(r2::kEnablePdl == r3::kEnablePdl && r2::kMaybeLse == r3::kMaybeLse && r2::kK == r3::kK);
static_assert(g2::kEnablePdl == g3::kEnablePdl && g2::kPagedKvLastPageLen == g3::kPagedKvLastPageLen);

enum class PrefillKind { kFA2, kFA3 };

class PrefillAdapter : public FlashInferAdapter {
 public:
  PrefillAdapter(bool paged, PrefillKind kind, ffi::Function e, ffi::Function plan, ffi::Function run)
      : FlashInferAdapter(paged ? ops::kAttnPrefillPaged : ops::kAttnPrefillRagged, std::move(e), std::move(plan),
                          std::move(run)),
        paged_(paged),
        kind_(kind) {}

  void BeginForward(const ForwardInfo& info) final {
    plans_.Clear();
    const KVConfig& c = *info.config;
    rope_rcp_scale_ = c.rope_scale;
    rope_rcp_theta_ = 1.0 / c.rope_theta;
    const ForwardPlan& fp = *info.plan;
    if (!paged_) {
      if (fp.is_decode) {
        // The only ragged call of a decode forward is self_attention over no keys (kv_indptr = zeros).
        Planned p = EmptyFlags(std::vector<int32_t>(fp.q_indptr.size() - 1, 0), 0, true);
        plans_.Put(ViewKey(info.no_keys_indptr), p);
        return;
      }
      // Prefill: the new tokens attend causally to the new tokens of their own sequence (q and kv indptr are
      // the same array), so no entry is empty and kv_len == q_len.
      ws_.Attach(info);
      std::vector<int32_t> kv_lens(fp.q_indptr.size() - 1);
      for (size_t b = 0; b + 1 < fp.q_indptr.size(); ++b) kv_lens[b] = fp.q_indptr[b + 1] - fp.q_indptr[b];
      Planned p = EmptyFlags(kv_lens, 0, true);
      p.q_key = ViewKey(info.q_indptr);
      if (!p.all_empty) p.info = Plan(info, 0, fp.q_indptr, fp.q_indptr, kv_lens, /*page_size=*/1, true);
      plans_.Put(ViewKey(info.q_indptr), std::move(p));
      return;
    }
    for (size_t i = 0; i < info.passes.size(); ++i) {
      const ForwardInfo::Pass& pass = info.passes[i];
      if (fp.is_decode && pass.host->one_query_per_entry) continue;  // attn_decode_paged's
      std::vector<int32_t> kv_lens = PagedKvLens(*pass.host, c.page_size);
      // Paged passes are non-causal: every key of an entry precedes its queries (src/attention.cc RunPass).
      Planned p = EmptyFlags(kv_lens, i, false);
      if (!p.all_empty) {
        ws_.Attach(info);
        p.info = Plan(info, i, pass.host->q_indptr, pass.host->page_indptr, kv_lens, c.page_size, false);
      }
      plans_.Put(ViewKey(pass.page_indptr), std::move(p));
    }
  }

  // ragged: q, k, v, q_indptr, kv_indptr, q_pos, k_pos_offset, o, lse, causal, apply_rope, rope_scale,
  //         rope_theta, sm_scale
  // paged:  q, q_indptr, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse, causal,
  //         apply_rope, rope_scale, rope_theta, sm_scale
  void Run(ffi::PackedArgs in) final {
    int nargs = paged_ ? 15 : 14;
    if (in.size() != nargs) TVM_FFI_THROW(InternalError) << "pagedkv flashinfer: " << op_ << " takes " << nargs << " arguments";
    int o_i = paged_ ? 8 : 7;
    int causal_i = o_i + 2;
    CheckNoInlineRope(in[causal_i + 1].cast<int64_t>(), op_);
    double sm_scale = in[causal_i + 4].cast<double>();
    const Planned& p = plans_.Find(ViewKey(in[paged_ ? 3 : 4]), op_);
    CheckCausal(p, in[causal_i].cast<int64_t>(), op_);
    if (!paged_ && !p.all_empty && ViewKey(in[3]) != p.q_key) {
      TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: attn_prefill_ragged called with a q_indptr that "
                                  << "begin_forward did not plan";
    }
    if (kind_ == PrefillKind::kFA2) {
      if (paged_) {
        RunPaged<g2::kNumArgs, g2Tail>(p, in, sm_scale);
      } else {
        RunRagged<r2::kNumArgs, r2Tail>(p, in, sm_scale);
      }
    } else {
      if (paged_) {
        RunPaged<g3::kNumArgs, g3Tail>(p, in, sm_scale);
      } else {
        RunRagged<r3::kNumArgs, r3Tail>(p, in, sm_scale);
      }
    }
  }

 private:
  // The tails' index constants, as types (namespaces cannot be template arguments).
  struct r2Tail {
    static constexpr bool kFA3 = false;
    static constexpr int kMaybeCustomMask = r2::kMaybeCustomMask, kMaybeMaskIndptr = r2::kMaybeMaskIndptr,
                         kMaybeAlibiSlopes = r2::kMaybeAlibiSlopes, kMaybePrefixLenPtr = r2::kMaybePrefixLenPtr,
                         kMaybeTokenPosInItemsPtr = r2::kMaybeTokenPosInItemsPtr,
                         kMaybeMaxItemLenPtr = r2::kMaybeMaxItemLenPtr, kMaybeKCacheSf = r2::kMaybeKCacheSf,
                         kMaybeVCacheSf = r2::kMaybeVCacheSf, kLogitsSoftCap = r2::kLogitsSoftCap,
                         kSmScale = r2::kSmScale, kRopeRcpScale = r2::kRopeRcpScale,
                         kRopeRcpTheta = r2::kRopeRcpTheta, kTokenPosInItemsLen = r2::kTokenPosInItemsLen;
  };
  struct g2Tail {
    static constexpr bool kFA3 = false;
    static constexpr int kMaybeCustomMask = g2::kMaybeCustomMask, kMaybeMaskIndptr = g2::kMaybeMaskIndptr,
                         kMaybeAlibiSlopes = g2::kMaybeAlibiSlopes, kMaybePrefixLenPtr = g2::kMaybePrefixLenPtr,
                         kMaybeTokenPosInItemsPtr = g2::kMaybeTokenPosInItemsPtr,
                         kMaybeMaxItemLenPtr = g2::kMaybeMaxItemLenPtr, kMaybeKCacheSf = g2::kMaybeKCacheSf,
                         kMaybeVCacheSf = g2::kMaybeVCacheSf, kLogitsSoftCap = g2::kLogitsSoftCap,
                         kSmScale = g2::kSmScale, kRopeRcpScale = g2::kRopeRcpScale,
                         kRopeRcpTheta = g2::kRopeRcpTheta, kTokenPosInItemsLen = g2::kTokenPosInItemsLen;
  };
  struct r3Tail {
    static constexpr bool kFA3 = true;
    static constexpr int kMaybePrefixLenPtr = r3::kMaybePrefixLenPtr,
                         kMaybeTokenPosInItemsPtr = r3::kMaybeTokenPosInItemsPtr,
                         kMaybeMaxItemLenPtr = r3::kMaybeMaxItemLenPtr, kMaybeScaleV = r3::kMaybeScaleV,
                         kLogitsSoftCap = r3::kLogitsSoftCap, kSmScale = r3::kSmScale,
                         kScaleVScalar = r3::kScaleVScalar, kTokenPosInItemsLen = r3::kTokenPosInItemsLen;
  };
  struct g3Tail {
    static constexpr bool kFA3 = true;
    static constexpr int kMaybePrefixLenPtr = g3::kMaybePrefixLenPtr,
                         kMaybeTokenPosInItemsPtr = g3::kMaybeTokenPosInItemsPtr,
                         kMaybeMaxItemLenPtr = g3::kMaybeMaxItemLenPtr, kMaybeScaleV = g3::kMaybeScaleV,
                         kLogitsSoftCap = g3::kLogitsSoftCap, kSmScale = g3::kSmScale,
                         kScaleVScalar = g3::kScaleVScalar, kTokenPosInItemsLen = g3::kTokenPosInItemsLen;
  };

  // The arguments after enable_pdl: flashinfer's "off" values, the scale, and (fa2) the RoPE constants.
  template <typename Tail, int N>
  void SetTail(ArgPack<N>& args, double sm_scale) const {
    args.SetNone(Tail::kMaybePrefixLenPtr);
    args.SetNone(Tail::kMaybeTokenPosInItemsPtr);
    args.SetNone(Tail::kMaybeMaxItemLenPtr);
    args.Set(Tail::kLogitsSoftCap, logits_soft_cap_);
    args.Set(Tail::kSmScale, sm_scale);
    args.Set(Tail::kTokenPosInItemsLen, int64_t{0});
    if constexpr (Tail::kFA3) {
      args.SetNone(Tail::kMaybeScaleV);
      args.Set(Tail::kScaleVScalar, 1.0);  // no fp8 V scale
    } else {
      args.SetNone(Tail::kMaybeCustomMask);
      args.SetNone(Tail::kMaybeMaskIndptr);
      args.SetNone(Tail::kMaybeAlibiSlopes);
      args.SetNone(Tail::kMaybeKCacheSf);
      args.SetNone(Tail::kMaybeVCacheSf);
      // unused while the module is built without in-kernel RoPE (pos_encoding_mode 0); see DecodeAdapter
      args.Set(Tail::kRopeRcpScale, rope_rcp_scale_);
      args.Set(Tail::kRopeRcpTheta, rope_rcp_theta_);
    }
  }

  ffi::Array<int64_t> Plan(const ForwardInfo& info, size_t slot, const std::vector<int32_t>& qo_indptr,
                           const std::vector<int32_t>& kv_indptr, const std::vector<int32_t>& kv_lens,
                           int64_t page_size, bool causal) {
    const KVConfig& c = *info.config;
    if (causal) {
      for (size_t b = 0; b < kv_lens.size(); ++b) {
        if (kv_lens[b] > 0 && kv_lens[b] < qo_indptr[b + 1] - qo_indptr[b]) {
          TVM_FFI_THROW(InternalError) << "pagedkv flashinfer: causal " << op_ << " entry " << b
                                       << " has fewer keys than queries (the runtime never plans that)";
        }
      }
    }
    const Workspaces::Int& iws = ws_.Slot(slot);
    HostInt32 qo(qo_indptr), kv(kv_indptr), lens(kv_lens);
    auto head = [&](auto& args) {
      args.Set(p2::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(p2::kIntWorkspaceBuffer, iws.device);
      args.Set(p2::kPageLockedIntWorkspaceBuffer, iws.pinned);
      args.Set(p2::kQoIndptr, qo.get());
      args.Set(p2::kKvIndptr, kv.get());  // ragged: token indptr; paged: page indptr (as flashinfer's wrappers)
      args.Set(p2::kKvLenArr, lens.get());
      args.Set(p2::kTotalNumRows, static_cast<int64_t>(qo_indptr.back()));
      args.Set(p2::kBatchSize, static_cast<int64_t>(kv_lens.size()));
      args.Set(p2::kNumQoHeads, c.num_qo_heads);
      args.Set(p2::kNumKvHeads, c.num_kv_heads);
      args.Set(p2::kPageSize, page_size);
      args.Set(p2::kEnableCudaGraph, false);
      args.Set(p2::kHeadDimQk, c.head_dim);
      args.Set(p2::kHeadDimVo, c.v_head_dim);
      args.Set(p2::kCausal, causal);
      args.Set(p2::kWindowLeft, window_left_);
    };
    if (kind_ == PrefillKind::kFA2) {
      ArgPack<p2::kNumArgs> args;
      head(args);
      // the values 0.7.4's BatchPrefillWith{Paged,Ragged}KVCacheWrapper.plan passes without CUDA graphs
      args.Set(p2::kFixedSplitSize, int64_t{-1});
      args.Set(p2::kDisableSplitKv, false);
      args.Set(p2::kNumColocatedCtas, int64_t{0});
      args.Set(p2::kUniformQLen, int64_t{0});
      args.Set(p2::kFixedUniformQLen, false);
      return args.Call(plan_, "prefill plan").cast<ffi::Array<int64_t>>();
    }
    ArgPack<p3::kNumArgs> args;
    head(args);
    return args.Call(plan_, "prefill plan").cast<ffi::Array<int64_t>>();
  }

  template <int N, typename Tail>
  void RunRagged(const Planned& p, ffi::PackedArgs in, double sm_scale) {
    Flat q(in[0]), k(in[1]), v(in[2]), qo(in[3]), kv(in[4]), o(in[7]), lse(in[8]);
    ArgPack<N> args;
    if (!p.all_empty) {
      args.Set(r2::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(r2::kIntWorkspaceBuffer, ws_.Slot(p.slot).device);
      args.Set(r2::kPlanInfoVec, p.info);
      args.Set(r2::kQ, q.get());
      args.Set(r2::kK, k.get());
      args.Set(r2::kV, v.get());
      args.Set(r2::kQoIndptr, qo.get());
      args.Set(r2::kKvIndptr, kv.get());
      args.Set(r2::kO, o.get());
      args.Set(r2::kMaybeLse, lse.get());
      args.Set(r2::kMaskModeCode, p.causal ? kMaskCausal : kMaskNone);
      args.Set(r2::kLayout, kLayoutNHD);
      args.Set(r2::kWindowLeft, window_left_);
      args.Set(r2::kEnablePdl, false);
      SetTail<Tail>(args, sm_scale);
    }
    RunPlanned(p, &args, in[7], in[8]);
  }

  template <int N, typename Tail>
  void RunPaged(const Planned& p, ffi::PackedArgs in, double sm_scale) {
    const DLTensor& pages = *in[2].cast<DLTensor*>();
    int64_t np = pages.shape[0], h = pages.shape[2], s = pages.shape[3], d = pages.shape[4];
    StridedView k(pages, {np, h, s, d}, {2 * h * s * d, s * d, d, 1}, 0);
    StridedView v(pages, {np, h, s, d}, {2 * h * s * d, s * d, d, 1}, h * s * d);
    Flat q(in[0]), qo(in[1]), indptr(in[3]), indices(in[4]), last(in[5]), o(in[8]), lse(in[9]);
    ArgPack<N> args;
    if (!p.all_empty) {
      args.Set(g2::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(g2::kIntWorkspaceBuffer, ws_.Slot(p.slot).device);
      args.Set(g2::kPlanInfoVec, p.info);
      args.Set(g2::kQ, q.get());
      args.Set(g2::kPagedKCache, k.get());
      args.Set(g2::kPagedVCache, v.get());
      args.Set(g2::kQoIndptr, qo.get());
      args.Set(g2::kPagedKvIndptr, indptr.get());
      args.Set(g2::kPagedKvIndices, indices.get());
      args.Set(g2::kPagedKvLastPageLen, last.get());
      args.Set(g2::kO, o.get());
      args.Set(g2::kMaybeLse, lse.get());
      args.Set(g2::kMaskModeCode, p.causal ? kMaskCausal : kMaskNone);
      args.Set(g2::kLayout, kLayoutHND);
      args.Set(g2::kWindowLeft, window_left_);
      args.Set(g2::kEnablePdl, false);
      SetTail<Tail>(args, sm_scale);
    }
    RunPlanned(p, &args, in[8], in[9]);
  }

  bool paged_;
  PrefillKind kind_;
  double rope_rcp_scale_ = 1.0, rope_rcp_theta_ = 1e-4;
};

// ---------------------------------------------------------------------------------------------------------
// mla_attn_decode_paged / mla_attn_prefill_paged on FlashInfer's MLA module (fa2).
//
// pages[P, 1, 1, ps, DL] hold [ckv | kpe] per token (DL = kv_lora_rank + rope); FlashInfer takes ckv and
// kpe as separate [P, ps, *] tensors and reads their strides (batch_mla_run.cu: ckv_stride_page,
// ckv_stride_n, ...), so they are two strided views of the same pages: ckv at element 0 and kpe at element
// kv_lora_rank of each row, both with strides (ps * DL, DL, 1). q[n, H, DL] is split the same way.
class MLAAdapter : public FlashInferAdapter {
 public:
  MLAAdapter(bool decode, ffi::Function e, ffi::Function plan, ffi::Function run)
      : FlashInferAdapter(decode ? ops::kMLAAttnDecodePaged : ops::kMLAAttnPrefillPaged, std::move(e),
                          std::move(plan), std::move(run)),
        decode_(decode) {}

  void BeginForward(const ForwardInfo& info) final {
    plans_.Clear();
    const KVConfig& c = *info.config;
    const ForwardPlan& fp = *info.plan;
    for (size_t i = 0; i < info.passes.size(); ++i) {
      const ForwardInfo::Pass& pass = info.passes[i];
      bool decode_pass = fp.is_decode && pass.host->one_query_per_entry;  // src/attention.cc RunPass
      if (decode_pass != decode_) continue;
      std::vector<int32_t> kv_lens = PagedKvLens(*pass.host, c.page_size);
      Planned p = EmptyFlags(kv_lens, i, false);
      if (!p.all_empty) {
        ws_.Attach(info);
        CheckWorkItems(pass.host->q_indptr, c.num_qo_heads);
        namespace a = abi::mla_plan;
        const Workspaces::Int& iws = ws_.Slot(i);
        HostInt32 qo(pass.host->q_indptr), kv(pass.host->page_indptr), lens(kv_lens);
        ArgPack<a::kNumArgs> args;
        args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
        args.Set(a::kIntWorkspaceBuffer, iws.device);
        args.Set(a::kPageLockedIntWorkspaceBuffer, iws.pinned);
        args.Set(a::kQoIndptr, qo.get());
        args.Set(a::kKvIndptr, kv.get());  // page indptr (flashinfer's MLA wrapper checks pages = ceil(len / ps))
        args.Set(a::kKvLen, lens.get());
        args.Set(a::kNumHeads, c.num_qo_heads);
        args.Set(a::kHeadDimO, c.kv_lora_rank);
        args.Set(a::kCausal, false);
        auto result = args.Call(plan_, "MLA plan").cast<ffi::Array<ffi::Any>>();
        if (result.size() != 2) TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: MLA plan returned " << result.size() << " values";
        p.info = result[0].cast<ffi::Array<int64_t>>();
        ws_.StageToDevice(iws, result[1].cast<int64_t>());
      }
      plans_.Put(ViewKey(pass.page_indptr), std::move(p));
    }
  }

  // decode:  q, pages, page_indptr, page_values, last_page_len, o, lse, sm_scale
  // prefill: q, q_indptr, pages, page_indptr, page_values, last_page_len, o, lse, causal, sm_scale
  void Run(ffi::PackedArgs in) final {
    int nargs = decode_ ? 8 : 10;
    if (in.size() != nargs) TVM_FFI_THROW(InternalError) << "pagedkv flashinfer: " << op_ << " takes " << nargs << " arguments";
    int b = decode_ ? 0 : 1;  // offset of pages and later arguments
    const Planned& p = plans_.Find(ViewKey(in[b + 2]), op_);
    if (!decode_) CheckCausal(p, in[8].cast<int64_t>(), op_);
    double sm_scale = in[decode_ ? 7 : 9].cast<double>();
    const DLTensor& pages = *in[b + 1].cast<DLTensor*>();
    const DLTensor& q = *in[0].cast<DLTensor*>();
    int64_t np = pages.shape[0], ps = pages.shape[3], dl = pages.shape[4];
    int64_t r = in[b + 5].cast<DLTensor*>()->shape[2], rope = dl - r;  // o[n, H, kv_lora_rank]
    int64_t n = q.shape[0], h = q.shape[1];
    StridedView q_nope(q, {n, h, r}, {h * dl, dl, 1}, 0), q_pe(q, {n, h, rope}, {h * dl, dl, 1}, r);
    StridedView ckv(pages, {np, ps, r}, {ps * dl, dl, 1}, 0), kpe(pages, {np, ps, rope}, {ps * dl, dl, 1}, r);
    Flat indices(in[b + 3]), o(in[b + 5]), lse(in[b + 6]);
    namespace a = abi::mla_run;
    ArgPack<a::kNumArgs> args;
    if (!p.all_empty) {
      args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(a::kIntWorkspaceBuffer, ws_.Slot(p.slot).device);
      args.Set(a::kPlanInfoVec, p.info);
      args.Set(a::kQNope, q_nope.get());
      args.Set(a::kQPe, q_pe.get());
      args.Set(a::kCkvCache, ckv.get());
      args.Set(a::kKpeCache, kpe.get());
      args.Set(a::kKvIndices, indices.get());
      args.Set(a::kO, o.get());
      args.Set(a::kMaybeLse, lse.get());
      args.Set(a::kMaskModeCode, kMaskNone);
      args.Set(a::kNumHeads, h);
      args.Set(a::kPageSize, ps);
      args.Set(a::kSmScale, sm_scale);
      args.Set(a::kReturnLseBaseOnE, false);  // base 2, pagedkv's convention
      args.Set(a::kCkvScale, 1.0);
      args.Set(a::kKpeScale, 1.0);
      args.SetNone(a::kMaybeCkvScaleArr);
    }
    RunPlanned(p, &args, in[b + 5], in[b + 6]);
  }

 private:
  // MLAPlan writes at most kMLAMaxWorks work items (its int workspace arrays have that many slots): a query
  // tile of 64 packed rows (or 128) per work item, plus at most one KV split per cluster.
  void CheckWorkItems(const std::vector<int32_t>& qo_indptr, int64_t heads) const {
    int64_t tiles = 0;
    for (size_t e = 0; e + 1 < qo_indptr.size(); ++e) tiles += ((qo_indptr[e + 1] - qo_indptr[e]) * heads + 63) / 64;
    if (tiles + kMLAMaxSplits > kMLAMaxWorks) {
      TVM_FFI_THROW(ValueError) << "pagedkv flashinfer: " << op_ << " pass needs up to " << tiles + kMLAMaxSplits
                                << " MLA work items, more than FlashInfer's " << kMLAMaxWorks
                                << " (fewer tokens per forward: lower prefill_chunk_size)";
    }
  }

  bool decode_;
};

ffi::Function FuncArg(const std::string& op, const ffi::Array<ffi::Any>& funcs, size_t i, const char* name) {
  auto f = funcs[i].as<ffi::Function>();
  if (!f.has_value()) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op << "' (backend 'flashinfer') needs function '"
                              << name << "' at position " << i << ", got " << funcs[i].GetTypeKey();
  }
  return *f;
}

std::unique_ptr<OpAdapter> MakeFlashInferAdapter(const std::string& op, const ffi::Array<ffi::Any>& funcs) {
  if (funcs.size() != 4) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: backend 'flashinfer' takes [module_kind, empty_rows, plan, "
                              << "run] for op '" << op << "', got " << funcs.size() << " values";
  }
  auto kind_str = funcs[0].as<ffi::String>();
  if (!kind_str.has_value()) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op << "' (backend 'flashinfer') needs the module kind "
                              << "string first, got " << funcs[0].GetTypeKey();
  }
  std::string kind(*kind_str);
  ffi::Function e = FuncArg(op, funcs, 1, "empty_rows"), plan = FuncArg(op, funcs, 2, "plan"),
                run = FuncArg(op, funcs, 3, "run");
  auto want = [&](std::initializer_list<const char*> kinds) {
    for (const char* k : kinds) {
      if (kind == k) return;
    }
    std::string list;
    for (const char* k : kinds) list += std::string(list.empty() ? "" : ", ") + k;
    TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op << "' (backend 'flashinfer') takes a FlashInfer "
                              << list << " module, got '" << kind << "'";
  };
  if (op == ops::kAttnDecodePaged) {
    want({"decode"});
    return std::make_unique<DecodeAdapter>(e, plan, run);
  }
  if (op == ops::kAttnPrefillRagged || op == ops::kAttnPrefillPaged) {
    want({"prefill_fa2", "prefill_fa3"});
    return std::make_unique<PrefillAdapter>(op == ops::kAttnPrefillPaged,
                                            kind == "prefill_fa3" ? PrefillKind::kFA3 : PrefillKind::kFA2, e,
                                            plan, run);
  }
  if (op == ops::kMLAAttnDecodePaged || op == ops::kMLAAttnPrefillPaged) {
    want({"mla"});
    return std::make_unique<MLAAdapter>(op == ops::kMLAAttnDecodePaged, e, plan, run);
  }
  TVM_FFI_THROW(ValueError) << "pagedkv op table: this runtime has no 'flashinfer' adapter for op '" << op
                            << "' (it has: " << ops::kAttnDecodePaged << ", " << ops::kAttnPrefillRagged << ", "
                            << ops::kAttnPrefillPaged << ", " << ops::kMLAAttnDecodePaged << ", "
                            << ops::kMLAAttnPrefillPaged << ")";
  TVM_FFI_UNREACHABLE();
}

struct Registrar {
  Registrar() { BackendRegistry::Global().Register("flashinfer", MakeFlashInferAdapter); }
} registrar;

}  // namespace
}  // namespace pagedkv
