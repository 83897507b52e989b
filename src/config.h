// KVConfig: the cache configuration, read by field name from the versioned JSON that
// python/pagedkv/config.py writes (docs/ARCHITECTURE.md, "Config schema and versioning rule").
#ifndef PAGEDKV_CONFIG_H_
#define PAGEDKV_CONFIG_H_

#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/dtype.h>

#include <cstdint>
#include <string>
#include <vector>

namespace pagedkv {

// The newest config schema this runtime understands; newer libraries are rejected by name.
// Schema 2 added MLA layers: layer kind "mla" and kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim.
// Schema 3 added the attention options sliding_window and logits_soft_cap (0: off).
// Schema 4 added cuda_graph_batch (0: off): decode forwards laid out for CUDA-graph replay.
// Schema 5 added attention_sinks (false: off): learnable per-head attention sinks (attention.cc), and sink_size (0:
// off): StreamingLLM sink tokens beside a sliding window (forward_plan.h).
// Schema 6 added rope (absent: plain RoPE): the RoPE variant (python/pagedkv/rope_spec.py, RopeSpec), an object.
// Schema 7 added layer_groups (absent or empty: every layer alike): per-layer windows in one cache, each sliding
// group with window-sized memory in a page pool of its own (window_pools.h).

// Schema 7: layers that attend alike. sliding_window 0: full attention.
struct LayerGroup {
  std::string name;
  std::vector<int64_t> layers;
  int64_t sliding_window = 0;
};
// Schema kFp8Schema added the FP8 KV cache: kv_dtype (absent: dtype; "float8_e4m3fn": e4m3 bytes in the pages), k_scale
// and v_scale (MHA; a number or one per kv head), ckv_scale and kpe_scale (MLA). The kernels hold the scales (compiled
// in); the runtime checks them and sizes the pages by kv_dtype. One constant, renumbered when other schemas land.
inline constexpr int64_t kFp8Schema = 8;
inline constexpr int64_t kSchemaVersion = kFp8Schema;

struct KVConfig {
  int64_t schema_version = kSchemaVersion;
  int64_t num_layers = 0;
  int64_t num_qo_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t v_head_dim = 0;
  std::string dtype = "float16";
  std::string rope_mode = "normal";
  double rope_theta = 10000.0;
  double rope_scale = 1.0;
  int64_t page_size = 16;
  int64_t max_batch_size = 1;
  int64_t max_total_seq_len = 0;   // default: page_size
  int64_t prefill_chunk_size = 0;  // default: page_size
  std::vector<std::string> layer_kinds;
  int64_t kv_lora_rank = 0;      // MLA (schema 2); 0 for MHA
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t sliding_window = 0;    // schema 3; 0: off. Queries see keys with q_pos - k_pos < sliding_window.
  double logits_soft_cap = 0.0;  // schema 3; 0: off. Scores s become cap * tanh(s / cap).
  // schema 4; 0: off. Else the library's decode step runs in CUDA graphs for up to this many sequences, so
  // every decode forward keeps its index arrays at fixed device addresses with shapes that depend on the
  // batch size only (forward.cc, "CUDA-graph decode"), and max_batch_size may not exceed it.
  int64_t cuda_graph_batch = 0;
  // schema 5; false: off. Else the attention calls may take sinks[num_qo_heads] (float32): one more softmax logit
  // per query head whose value is 0, merged once into each call's final state by the sink ops (the op table
  // holds apply_sinks, and merge_state_partial_sinks beside the partial-state ops).
  bool attention_sinks = false;
  // schema 5; 0: off. StreamingLLM sink tokens: with a sliding window (sink_size <= sliding_window), every query
  // also sees the first sink_size tokens of its sequence; read by extra passes over each chain's first pages
  // (forward_plan.h), with the window kernels unchanged.
  int64_t sink_size = 0;
  // schema 6; "" (plain RoPE): the "rope" object as JSON (RopeSpec's fields), written back by ConfigToJSON. The
  // kernels hold a variant's frequencies (compile-time tables); the runtime acts on two of its parameters only:
  std::string rope_json;
  std::string rope_type = "default";
  // "linear": the plain kernels serve it with rope_scale / factor as their rope_scale argument (rope_scale_arg).
  double rope_linear_factor = 1.0;
  // "longrope": a forward whose longest sequence (largest query position + 1) exceeds this rotates with the long
  // factors, apply_rope = 2 (as transformers switches per call); 0: no switch.
  int64_t rope_long_after = 0;
  int64_t rotary_dim = 0;  // 0: the whole head
  // schema 7; empty: every layer alike (sliding_window). Else each layer in exactly one group.
  std::vector<LayerGroup> layer_groups;
  // Per layer: 0 (a full layer, or a cache without groups), or 1 + the index in group_windows of its window.
  std::vector<int> layer_pool;
  // The distinct sliding windows > 0 of layer_groups, ascending: window pool i serves group_windows[i].
  std::vector<int64_t> group_windows;
  // schema kFp8Schema; "" : the pages hold dtype. "float8_e4m3fn": the pages hold e4m3 bytes (uint8 tensors), q / k / v
  // / o keep dtype. Scales: one value (per tensor) or one per kv head; 1 without FP8 pages (Validate checks it).
  std::string kv_dtype;
  std::vector<double> k_scale{1.0};
  std::vector<double> v_scale{1.0};
  double ckv_scale = 1.0;
  double kpe_scale = 1.0;

  DLDataType dl_dtype() const;
  // The dtype of the page tensors: dl_dtype(), or uint8 for FP8 pages (the kernels decode the bits themselves).
  DLDataType page_dl_dtype() const;
  bool fp8() const { return !kv_dtype.empty(); }
  // The rope_scale argument of the kernels (the config's, divided by a "linear" variant's factor).
  double rope_scale_arg() const { return rope_scale / rope_linear_factor; }
  // A windowed cache attends each sequence's whole chain in one causal pass (forward_plan.h).
  bool windowed() const { return sliding_window > 0; }
  bool has_groups() const { return !layer_groups.empty(); }
  // The page pool of a layer (0: the main pool) and the window its kernels apply (0: none, or the config's).
  int pool_of(int64_t layer) const { return layer_pool.empty() ? 0 : layer_pool[layer]; }
  int64_t pool_window(int pool) const { return pool == 0 ? sliding_window : group_windows[pool - 1]; }
  // "'a', 'b'": the names of the groups whose layers use window pool `pool` (>= 1), for errors.
  std::string PoolGroupNames(int pool) const;
  bool cuda_graph() const { return cuda_graph_batch > 0; }
  // Every layer is MLA (a cache holds one layer kind).
  bool is_mla() const { return !layer_kinds.empty() && layer_kinds[0] == "mla"; }
  const std::string& layer_kind() const { return layer_kinds[0]; }
  // Elements per token of an MLA page (the latent: kv_lora_rank + qk_rope_head_dim).
  int64_t latent_dim() const { return kv_lora_rank + qk_rope_head_dim; }
  // Pages in the pool: every token of max_total_seq_len plus one partial page per sequence.
  // (Written so that it cannot overflow before pagedkv.create has checked the sizes.)
  int64_t num_pages() const { return (max_total_seq_len - 1) / page_size + 1 + max_batch_size; }
};

// Parses and validates `json`; `runtime_values` gives, in order, the fields listed in "runtime_fields".
// Throws ValueError naming the offending field (unknown field, wrong type, bad value, newer schema).
KVConfig ParseConfig(const std::string& json, const tvm::ffi::Shape& runtime_values);

// The effective config (runtime fields resolved, "runtime_fields" empty) as JSON with sorted keys.
std::string ConfigToJSON(const KVConfig& config);

// "float16" etc. for a DLDataType, for error messages.
std::string DTypeName(DLDataType dtype);

}  // namespace pagedkv

#endif  // PAGEDKV_CONFIG_H_
