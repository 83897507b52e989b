// The backend registry and the "tir" backend (one PrimFunc per op, called with the ABI unchanged).
#include "backend.h"

#include <tvm/ffi/error.h>
#include <tvm/ffi/string.h>

#include <sstream>

#include "ops.h"

namespace pagedkv {
namespace {

// TIR kernels implement the ABI directly, so the adapter is a plain forward.
class TirAdapter : public OpAdapter {
 public:
  explicit TirAdapter(ffi::Function func) : func_(std::move(func)) {}
  void Run(ffi::PackedArgs args) final {
    ffi::Any rv;
    func_.CallPacked(args, &rv);
  }

 private:
  ffi::Function func_;
};

std::unique_ptr<OpAdapter> MakeTirAdapter(const std::string& op, const ffi::Array<ffi::Any>& funcs) {
  if (funcs.size() != 1) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: backend 'tir' takes exactly one function for op '" << op
                              << "', got " << funcs.size();
  }
  auto func = funcs[0].as<ffi::Function>();
  if (!func.has_value()) {
    TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op << "' (backend 'tir') needs a function, got "
                              << funcs[0].GetTypeKey();
  }
  return std::make_unique<TirAdapter>(*func);
}

}  // namespace

BackendRegistry::BackendRegistry() { factories_["tir"] = MakeTirAdapter; }

BackendRegistry& BackendRegistry::Global() {
  static BackendRegistry registry;
  return registry;
}

void BackendRegistry::Register(const std::string& tag, AdapterFactory factory) {
  factories_[tag] = std::move(factory);
}

std::unique_ptr<OpAdapter> BackendRegistry::Make(const std::string& tag, const std::string& op,
                                                 const ffi::Array<ffi::Any>& funcs) const {
  auto it = factories_.find(tag);
  if (it == factories_.end()) {
    std::ostringstream known;
    for (const auto& kv : factories_) known << " " << kv.first;
    TVM_FFI_THROW(ValueError) << "pagedkv op table: unknown backend '" << tag << "' for op '" << op
                              << "'; known backends:" << known.str();
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
}

void OpTable::EndForward() const {
  for (const auto& kv : adapters) kv.second->EndForward();
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

OpTable ParseOpTable(const ffi::Array<ffi::Any>& table, const std::string& layer_kind) {
  bool mla = layer_kind == "mla";
  OpTable out;
  for (const ffi::Any& entry_any : table) {
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
    if (mla ? !ops::Contains(ops::kMLAOps, op_name) : !ops::Contains(ops::kMHAOps, op_name)) {
      TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op_name << "' is not an op of " << layer_kind
                                << " layers, the kind of this cache";
    }
    if (out.adapters.count(op_name)) TVM_FFI_THROW(ValueError) << "pagedkv op table: op '" << op_name << "' given twice";
    ffi::Array<ffi::Any> funcs(entry->begin() + 2, entry->end());
    out.adapters[op_name] = BackendRegistry::Global().Make(std::string(*tag), op_name, funcs);
    out.backends[op_name] = std::string(*tag);
  }
  auto require = [&out, &layer_kind](const auto& required) {
    for (const char* op : required) {
      if (!out.adapters.count(op)) {
        TVM_FFI_THROW(ValueError) << "pagedkv op table: missing op '" << op << "' (needed by " << layer_kind
                                  << " layers)";
      }
    }
  };
  if (mla) {
    require(ops::kRequiredMLAOps);
  } else {
    require(ops::kRequiredMHAOps);
  }
  return out;
}

}  // namespace pagedkv
