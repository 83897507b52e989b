// The "flashinfer" backend: adapters from pagedkv's kernel ABI to the functions of FlashInfer 0.7.4 JIT
// modules linked into the model library (python/pagedkv/flashinfer). Argument positions come from
// src/flashinfer_abi.h, generated from the pinned table python/pagedkv/flashinfer/abi.py that the CI test
// checks against compiled modules.
//
// Plan once per forward and pass, run per layer:
// - BeginForward (the runtime's begin_forward, after the index arrays reached the device) calls the
//   module's `plan` for every pass this op will serve, with the pass's host page_indptr, and keeps the
//   returned plan info keyed by the pass's device page_indptr view;
// - Run (per layer) finds the plan by the page_indptr tensor it is given (the same view), and calls `run`.
// A Run with an index tensor no plan was made for is an error naming the op, never a silent re-plan.
//
// Workspaces are owned by the adapter, so by the cache's op table: one float workspace (split-k partials,
// only used while a run executes, so shared by the passes) and per pass an int workspace on the device and
// a page-locked one on the host (plan metadata must outlive the plan for every layer's run; the host staging
// buffer is copied asynchronously, so passes do not share it).
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/error.h>

#include <array>
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
constexpr int64_t kKvLayoutHND = 1;                    // flashinfer QKVLayout::kHND: [page, head, slot, dim]
constexpr DLDataType kUInt8 = {kDLUInt, 8, 1};

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

// A DLTensor describing host memory (no ownership): plan's indptr arguments are host arrays.
DLTensor HostInt32(const std::vector<int32_t>& v, int64_t* shape) {
  *shape = static_cast<int64_t>(v.size());
  DLTensor t{};
  t.data = const_cast<int32_t*>(v.data());
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = kInt32;
  t.shape = shape;
  return t;
}

// FlashInfer reads a tensor's address with tvm-ffi's TensorView::data_ptr(), which is DLTensor::data and
// ignores byte_offset; pagedkv's index arrays are views into one aux buffer (byte_offset > 0). So every
// tensor goes to FlashInfer as a DLTensor whose offset is folded into data (device addresses are plain
// addresses on CUDA). The returned struct borrows shape/strides from `t`, which outlives the call.
DLTensor Folded(const DLTensor& t) {
  DLTensor out = t;
  out.data = static_cast<char*>(t.data) + t.byte_offset;
  out.byte_offset = 0;
  return out;
}

struct FoldedArg {
  DLTensor t;
  explicit FoldedArg(const ffi::Tensor& x) : t(Folded(*x.GetDLTensorPtr())) {}
};

uint64_t ViewKey(const ffi::Tensor& t) {
  const DLTensor* d = t.GetDLTensorPtr();
  return reinterpret_cast<uint64_t>(d->data) + d->byte_offset;
}

// K or V of pages[P, 2, Hkv, ps, D] as a strided [P, Hkv, ps, D] (HND) view, without a copy.
struct KVView {
  std::array<int64_t, 4> shape, strides;
  DLTensor t{};
  KVView(const DLTensor& pages, int which) {
    int64_t p = pages.shape[0], h = pages.shape[2], s = pages.shape[3], d = pages.shape[4];
    shape = {p, h, s, d};
    strides = {2 * h * s * d, s * d, d, 1};
    t = Folded(pages);
    t.ndim = 4;
    t.shape = shape.data();
    t.strides = strides.data();
    t.data = static_cast<char*>(t.data) + static_cast<uint64_t>(which) * h * s * d * ((pages.dtype.bits + 7) / 8);
  }
};

// Workspaces and plans of one adapter.
class Workspaces {
 public:
  void Ensure(const ForwardInfo& info, size_t passes) {
    if (!float_ws_.defined()) float_ws_ = info.fns->Alloc({kFloatWorkspaceBytes}, kUInt8, info.device);
    while (int_ws_.size() < passes) {
      int_ws_.push_back(info.fns->Alloc({kIntWorkspaceBytes}, kUInt8, info.device));
      // Page-locked host memory next to a CUDA device (plain host memory otherwise: the CPU adapter test).
      DLDevice host{info.device.device_type == kDLCUDA ? kDLCUDAHost : kDLCPU, 0};
      pinned_ws_.push_back(info.fns->Alloc({kIntWorkspaceBytes}, kUInt8, host));
    }
  }
  const ffi::Tensor& float_ws() const { return float_ws_; }
  const ffi::Tensor& int_ws(size_t i) const { return int_ws_[i]; }
  const ffi::Tensor& pinned_ws(size_t i) const { return pinned_ws_[i]; }

 private:
  ffi::Tensor float_ws_;
  std::vector<ffi::Tensor> int_ws_, pinned_ws_;
};

// attn_decode_paged on FlashInfer's batch decode (funcs: plan, run).
class DecodeAdapter : public OpAdapter {
 public:
  DecodeAdapter(ffi::Function plan, ffi::Function run) : plan_(std::move(plan)), run_(std::move(run)) {}

  void BeginForward(const ForwardInfo& info) final {
    plans_.clear();
    if (!info.plan->is_decode) return;
    const KVConfig& c = *info.config;
    ws_.Ensure(info, info.passes.size());
    // pagedkv: angle = p * rope_scale / theta^(2i/D); flashinfer: p * rope_rcp_scale * rope_rcp_theta^(2i/D).
    // (flashinfer's own names a divisor "rope_scale"; pagedkv's rope_scale multiplies.)
    rope_rcp_scale_ = c.rope_scale;
    rope_rcp_theta_ = 1.0 / c.rope_theta;
    // dtype carriers (flashinfer dispatches on their dtype only)
    int64_t zero = 0;
    DLTensor empty{};
    empty.device = info.device;
    empty.ndim = 1;
    empty.shape = &zero;
    empty.dtype = c.dl_dtype();
    for (size_t i = 0; i < info.passes.size(); ++i) {
      const ForwardInfo::Pass& p = info.passes[i];
      if (!p.host->one_query_per_entry) continue;  // the runtime sends those to attn_prefill_paged
      namespace a = abi::decode_plan;
      int64_t indptr_shape;
      DLTensor indptr = HostInt32(p.host->page_indptr, &indptr_shape);
      ArgPack<a::kNumArgs> args;
      args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(a::kIntWorkspaceBuffer, ws_.int_ws(i));
      args.Set(a::kPageLockedIntWorkspaceBuffer, ws_.pinned_ws(i));
      args.Set(a::kIndptr, &indptr);
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
      plans_[ViewKey(p.page_indptr)] = {i, args.Call(plan_, "decode plan").cast<ffi::Array<int64_t>>()};
    }
  }

  void EndForward() final { plans_.clear(); }

  // Kernel ABI: q, pages, page_indptr, page_values, last_page_len, k_pos_offset, q_pos, o, lse,
  //             apply_rope, rope_scale, rope_theta, sm_scale
  void Run(ffi::PackedArgs in) final {
    if (in.size() != 13) TVM_FFI_THROW(InternalError) << "pagedkv flashinfer: attn_decode_paged takes 13 arguments";
    if (in[9].cast<int>() != 0) {
      TVM_FFI_THROW(ValueError) << "pagedkv flashinfer: attn_decode_paged has no per-entry key position offset, "
                                << "so it cannot serve rope_mode 'inline' (the backend refuses it at compile time)";
    }
    ffi::Tensor pages = in[1].cast<ffi::Tensor>(), page_indptr = in[2].cast<ffi::Tensor>();
    auto it = plans_.find(ViewKey(page_indptr));
    if (it == plans_.end()) {
      TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: attn_decode_paged called for a pass that "
                                  << "begin_forward did not plan";
    }
    KVView k(*pages.GetDLTensorPtr(), 0), v(*pages.GetDLTensorPtr(), 1);
    FoldedArg q(in[0].cast<ffi::Tensor>()), indptr(page_indptr), indices(in[3].cast<ffi::Tensor>()),
        last(in[4].cast<ffi::Tensor>()), o(in[7].cast<ffi::Tensor>()), lse(in[8].cast<ffi::Tensor>());
    namespace a = abi::decode_run;
    ArgPack<a::kNumArgs> args;
    args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
    args.Set(a::kIntWorkspaceBuffer, ws_.int_ws(it->second.first));
    args.Set(a::kPlanInfoVec, it->second.second);
    args.Set(a::kQ, &q.t);
    args.Set(a::kPagedKCache, &k.t);
    args.Set(a::kPagedVCache, &v.t);
    args.Set(a::kPagedKvIndptr, &indptr.t);
    args.Set(a::kPagedKvIndices, &indices.t);
    args.Set(a::kPagedKvLastPageLen, &last.t);
    args.Set(a::kO, &o.t);
    args.Set(a::kMaybeLse, &lse.t);
    args.Set(a::kKvLayoutCode, kKvLayoutHND);
    args.Set(a::kWindowLeft, window_left_);
    args.Set(a::kEnablePdl, false);
    args.SetNone(a::kMaybeAlibiSlopes);
    args.Set(a::kLogitsSoftCap, logits_soft_cap_);
    args.Set(a::kSmScale, in[12].cast<double>());
    args.Set(a::kRopeRcpScale, rope_rcp_scale_);
    args.Set(a::kRopeRcpTheta, rope_rcp_theta_);
    args.Call(run_, "decode run");
  }

 private:
  ffi::Function plan_, run_;
  Workspaces ws_;
  std::map<uint64_t, std::pair<size_t, ffi::Array<int64_t>>> plans_;  // page_indptr view -> (pass, plan info)
  // Until KVConfig has sliding-window and soft-cap fields these are flashinfer's "off" values; they are
  // passed to plan and run from here, never written into a call.
  int64_t window_left_ = -1;
  double logits_soft_cap_ = 0.0;
  double rope_rcp_scale_ = 1.0, rope_rcp_theta_ = 1e-4;
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
  if (op == ops::kAttnDecodePaged) {
    if (funcs.size() != 2) {
      TVM_FFI_THROW(ValueError) << "pagedkv op table: backend 'flashinfer' takes [plan, run] for op '" << op
                                << "', got " << funcs.size() << " functions";
    }
    return std::make_unique<DecodeAdapter>(FuncArg(op, funcs, 0, "plan"), FuncArg(op, funcs, 1, "run"));
  }
  TVM_FFI_THROW(ValueError) << "pagedkv op table: this runtime has no 'flashinfer' adapter for op '" << op
                            << "' (it has: " << ops::kAttnDecodePaged << ")";
  TVM_FFI_UNREACHABLE();
}

struct Registrar {
  Registrar() { BackendRegistry::Global().Register("flashinfer", MakeFlashInferAdapter); }
} registrar;

}  // namespace
}  // namespace pagedkv
