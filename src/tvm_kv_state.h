// TVM's KV-state protocol: tvm::runtime::vm::KVStateObj and AttentionKVCacheObj, the base classes whose
// methods libtvm_runtime's `vm.builtin.kv_state_*` and `vm.builtin.attention_kv_cache_*` globals call through
// the vtable. PagedKVCacheObj derives from AttentionKVCacheObj, so an engine written against those globals
// (MLC-LLM, TVM's own cache tests) drives a pagedkv cache unchanged (docs/ARCHITECTURE.md, "TVM's KV-state
// protocol"). The header is TVM's own (CMakeLists.txt finds it in the installed apache-tvm wheel), so the
// vtable layout is the runtime's by construction.
//
// Nothing is linked from libtvm_runtime, so the runtime library still loads beside the TVM runtime alone (or
// before it): every method of both classes is pure virtual (no key function: their vtables and typeinfo are
// emitted in this library), and their type indices are resolved by type key through tvm-ffi
// (TVMFFITypeGetOrAllocIndex returns the index of a key already registered, by whichever library loads first).
#ifndef PAGEDKV_TVM_KV_STATE_H_
#define PAGEDKV_TVM_KV_STATE_H_

#include <tvm/ffi/container/tensor.h>

// The wheel ships tvm/runtime/tensor.h but not the tvm/support/{io,serializer}.h it includes (for
// Tensor::Save / Load, which the protocol never uses), so kv_state.h is read with tvm::runtime::Tensor as
// ffi::Tensor itself. That is the same type at the ABI level: the runtime's Tensor derives from ffi::Tensor and
// adds no data member and no virtual method, so both have one layout and are passed and returned alike, and
// every vtable slot takes the arguments libtvm_runtime passes.
#ifdef TVM_RUNTIME_TENSOR_H_
#error "include tvm_kv_state.h before any header that includes <tvm/runtime/tensor.h>"
#endif
#define TVM_RUNTIME_TENSOR_H_
namespace tvm {
namespace runtime {
using Tensor = ::tvm::ffi::Tensor;
}  // namespace runtime
}  // namespace tvm

#include <runtime/vm/kv_state.h>

static_assert(sizeof(tvm::runtime::Tensor) == sizeof(void*), "ffi::Tensor is one object pointer");

#endif  // PAGEDKV_TVM_KV_STATE_H_
