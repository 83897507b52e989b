// `pagedkv.op_vocabulary`: the runtime's op vocabulary and argument names (src/ops.h, generated from
// python/pagedkv/ops.py), so a test can check that Python and the compiled runtime agree.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#include "ops.h"

namespace pagedkv {
namespace {

namespace ffi = tvm::ffi;

template <size_t N>
ffi::Array<ffi::String> Names(const std::array<const char*, N>& ops) {
  ffi::Array<ffi::String> out;
  for (const char* op : ops) out.push_back(op);
  return out;
}

ffi::Map<ffi::String, ffi::Any> Vocabulary() {
  ffi::Map<ffi::String, ffi::Any> args;
  for (const ops::OpInfo& info : ops::kOpInfo) {
    ffi::Array<ffi::String> names;
    for (int i = 0; i < info.num_args; ++i) names.push_back(info.arg_names[i]);
    args.Set(info.name, names);
  }
  return {{"ops", Names(ops::kAllOps)},
          {"mha", Names(ops::kMHAOps)},
          {"mla", Names(ops::kMLAOps)},
          {"required_mha", Names(ops::kRequiredMHAOps)},
          {"required_mla", Names(ops::kRequiredMLAOps)},
          {"args", args}};
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() { tvm::ffi::reflection::GlobalDef().def("pagedkv.op_vocabulary", Vocabulary); }

}  // namespace pagedkv
