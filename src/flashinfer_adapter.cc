// The "flashinfer" backend: adapters from pagedkv's kernel ABI to the functions of FlashInfer 0.7.4 JIT
// modules linked into the model library (python/pagedkv/flashinfer). Argument positions come from
// src/flashinfer_abi.h, generated from the pinned table python/pagedkv/flashinfer/abi.py that the CI test
// checks against compiled modules.
//
// Ops and modules (docs/FLASHINFER.md):
//   attn_decode_paged       decode module, or      plan per decode pass, run per layer
//                           prefill_fa2 / _fa3     (tensor-core decode: the paged prefill kernel)
//   attn_prefill_ragged     prefill_fa2 or _fa3    plan once per prefill forward (causal), run per layer
//   attn_prefill_paged      prefill_fa2 or _fa3    plan per pass it serves (non-causal), run per layer
//   mla_attn_decode_paged   mla or mla_fa3         plan per decode pass, run per layer
//   mla_attn_prefill_paged  mla or mla_fa3         plan per pass it serves (non-causal), run per layer
// An op-table entry is [op, "flashinfer", module_kind, empty_rows, plan, run]: the module kind string
// ("decode", "prefill_fa2", "prefill_fa3", "mla", "mla_fa3"; "decode|prefill_fa2" adds a second plan, run
// pair and chooses per forward, ChooseDecodeAdapter) says which pinned argument lists plan and run take, and
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
#include "flashinfer_common.h"

namespace pagedkv {
namespace fi {
namespace {

ffi::Function FuncArg(const std::string& op, const ffi::Array<ffi::Any>& funcs, size_t i, const char* name) {
  auto f = funcs[i].as<ffi::Function>();
  if (!f.has_value()) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op << "' (backend 'flashinfer') needs function '"
                              << name << "' at position " << i << ", got " << funcs[i].GetTypeKey();
  }
  return *f;
}

// attn_decode_paged on two modules ("decode|prefill_fa2"): per forward, the CUDA-core decode kernel when the
// decode passes are skewed (their longest entry has at least kSkew times the mean keys) and small (at most
// kMaxCudaCoreRows entries x kv heads), else the tensor-core path (the prefill kernel). Measured on the H200
// at GQA group 4 (python/pagedkv/backends/flashinfer.py; benchmarks/HISTORY.md run 14): tensor cores win on uniform
// batches; on 128 ... 16K keys the CUDA-core kernel wins with 32 entries x 8 kv heads (1.34x) and loses with
// 64 x 8 (1.22x slower).
class ChooseDecodeAdapter : public OpAdapter {
 public:
  static constexpr double kSkew = 2.0;
  static constexpr int64_t kMaxCudaCoreRows = 256;
  ChooseDecodeAdapter(std::unique_ptr<OpAdapter> cuda_cores, std::unique_ptr<OpAdapter> tensor_cores)
      : cuda_cores_(std::move(cuda_cores)), tensor_cores_(std::move(tensor_cores)) {}

  void BeginForward(const ForwardInfo& info) final {
    // A CUDA-graph decode replays one kernel choice for every forward of a batch size: tensor cores, which
    // win on the uniform batches graphs usually replay.
    chosen_ = !info.cuda_graph && Skewed(info) ? cuda_cores_.get() : tensor_cores_.get();
    chosen_->BeginForward(info);
  }
  void Run(ffi::PackedArgs args) final {
    if (chosen_ == nullptr) {
      TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: attn_decode_paged called outside a forward";
    }
    chosen_->Run(args);
  }
  void EndForward() final {
    if (chosen_ != nullptr) chosen_->EndForward();
    chosen_ = nullptr;
  }
 private:
  static bool Skewed(const ForwardInfo& info) {
    if (!info.plan->is_decode) return false;
    int64_t entries = 0, keys = 0, longest = 0;
    for (const ForwardInfo::Pass& p : info.passes) {
      if (!p.host->one_query_per_entry) continue;
      for (int32_t n : PagedKvLens(*p.host, info.config->page_size)) {
        ++entries;
        keys += n;
        longest = std::max<int64_t>(longest, n);
      }
    }
    if (entries * info.config->num_kv_heads > kMaxCudaCoreRows) return false;
    return entries > 1 && static_cast<double>(longest) * entries >= kSkew * static_cast<double>(keys);
  }

  std::unique_ptr<OpAdapter> cuda_cores_, tensor_cores_;
  OpAdapter* chosen_ = nullptr;
};

std::unique_ptr<OpAdapter> MakeFlashInferAdapter(const std::string& op, const ffi::Array<ffi::Any>& funcs) {
  auto kind_str = funcs.size() > 0 ? funcs[0].as<ffi::String>() : std::nullopt;
  std::string kind = kind_str.has_value() ? std::string(*kind_str) : "";
  size_t want_size = kind == "decode|prefill_fa2" ? 6 : 4;
  if (funcs.size() != want_size) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: backend 'flashinfer' takes [module_kind, empty_rows, plan, "
                              << "run" << (want_size == 6 ? ", plan, run" : "") << "] for op '" << op << "', got "
                              << funcs.size() << " values";
  }
  if (!kind_str.has_value()) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op << "' (backend 'flashinfer') needs the module kind "
                              << "string first, got " << funcs[0].GetTypeKey();
  }
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
    want({"decode", "prefill_fa2", "prefill_fa3", "decode|prefill_fa2"});
    if (kind == "decode") return MakeDecodeAdapter(e, plan, run);
    if (kind == "decode|prefill_fa2") {
      ffi::Function plan2 = FuncArg(op, funcs, 4, "plan"), run2 = FuncArg(op, funcs, 5, "run");
      return std::make_unique<ChooseDecodeAdapter>(MakeDecodeAdapter(e, plan, run),
                                                   MakePrefillAdapter(op, false, e, plan2, run2));
    }
    return MakePrefillAdapter(op, kind == "prefill_fa3", e, plan, run);
  }
  if (op == ops::kAttnPrefillRagged || op == ops::kAttnPrefillPaged) {
    want({"prefill_fa2", "prefill_fa3"});
    return MakePrefillAdapter(op, kind == "prefill_fa3", e, plan, run);
  }
  if (op == ops::kMLAAttnDecodePaged || op == ops::kMLAAttnPrefillPaged) {
    // fa2 ("mla") and fa3 ("mla_fa3", Hopper) MLA export plan / run with the same argument lists.
    want({"mla", "mla_fa3"});
    return MakeMLAAdapter(op == ops::kMLAAttnDecodePaged, e, plan, run);
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
}  // namespace fi
}  // namespace pagedkv
