// The `pagedkv.*` globals (docs/ARCHITECTURE.md, "Globals"). Thin wrappers: all logic is in the object.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/reflection/registry.h>

#include "paged_kv_cache.h"

namespace pagedkv {

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  using C = PagedKVCache;
  using T = ffi::Tensor;
  refl::GlobalDef()
      .def("pagedkv.create",
           [](ffi::String config_json, ffi::Shape runtime_values, ffi::Array<ffi::Any> op_table,
              T device_ref) -> C {
             return CreatePagedKVCache(std::string(config_json), runtime_values, op_table, device_ref);
           })
      .def("pagedkv.add_sequence", [](C c, int64_t id) -> void { c->AddSequence(id); })
      .def("pagedkv.remove_sequence", [](C c, int64_t id) -> void { c->RemoveSequence(id); })
      .def("pagedkv.fork_sequence",
           [](C c, int64_t parent, int64_t child, int64_t pos) -> void { c->ForkSequence(parent, child, pos); })
      .def("pagedkv.popn", [](C c, int64_t id, int64_t n) -> void { c->PopN(id, n); })
      .def("pagedkv.clear", [](C c) -> void { c->Clear(); })
      .def("pagedkv.get_sequence_length", [](C c, int64_t id) -> int64_t { return c->GetSequenceLength(id); })
      .def("pagedkv.get_num_available_pages", [](C c) -> int64_t { return c->GetNumAvailablePages(); })
      .def("pagedkv.get_total_sequence_length", [](C c) -> int64_t { return c->GetTotalSequenceLength(); })
      .def("pagedkv.begin_forward",
           [](C c, ffi::Shape ids, ffi::Shape lengths) -> void { c->BeginForward(ids, lengths); })
      .def("pagedkv.end_forward", [](C c) -> void { c->EndForward(); })
      .def("pagedkv.attention_with_fused_qkv",
           [](C c, int64_t layer, double sm_scale, T qkv, T o) -> void {
             c->AttentionWithFusedQKV(layer, sm_scale, qkv, o);
           })
      .def("pagedkv.self_attention",
           [](C c, int64_t layer, double sm_scale, T q, T k, T v, T o, T lse) -> void {
             c->SelfAttention(layer, sm_scale, q, k, v, o, lse);
           })
      .def("pagedkv.cross_attention",
           [](C c, int64_t layer, double sm_scale, T q, T o, T lse) -> void {
             c->CrossAttention(layer, sm_scale, q, o, lse);
           })
      .def("pagedkv.merge_attn_output_inplace",
           [](C c, T o_a, T lse_a, T o_b, T lse_b) -> ffi::Array<T> {
             c->MergeAttnOutputInplace(o_a, lse_a, o_b, lse_b);
             return ffi::Array<T>{o_a, lse_a};
           })
      // Returns the cache, so a Relax model orders its attention calls after the append by data flow.
      .def("pagedkv.append_mla_kv",
           [](C c, int64_t layer, T kv) -> C {
             c->AppendMLAKV(layer, kv);
             return c;
           })
      .def("pagedkv.get_query_positions", [](C c) -> T { return c->GetQueryPositions(); })
      .def("pagedkv.debug_get_kv",
           [](C c, int64_t id, int64_t start, int64_t end, T k_out, T v_out) -> void {
             c->DebugGetKV(id, start, end, k_out, v_out);
           })
      .def("pagedkv.debug_set_kv",
           [](C c, int64_t id, int64_t start, T k, T v) -> void { c->DebugSetKV(id, start, k, v); })
      .def("pagedkv.debug_get_mla_kv",
           [](C c, int64_t id, int64_t start, int64_t end, T kv_out) -> void {
             c->DebugGetMLAKV(id, start, end, kv_out);
           })
      .def("pagedkv.debug_set_mla_kv",
           [](C c, int64_t id, int64_t start, T kv) -> void { c->DebugSetMLAKV(id, start, kv); })
      .def("pagedkv.debug_poison_pages", [](C c, bool on) -> void { c->DebugPoisonPages(on); })
      .def("pagedkv.config_json", [](C c) -> ffi::String { return ffi::String(c->ConfigJSON()); })
      .def("pagedkv.op_backends", [](C c) -> ffi::Map<ffi::String, ffi::String> { return c->OpBackends(); });
}

}  // namespace pagedkv
