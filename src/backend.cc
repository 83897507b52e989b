// The adapter registry, the "direct" adapter (one function per op, called with the kernel ABI unchanged) and
// "direct_max_kv_len" (the same, then a launch-shape hint the runtime knows on the host).
#include "backend.h"

#include <tvm/ffi/error.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <array>
#include <map>
#include <sstream>
#include <string_view>
#include <utility>

#include "ops.h"

namespace pagedkv {
namespace {

// Functions that implement the kernel ABI (TIR kernels, or any backend's that follow src/ops.h): a plain forward.
class DirectAdapter : public OpAdapter {
 public:
  explicit DirectAdapter(ffi::Function func) : func_(std::move(func)) {}
  void Run(ffi::PackedArgs args) final {
    ffi::Any rv;
    func_.CallPacked(args, &rv);
  }

 private:
  ffi::Function func_;
};

// The one function of an entry of adapter `kind` ("direct" or "direct_max_kv_len").
ffi::Function OneFunction(const std::string& op, const ffi::Array<ffi::Any>& funcs, const char* kind) {
  if (funcs.size() != 1) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: adapter '" << kind << "' takes exactly one function for op '"
                              << op << "', got " << funcs.size();
  }
  auto func = funcs[0].as<ffi::Function>();
  if (!func.has_value()) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op << "' (adapter '" << kind
                              << "') needs a function, got " << funcs[0].GetTypeKey();
  }
  return *func;
}

std::unique_ptr<OpAdapter> MakeDirectAdapter(const std::string& op, const ffi::Array<ffi::Any>& funcs) {
  return std::make_unique<DirectAdapter>(OneFunction(op, funcs, "direct"));
}

// "direct_max_kv_len": the one function follows the kernel ABI followed by max_kv_len (int32), the most keys
// any entry of the call's pass reads from pages (python/pagedkv/ops.py ADAPTER_ARGS). Kernels use it for their
// launch shape only (a split-KV count that does not leave the longest entry alone in one block), so any value
// is correct; a CUDA-graph decode passes 0 (unknown): its replays reuse the captured arguments.
class DirectMaxKvLenAdapter : public OpAdapter {
 public:
  DirectMaxKvLenAdapter(std::string op, ffi::Function func, int page_indptr_arg)
      : op_(std::move(op)), func_(std::move(func)), page_indptr_arg_(page_indptr_arg) {}

  void BeginForward(const ForwardInfo& info) final {
    longest_.clear();
    for (const ForwardInfo::Pass& p : info.passes) {
      longest_[ViewKey(p.page_indptr)] = info.cuda_graph ? 0 : LongestKvLen(*p.host, info.config->page_size);
    }
  }
  void EndForward() final { longest_.clear(); }

  void Run(ffi::PackedArgs args) final {
    if (args.size() <= page_indptr_arg_) {
      TVM_FFI_THROW(InternalError) << "pagedkv: op '" << op_ << "' called with " << args.size() << " arguments";
    }
    auto it = longest_.find(ViewKey(args[page_indptr_arg_]));
    if (it == longest_.end()) {
      TVM_FFI_THROW(RuntimeError) << "pagedkv: op '" << op_ << "' (adapter 'direct_max_kv_len') called for a pass "
                                  << "that begin_forward did not see";
    }
    // On the stack: this runs once per layer of every decode step (no allocation on the host's hot path).
    constexpr int kMaxArgs = 32;
    if (args.size() >= kMaxArgs) {
      TVM_FFI_THROW(InternalError) << "pagedkv: op '" << op_ << "' has more than " << kMaxArgs - 1 << " arguments";
    }
    std::array<ffi::AnyView, kMaxArgs> packed;
    std::copy(args.data(), args.data() + args.size(), packed.begin());
    packed[args.size()] = ffi::AnyView(it->second);
    ffi::Any rv;
    func_.CallPacked(ffi::PackedArgs(packed.data(), args.size() + 1), &rv);
  }

 private:
  std::string op_;
  ffi::Function func_;
  int page_indptr_arg_;
  std::map<uint64_t, int32_t> longest_;
};

// The position of op's page_indptr argument (src/ops.h), or -1 when it has none.
int PageIndptrArg(const std::string& op) {
  for (const ops::OpInfo& info : ops::kOpInfo) {
    if (op != info.name) continue;
    for (int i = 0; i < info.num_args; ++i) {
      if (std::string_view(info.arg_names[i]) == "page_indptr") return i;
    }
  }
  return -1;
}

std::unique_ptr<OpAdapter> MakeDirectMaxKvLenAdapter(const std::string& op, const ffi::Array<ffi::Any>& funcs) {
  int arg = PageIndptrArg(op);
  if (arg < 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: adapter 'direct_max_kv_len' serves ops with a page_indptr "
                              << "argument, not '" << op << "'";
  }
  return std::make_unique<DirectMaxKvLenAdapter>(op, OneFunction(op, funcs, ops::kDirectMaxKVLen), arg);
}

constexpr std::string_view kAdapterPrefix = "adapter=";

// An entry is [op, tag, "adapter=<kind>", funcs...]. Libraries compiled before adapter kinds existed wrote
// [op, tag, funcs...], where the tag named the adapter ("tir": direct); they keep loading.
std::pair<std::string, size_t> AdapterOf(const ffi::Array<ffi::Any>& entry, const std::string& tag) {
  if (entry.size() > 2) {
    if (auto s = entry[2].as<ffi::String>()) {
      std::string_view text(s->data(), s->size());
      if (text.substr(0, kAdapterPrefix.size()) == kAdapterPrefix) {
        return {std::string(text.substr(kAdapterPrefix.size())), 3};
      }
    }
  }
  return {tag == "tir" ? "direct" : tag, 2};
}

}  // namespace

BackendRegistry::BackendRegistry() {
  factories_["direct"] = MakeDirectAdapter;
  factories_[ops::kDirectMaxKVLen] = MakeDirectMaxKvLenAdapter;
}

BackendRegistry& BackendRegistry::Global() {
  static BackendRegistry registry;
  return registry;
}

void BackendRegistry::Register(const std::string& adapter, AdapterFactory factory) {
  factories_[adapter] = std::move(factory);
}

std::unique_ptr<OpAdapter> BackendRegistry::Make(const std::string& adapter, const std::string& op,
                                                 const ffi::Array<ffi::Any>& funcs) const {
  auto it = factories_.find(adapter);
  if (it == factories_.end()) {
    std::ostringstream known;
    for (const auto& kv : factories_) known << " " << kv.first;
    TVM_FFI_THROW(ValueError) << "pagedkv op table: unknown adapter kind '" << adapter << "' for op '" << op
                              << "'; this runtime has:" << known.str();
  }
  return it->second(op, funcs);
}

OpAdapter& OpTable::Get(const char* op) const {
  auto it = adapters.find(op);
  if (it == adapters.end()) {
    TVM_FFI_THROW(ValueError) << "pagedkv: op '" << op << "' is not in this cache's op table";
  }
  return *it->second;
}

void OpTable::BeginForward(const ForwardInfo& info) const {
  for (const auto& kv : adapters) kv.second->BeginForward(info);
  for (const auto& kv : windows) kv.second->BeginForward(info);
}

void OpTable::EndForward() const {
  for (const auto& kv : adapters) kv.second->EndForward();
  for (const auto& kv : windows) kv.second->EndForward();
}

void MissingArgument(const char* op, const char* const* names, int num_args, uint64_t given) {
  for (int i = 0; i < num_args; ++i) {
    if (!(given >> i & 1)) {
      TVM_FFI_THROW(InternalError) << "pagedkv: call of op '" << op << "' without its argument '" << names[i]
                                   << "' (position " << i << " of " << num_args << ")";
    }
  }
  TVM_FFI_THROW(InternalError) << "pagedkv: call of op '" << op << "' with unexpected arguments";
}

namespace {

// One entry [op, tag, ...] into `out`; `window` > 0: an entry of that window's sub-table (window ops only).
void ParseEntry(const ffi::Any& entry_any, const std::string& layer_kind, int64_t window, OpTable* out) {
  auto entry = entry_any.as<ffi::Array<ffi::Any>>();
  if (!entry.has_value() || entry->size() < 2) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: each entry must be [op_name, backend_tag, func...]";
  }
  auto op = (*entry)[0].as<ffi::String>();
  auto tag = (*entry)[1].as<ffi::String>();
  if (!op.has_value() || !tag.has_value()) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: op name and backend tag must be strings";
  }
  std::string op_name(*op);
  if (!ops::IsKnownOp(op_name)) TVM_FFI_THROW(ValueError) << "pagedkv op table: unknown op '" << op_name << "'";
  if (layer_kind == "mla" ? !ops::Contains(ops::kMLAOps, op_name) : !ops::Contains(ops::kMHAOps, op_name)) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op_name << "' is not an op of " << layer_kind
                              << " layers, the kind of this cache";
  }
  if (window > 0 && !ops::Contains(ops::kWindowOps, op_name)) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op_name << "' in the sub-table of window " << window
                              << " applies no window (only the window ops are built per window)";
  }
  if (out->adapters.count(op_name)) TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op_name << "' given twice";
  auto [adapter, first_func] = AdapterOf(*entry, std::string(*tag));
  ffi::Array<ffi::Any> funcs(entry->begin() + first_func, entry->end());
  out->adapters[op_name] = BackendRegistry::Global().Make(adapter, op_name, funcs);
  out->backends[op_name] = std::string(*tag);
}

constexpr std::string_view kWindowPrefix = "window=";

// The window W of a sub-table entry ["window=<W>", entry...], or 0 for an op entry.
int64_t WindowOf(const ffi::Any& entry_any) {
  auto entry = entry_any.as<ffi::Array<ffi::Any>>();
  if (!entry.has_value() || entry->empty()) return 0;
  auto head = (*entry)[0].as<ffi::String>();
  if (!head.has_value()) return 0;
  std::string text(*head);
  if (text.rfind(kWindowPrefix, 0) != 0) return 0;
  int64_t w = 0;
  try {
    w = std::stoll(text.substr(kWindowPrefix.size()));
  } catch (const std::exception&) {
    w = 0;
  }
  if (w < 1) TVM_FFI_THROW(ValueError) << "pagedkv op table: '" << text << "' is not a window > 0";
  return w;
}

}  // namespace

OpTable ParseOpTable(const ffi::Array<ffi::Any>& table, const std::string& layer_kind) {
  OpTable out;
  for (const ffi::Any& entry_any : table) {
    int64_t window = WindowOf(entry_any);
    if (window == 0) {
      ParseEntry(entry_any, layer_kind, 0, &out);
      continue;
    }
    if (out.windows.count(window)) {
      TVM_FFI_THROW(ValueError) << "pagedkv op table: the sub-table of window " << window << " is given twice";
    }
    auto sub = std::make_unique<OpTable>();
    auto entries = entry_any.cast<ffi::Array<ffi::Any>>();
    for (size_t i = 1; i < entries.size(); ++i) ParseEntry(entries[i], layer_kind, window, sub.get());
    out.windows[window] = std::move(sub);
  }
  auto require = [&out, &layer_kind](const auto& required) {
    for (const char* op : required) {
      if (!out.adapters.count(op)) {
        TVM_FFI_THROW(ValueError) << "pagedkv op table: missing op '" << op << "' (needed by " << layer_kind
                                  << " layers)";
      }
    }
  };
  if (layer_kind == "mla") {
    require(ops::kRequiredMLAOps);
  } else {
    require(ops::kRequiredMHAOps);
  }
  return out;
}

}  // namespace pagedkv
