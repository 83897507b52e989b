// The `pagedkv.*` globals (docs/ARCHITECTURE.md, "Globals"). Thin wrappers: all logic is in the object.
//
// Every global is registered through `Def`, which converts each argument itself and raises a TypeError
// naming the global and the argument for None or a value of the wrong type (tvm-ffi's object references
// are nullable, so a None cache or tensor would otherwise reach the object as a null pointer). The
// argument names are also published in the global's metadata ("arg_names", next to tvm-ffi's
// "type_schema"), which tests/cpu/test_runtime_handles.py reads to call every global with a bad argument.
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/json.h>
#include <tvm/ffi/function.h>

#include <array>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "paged_kv_cache.h"

namespace pagedkv {
namespace {

// What a value of C++ type T is called in an error message.
template <typename T>
const char* Expected() {
  if constexpr (std::is_same_v<T, PagedKVCache>) return "a PagedKVCache";
  else if constexpr (std::is_same_v<T, ffi::Tensor>) return "a tensor (ffi.Tensor)";
  else if constexpr (std::is_same_v<T, ffi::Shape>) return "a shape (tuple of ints)";
  else if constexpr (std::is_same_v<T, ffi::Array<ffi::Any>>) return "an array (list)";
  else if constexpr (std::is_same_v<T, ffi::String>) return "a str";
  else if constexpr (std::is_same_v<T, bool>) return "a bool";
  else if constexpr (std::is_same_v<T, int64_t>) return "an int";
  else if constexpr (std::is_same_v<T, double>) return "a float";
  else static_assert(!sizeof(T), "add the argument type to Expected()");
}

// The type of a given value as a user knows it (tvm-ffi's small-string forms are an implementation detail).
std::string GivenType(const ffi::AnyView& value) {
  std::string key = value.GetTypeKey();
  if (key == "ffi.SmallStr") return "ffi.String";
  if (key == "ffi.SmallBytes") return "ffi.Bytes";
  return key;
}

// Argument `name` of global `global` as a T; TypeError naming both for None or a wrong type.
template <typename T>
T Arg(const char* global, const char* name, const ffi::AnyView& value) {
  if (value.type_index() == ffi::TypeIndex::kTVMFFINone) {
    TVM_FFI_THROW(TypeError) << global << ": argument '" << name << "' is None; expected " << Expected<T>();
  }
  std::optional<T> out = value.try_cast<T>();
  bool null_ref = false;
  if constexpr (std::is_base_of_v<ffi::ObjectRef, T>) null_ref = out.has_value() && !out->defined();
  if (!out.has_value() || null_ref) {
    TVM_FFI_THROW(TypeError) << global << ": argument '" << name << "' is of type " << GivenType(value)
                             << "; expected " << Expected<T>();
  }
  return *std::move(out);
}

// Parameter and return types of a (non-generic) lambda.
template <typename F>
struct Signature : Signature<decltype(&F::operator())> {};
template <typename L, typename R, typename... A>
struct Signature<R (L::*)(A...) const> {
  using Return = R;
  using Args = std::tuple<std::decay_t<A>...>;
  using Typed = ffi::TypedFunction<R(std::decay_t<A>...)>;
  static constexpr size_t kArity = sizeof...(A);
};

template <typename F, size_t N, size_t... I>
void CallNamed(const char* global, const std::array<const char*, N>& names, const F& f, ffi::PackedArgs args,
               ffi::Any* rv, std::index_sequence<I...>) {
  using Sig = Signature<F>;
  // Braced initialization converts the arguments in order, so the first bad one is reported.
  typename Sig::Args values{Arg<std::tuple_element_t<I, typename Sig::Args>>(global, names[I], args[I])...};
  if constexpr (std::is_void_v<typename Sig::Return>) {
    std::apply(f, std::move(values));
  } else {
    *rv = std::apply(f, std::move(values));
  }
}

// Registers `f` as global `name` whose arguments are called `arg_names` (one per parameter of `f`).
template <size_t N, typename F>
void Def(const char* name, const char* const (&arg_names)[N], F f) {
  using Sig = Signature<F>;
  static_assert(N == Sig::kArity, "Def: give one name per argument");
  std::array<const char*, N> names;
  for (size_t i = 0; i < N; ++i) names[i] = arg_names[i];
  ffi::Function func = ffi::Function::FromPacked([name, names, f](ffi::PackedArgs args, ffi::Any* rv) {
    if (args.size() != static_cast<int>(N)) {
      std::ostringstream listed;
      for (size_t i = 0; i < N; ++i) listed << (i ? ", " : "") << names[i];
      TVM_FFI_THROW(TypeError) << name << " takes " << N << " arguments (" << listed.str() << "), got "
                               << args.size();
    }
    CallNamed(name, names, f, args, rv, std::make_index_sequence<N>{});
  });
  ffi::Array<ffi::Any> name_list;
  for (const char* n : names) name_list.push_back(ffi::String(n));
  ffi::Map<ffi::String, ffi::Any> meta;
  meta.Set("type_schema", ffi::String(Sig::Typed::TypeSchema()));
  meta.Set("arg_names", name_list);
  std::string meta_json(ffi::json::Stringify(meta));
  TVMFFIMethodInfo info;
  info.name = TVMFFIByteArray{name, std::char_traits<char>::length(name)};
  info.doc = TVMFFIByteArray{nullptr, 0};
  info.metadata = TVMFFIByteArray{meta_json.c_str(), meta_json.size()};
  info.flags = 0;
  info.method = ffi::AnyView(func).CopyToTVMFFIAny();
  TVM_FFI_CHECK_SAFE_CALL(TVMFFIFunctionSetGlobalFromMethodInfo(&info, 0));
}

// The globals of the sequence and forward lifecycle (create, add / fork / remove, begin / end, checks).
void RegisterLifecycleGlobals() {
  using C = PagedKVCache;
  using T = ffi::Tensor;
  Def("pagedkv.create", {"config_json", "runtime_values", "op_table", "device_ref"},
      [](ffi::String config_json, ffi::Shape runtime_values, ffi::Array<ffi::Any> op_table, T device_ref) -> C {
        return CreatePagedKVCache(std::string(config_json), runtime_values, op_table, device_ref);
      });
  Def("pagedkv.add_sequence", {"cache", "seq_id"}, [](C c, int64_t id) -> void { c->AddSequence(id); });
  Def("pagedkv.remove_sequence", {"cache", "seq_id"}, [](C c, int64_t id) -> void { c->RemoveSequence(id); });
  Def("pagedkv.fork_sequence", {"cache", "parent_id", "child_id", "fork_pos"},
      [](C c, int64_t parent, int64_t child, int64_t pos) -> void { c->ForkSequence(parent, child, pos); });
  Def("pagedkv.popn", {"cache", "seq_id", "n"}, [](C c, int64_t id, int64_t n) -> void { c->PopN(id, n); });
  Def("pagedkv.clear", {"cache"}, [](C c) -> void { c->Clear(); });
  Def("pagedkv.get_sequence_length", {"cache", "seq_id"},
      [](C c, int64_t id) -> int64_t { return c->GetSequenceLength(id); });
  Def("pagedkv.get_num_available_pages", {"cache"}, [](C c) -> int64_t { return c->GetNumAvailablePages(); });
  Def("pagedkv.pool_pages", {"cache"}, [](C c) -> ffi::Shape { return c->PoolPages(); });
  Def("pagedkv.get_total_sequence_length", {"cache"},
      [](C c) -> int64_t { return c->GetTotalSequenceLength(); });
  Def("pagedkv.begin_forward", {"cache", "seq_ids", "append_lengths"},
      [](C c, ffi::Shape ids, ffi::Shape lengths) -> void { c->BeginForward(ids, lengths); });
  Def("pagedkv.end_forward", {"cache"}, [](C c) -> void { c->EndForward(); });
  Def("pagedkv.abort_forward", {"cache"}, [](C c) -> void { c->AbortForward(); });
  Def("pagedkv.check_append", {"cache", "seq_ids", "append_lengths"},
      [](C c, ffi::Shape ids, ffi::Shape lengths) -> void { c->CheckAppend(ids, lengths); });
  // Returns `values`, so a Relax model's gather takes the checked tensor and runs after the check.
  Def("pagedkv.check_indices", {"cache", "values", "name", "bound", "bound_name"},
      [](C c, T values, ffi::String name, int64_t bound, ffi::String bound_name) -> T {
        c->CheckIndices(values, std::string(name), bound, std::string(bound_name));
        return values;
      });
}

// The attention, append and debug globals.
void RegisterAttentionGlobals() {
  using C = PagedKVCache;
  using T = ffi::Tensor;
  Def("pagedkv.attention_with_fused_qkv", {"cache", "layer", "sm_scale", "qkv", "o"},
      [](C c, int64_t layer, double sm_scale, T qkv, T o) -> void {
        c->AttentionWithFusedQKV(layer, qkv, std::nullopt, o, sm_scale);
      });
  // The same with learnable sinks (config attention_sinks): new globals, so that the ones above keep their
  // signatures and libraries compiled before sinks keep loading.
  Def("pagedkv.attention_with_fused_qkv_sinks", {"cache", "layer", "sm_scale", "qkv", "sinks", "o"},
      [](C c, int64_t layer, double sm_scale, T qkv, T sinks, T o) -> void {
        c->AttentionWithFusedQKVSinks(layer, qkv, sinks, o, sm_scale);
      });
  Def("pagedkv.self_attention", {"cache", "layer", "sm_scale", "q", "k", "v", "o", "lse"},
      [](C c, int64_t layer, double sm_scale, T q, T k, T v, T o, T lse) -> void {
        c->SelfAttention(layer, q, k, v, o, lse, sm_scale);
      });
  Def("pagedkv.cross_attention", {"cache", "layer", "sm_scale", "q", "o", "lse"},
      [](C c, int64_t layer, double sm_scale, T q, T o, T lse) -> void {
        c->CrossAttention(layer, q, o, lse, sm_scale);
      });
  Def("pagedkv.cross_attention_sinks", {"cache", "layer", "sm_scale", "q", "sinks", "o", "lse"},
      [](C c, int64_t layer, double sm_scale, T q, T sinks, T o, T lse) -> void {
        c->CrossAttentionSinks(layer, q, sinks, o, lse, sm_scale);
      });
  Def("pagedkv.merge_attn_output_inplace", {"cache", "o_a", "lse_a", "o_b", "lse_b"},
      [](C c, T o_a, T lse_a, T o_b, T lse_b) -> ffi::Array<T> {
        return c->MergeAttnOutputInplace(o_a, lse_a, o_b, lse_b);
      });
  // Returns the cache, so a Relax model orders its attention calls after the append by data flow.
  Def("pagedkv.append_mla_kv", {"cache", "layer", "kv"}, [](C c, int64_t layer, T kv) -> C {
    c->AppendMLAKV(layer, kv);
    return c;
  });
  Def("pagedkv.get_query_positions", {"cache"}, [](C c) -> T { return c->GetQueryPositions(); });
  Def("pagedkv.debug_get_kv", {"cache", "seq_id", "start", "end", "k_out", "v_out"},
      [](C c, int64_t id, int64_t start, int64_t end, T k_out, T v_out) -> void {
        c->DebugGetKV(id, start, end, k_out, v_out);
      });
  Def("pagedkv.debug_set_kv", {"cache", "seq_id", "start", "k", "v"},
      [](C c, int64_t id, int64_t start, T k, T v) -> void { c->DebugSetKV(id, start, k, v); });
  Def("pagedkv.debug_get_mla_kv", {"cache", "seq_id", "start", "end", "kv_out"},
      [](C c, int64_t id, int64_t start, int64_t end, T kv_out) -> void {
        c->DebugGetKVMLA(id, start, end, kv_out);
      });
  Def("pagedkv.debug_set_mla_kv", {"cache", "seq_id", "start", "kv"},
      [](C c, int64_t id, int64_t start, T kv) -> void { c->DebugSetMLAKV(id, start, kv); });
  Def("pagedkv.debug_end_forward_unwritten", {"cache"}, [](C c) -> void { c->DebugEndForwardUnwritten(); });
  Def("pagedkv.debug_poison_pages", {"cache", "on"}, [](C c, bool on) -> void { c->DebugPoisonPages(on); });
  Def("pagedkv.debug_forward_arrays", {"cache"},
      [](C c) -> ffi::Map<ffi::String, T> { return c->DebugForwardArrays(); });
  Def("pagedkv.debug_attention_calls", {"cache"}, [](C c) -> int64_t { return c->DebugAttentionCalls(); });
  Def("pagedkv.config_json", {"cache"}, [](C c) -> ffi::String { return ffi::String(c->ConfigJSON()); });
  Def("pagedkv.op_backends", {"cache"},
      [](C c) -> ffi::Map<ffi::String, ffi::String> { return c->OpBackends(); });
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  RegisterLifecycleGlobals();
  RegisterAttentionGlobals();
}

}  // namespace pagedkv
