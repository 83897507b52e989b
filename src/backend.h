// Backends: the one registry from backend tag to adapter factory.
//
// The runtime calls every op with its kernel ABI (src/ops.h, generated from python/pagedkv/ops.py), always
// with the arguments in ABI order. An OpAdapter turns that call into whatever its functions want: the
// "direct" adapter forwards it unchanged to the one function (TIR kernels, or any backend whose functions
// follow the ABI: no C++ needed); a library adapter ("flashinfer") plans, reorders or splits it. The op table
// names the adapter kind of each op apart from its backend tag; a new adapter kind registers one factory.
#ifndef PAGEDKV_BACKEND_H_
#define PAGEDKV_BACKEND_H_

#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/function.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "forward_plan.h"
#include "ops.h"
#include "tensor_util.h"

namespace pagedkv {

namespace ffi = tvm::ffi;

// What an adapter sees of one forward when it opens (begin_forward, after the index arrays reached the
// device): the host arrays of every pass, their device views (the very tensors later Run calls receive as
// page_indptr etc.), and the cache's config, device and allocator. Host arrays live only during the call.
struct ForwardInfo {
  struct Pass {
    const PassPlan* host;
    ffi::Tensor q_indptr, page_indptr, page_values, last_page_len, k_pos_offset;
  };
  const KVConfig* config = nullptr;
  DLDevice device{};
  const TensorFns* fns = nullptr;
  const ForwardPlan* plan = nullptr;
  ffi::Tensor q_indptr;        // device view of plan->q_indptr (ragged attention's q and kv indptr)
  ffi::Tensor no_keys_indptr;  // device view of B+1 zeros: the ragged kv_indptr of a decode self_attention
  std::vector<Pass> passes;
  // Buffers owned by the cache that every adapter of it may share (e.g. one split-k workspace for all of a
  // library's ops), by name; they live as long as the cache.
  std::map<std::string, ffi::Tensor>* scratch = nullptr;
  // A CUDA-graph decode forward (config cuda_graph_batch): the layer calls may have been captured once and
  // replayed, so a plan must give every forward of the same batch size the same launch configuration
  // (FlashInfer's enable_cuda_graph) and keep its metadata at the same device addresses.
  bool cuda_graph = false;
  // The device takes programmatic dependent launch (sm_90+): FlashInfer's kernels are launched with it, as
  // its own wrappers do there (enable_pdl; each kernel waits for its predecessor before it reads memory).
  // Measured on the H200: 2.5% of a B=1 L=32K tensor-core decode (benchmarks/HISTORY.md).
  bool pdl = false;
};

// One op served by one backend.
class OpAdapter {
 public:
  virtual ~OpAdapter() = default;
  // Runs the op; `args` follow the op's kernel ABI argument list.
  virtual void Run(ffi::PackedArgs args) = 0;
  // Forward hooks (default: nothing). A library backend plans here, once per forward and pass, and keeps
  // what it planned until EndForward; Run then finds a pass's plan by the index tensors it is given.
  virtual void BeginForward(const ForwardInfo& info) {}
  virtual void EndForward() {}

  template <typename... Args>
  void operator()(Args&&... args) {
    ffi::AnyView packed[sizeof...(Args)] = {ffi::AnyView(args)...};
    Run(ffi::PackedArgs(packed, static_cast<int32_t>(sizeof...(Args))));
  }
};

// Builds the adapter of `op` from the functions given for it in the op table.
using AdapterFactory =
    std::function<std::unique_ptr<OpAdapter>(const std::string& op, const ffi::Array<ffi::Any>& funcs)>;

// Adapter kind -> factory.
class BackendRegistry {
 public:
  static BackendRegistry& Global();
  void Register(const std::string& adapter, AdapterFactory factory);
  // Throws ValueError naming `adapter` (and the known kinds) when none has that name.
  std::unique_ptr<OpAdapter> Make(const std::string& adapter, const std::string& op,
                                  const ffi::Array<ffi::Any>& funcs) const;

 private:
  BackendRegistry();
  std::map<std::string, AdapterFactory> factories_;
};

// Throws naming `op` and the first argument whose bit in `given` is unset (OpTable::Call).
[[noreturn]] void MissingArgument(const char* op, const char* const* names, int num_args, uint64_t given);

// The op table of one cache: op name -> adapter, and op name -> backend tag.
struct OpTable {
  std::map<std::string, std::unique_ptr<OpAdapter>> adapters;
  std::map<std::string, std::string> backends;
  // Config layer_groups (schema 7): sliding window -> the kernels of the window ops (ops::kWindowOps) built with
  // that window, for the layers of the groups with it; every other op (and full layers) are served by this table.
  std::map<int64_t, std::unique_ptr<OpTable>> windows;

  // The adapter of `op`; throws naming `op` when the table has none.
  OpAdapter& Get(const char* op) const;
  // Calls op `A` (an argument struct of src/ops.h) with its arguments in ABI order; throws naming the op and
  // the first argument the caller did not give.
  template <typename A>
  void Call(const A& a) const {
    constexpr uint64_t all = A::kNumArgs == 64 ? ~uint64_t{0} : (uint64_t{1} << A::kNumArgs) - 1;
    if (a.given != all) MissingArgument(A::kName, A::kArgNames, A::kNumArgs, a.given);
    Get(A::kName).Run(ffi::PackedArgs(a.args.data(), A::kNumArgs));
  }
  // The forward hooks of every adapter.
  void BeginForward(const ForwardInfo& info) const;
  void EndForward() const;
};

// Parses `[[op_name, backend_tag, "adapter=<kind>", option..., func...], ...]` (or the older
// `[op_name, backend_tag, func...]`, whose tag names the adapter) for a cache of `layer_kind` ("mha" or
// "mla"); unknown op names, ops of the other kind, duplicate ops, unknown adapter kinds and missing required
// ops (src/ops.h) are errors that name them. An entry `["window=<W>", entry...]` is the sub-table of window W
// (OpTable::windows; window ops only).
OpTable ParseOpTable(const ffi::Array<ffi::Any>& table, const std::string& layer_kind);

}  // namespace pagedkv

#endif  // PAGEDKV_BACKEND_H_
