// Config parsing: by field name, strict (unknown fields and newer schemas are errors that name them) so a
// library and a runtime that disagree fail at `pagedkv.create`, not with wrong results later.
#include "config.h"

#include <tvm/ffi/container/map.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/json.h>

#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "config_fields.h"

namespace pagedkv {
namespace {

namespace ffi = tvm::ffi;
using config_fields::AddFp8JSON;
using config_fields::FieldMap;
using config_fields::FloatJSON;
using config_fields::GetBool;
using config_fields::GetFloat;
using config_fields::GetInt;
using config_fields::GetString;
using config_fields::GetStringList;
using config_fields::LayerGroupsJSON;
using config_fields::ReadFp8;
using config_fields::ReadLayerGroups;
using config_fields::ToFieldMap;
using config_fields::ValidateFp8;
using config_fields::ValidateLayerGroups;

// Schema-1 fields. A new schema may only add fields (each with a default keeping the old behaviour).
const std::set<std::string> kSchema1Fields = {
    "schema_version", "num_layers",     "num_qo_heads",      "num_kv_heads",       "head_dim",
    "v_head_dim",     "dtype",          "rope_mode",         "rope_theta",         "rope_scale",
    "page_size",      "max_batch_size", "max_total_seq_len", "prefill_chunk_size", "layer_kinds",
    "runtime_fields"};
// Added by schema 2 (MLA).
const std::set<std::string> kSchema2Fields = {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"};
// Added by schema 3 (attention options).
const std::set<std::string> kSchema3Fields = {"sliding_window", "logits_soft_cap"};
// Added by schema 4 (CUDA-graph decode).
const std::set<std::string> kSchema4Fields = {"cuda_graph_batch"};
// Added by schema 5 (attention sinks).
const std::set<std::string> kSchema5Fields = {"attention_sinks", "sink_size"};
// Added by schema 6 (RoPE variants): one object of RopeSpec's fields.
const std::set<std::string> kSchema6Fields = {"rope"};
// Added by schema kFp8Schema (FP8 KV cache).
const std::set<std::string> kSchemaFp8Fields = {"kv_dtype", "k_scale", "v_scale", "ckv_scale", "kpe_scale"};
// Added by schema 7 (layer groups): a list of objects {name, layers, sliding_window}.
const std::set<std::string> kSchema7Fields = {"layer_groups"};
const std::set<std::string> kRopeTypes = {"default", "linear", "llama3", "yarn", "longrope"};
const std::set<std::string> kRuntimeFields = {"max_batch_size", "max_total_seq_len",
                                              "prefill_chunk_size", "page_size"};
const std::set<std::string> kDTypes = {"float16", "float32", "bfloat16"};
const std::set<std::string> kRopeModes = {"none", "normal", "inline"};
const std::set<std::string> kLayerKinds = {"mha", "mla"};

FieldMap ReadFields(const std::string& json) {
  ffi::String error;
  ffi::Any root = ffi::json::Parse(json, &error);
  if (!error.empty()) TVM_FFI_THROW(ValueError) << "pagedkv config: invalid JSON: " << error;
  auto obj = root.as<ffi::Map<ffi::Any, ffi::Any>>();
  if (!obj.has_value()) TVM_FFI_THROW(ValueError) << "pagedkv config: expected a JSON object";
  return ToFieldMap(&*obj);
}

// Moves the values of "runtime_fields" (given in `values`, in order) into `fields`.
void ApplyRuntimeFields(FieldMap* fields, const ffi::Shape& values) {
  std::vector<std::string> names = GetStringList(*fields, "runtime_fields");
  if (names.size() != values.size()) {
    std::ostringstream listed;
    for (const auto& name : names) listed << " " << name;
    TVM_FFI_THROW(ValueError) << "pagedkv config: runtime_values has " << values.size()
                              << " values for the " << names.size() << " runtime_fields:" << listed.str();
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (!kRuntimeFields.count(names[i])) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: '" << names[i] << "' cannot be a runtime field";
    }
    if (fields->count(names[i])) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: field '" << names[i]
                                << "' is given both in the JSON and in runtime_fields";
    }
    (*fields)[names[i]] = ffi::Any(values[i]);
  }
}

// Schema 6's "rope" object: the runtime reads the type and the parameters it acts on (KVConfig), and keeps the
// object to write it back; the frequencies are the kernels' (Python validates every field before compiling them).
void ReadRope(const FieldMap& f, KVConfig* c) {
  auto it = f.find("rope");
  if (it == f.end()) return;
  auto obj = it->second.as<ffi::Map<ffi::Any, ffi::Any>>();
  if (!obj.has_value()) TVM_FFI_THROW(ValueError) << "pagedkv config: field 'rope' must be an object";
  FieldMap r = ToFieldMap(&*obj);
  c->rope_json = std::string(ffi::json::Stringify(it->second));
  c->rope_type = GetString(r, "rope_type", "default", kRopeTypes);
  c->rotary_dim = GetInt(r, "rotary_dim", 0, false);
  if (c->rotary_dim < 0 || c->rotary_dim % 2 != 0 || c->rotary_dim > c->head_dim) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: rope rotary_dim must be even and in [0, head_dim " << c->head_dim
                              << "], got " << c->rotary_dim;
  }
  if (c->rope_type == "linear") {
    c->rope_linear_factor = GetFloat(r, "factor", 0.0);
    if (!std::isfinite(c->rope_linear_factor) || c->rope_linear_factor <= 0) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: rope_type 'linear' needs a factor > 0, got "
                                << c->rope_linear_factor;
    }
  }
  if (c->rope_type == "longrope") {
    c->rope_long_after = GetInt(r, "original_max_position_embeddings", 0, /*required=*/true);
    if (c->rope_long_after < 1) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: rope original_max_position_embeddings must be >= 1";
    }
    if (c->cuda_graph_batch > 0) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: rope_type 'longrope' with cuda_graph_batch is not supported (its "
                                << "short / long switch is a per-forward kernel argument a captured graph freezes)";
    }
  }
}


void ValidateMLA(const KVConfig& c) {
  const std::pair<const char*, int64_t> dims[] = {{"kv_lora_rank", c.kv_lora_rank},
                                                  {"qk_nope_head_dim", c.qk_nope_head_dim},
                                                  {"qk_rope_head_dim", c.qk_rope_head_dim}};
  for (const auto& [name, value] : dims) {
    if (!c.is_mla() && value != 0) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: " << name << " needs MLA layers (layer_kinds 'mla')";
    }
    if (c.is_mla() && value < 1) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: MLA needs " << name << " >= 1, got " << value;
    }
  }
  if (!c.is_mla()) return;
  if (c.head_dim != c.qk_nope_head_dim + c.qk_rope_head_dim) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: MLA head_dim (" << c.head_dim
                              << ") must be qk_nope_head_dim + qk_rope_head_dim";
  }
  if (c.num_kv_heads != c.num_qo_heads) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: MLA num_kv_heads (" << c.num_kv_heads
                              << ") must equal num_qo_heads (" << c.num_qo_heads << ")";
  }
  if (c.rope_mode != "none") {
    TVM_FFI_THROW(ValueError) << "pagedkv config: MLA needs rope_mode 'none' (the model rotates the rope part)";
  }
}

// StreamingLLM sink tokens are read by the window kernels in passes of their own (forward_plan.h), each of whose
// keys lies inside one window: so sink_size <= sliding_window, and a window at all. With layer groups every sliding
// group keeps them (window_pools.h), so the smallest group window bounds them; full groups see every token anyway.
void ValidateSinkTokens(const KVConfig& c) {
  if (c.sink_size < 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: sink_size must be >= 0 (0: off), got " << c.sink_size;
  }
  if (c.sink_size == 0) return;
  int64_t window = c.sliding_window;
  for (const LayerGroup& g : c.layer_groups) {
    if (g.sliding_window > 0 && (window == 0 || g.sliding_window < window)) window = g.sliding_window;
  }
  if (window == 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: sink_size " << c.sink_size << " needs a sliding_window (sink tokens "
                              << "stay visible beside the window; without one every token is)";
  }
  if (c.sink_size > window) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: sink_size " << c.sink_size << " must be <= sliding_window " << window
                              << (c.has_groups() ? " (the smallest of the layer groups')" : "");
  }
  if (c.cuda_graph()) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: sink_size with cuda_graph_batch is not implemented (a CUDA-graph "
                              << "decode's fixed layout holds one pass; sink tokens add one)";
  }
}

void ValidateOptions(const KVConfig& c) {
  if (c.sliding_window < 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: sliding_window must be >= 0 (0: off), got " << c.sliding_window;
  }
  if (!std::isfinite(c.logits_soft_cap) || c.logits_soft_cap < 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: logits_soft_cap must be a finite number >= 0 (0: off), got "
                              << c.logits_soft_cap;
  }
  if (c.is_mla() && (c.sliding_window != 0 || c.logits_soft_cap != 0)) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: MLA caches take no sliding_window or logits_soft_cap";
  }
  if (c.cuda_graph_batch < 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: cuda_graph_batch must be >= 0 (0: off), got " << c.cuda_graph_batch;
  }
  if (c.cuda_graph() && c.is_mla()) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: cuda_graph_batch is not supported for MLA caches yet (CUDA-graph "
                              << "decode is implemented for MHA layers only); compile the MLA model without graphs";
  }
  ValidateSinkTokens(c);
  if (c.cuda_graph() && c.max_batch_size > c.cuda_graph_batch) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: max_batch_size=" << c.max_batch_size
                              << " is larger than cuda_graph_batch=" << c.cuda_graph_batch
                              << " (the most sequences the library's CUDA-graph decode step was compiled for)";
  }
}

// RoPE's base and position multiplier enter every rotation angle (pos * rope_scale / rope_theta^(2i/D)): a
// NaN, infinite, zero or negative value gives NaN or meaningless angles in every layer without an error, so
// they are rejected whatever the rope_mode (a config is checked as a whole, not only its live fields).
void ValidateRope(const KVConfig& c) {
  const std::pair<const char*, double> positive[] = {{"rope_theta", c.rope_theta}, {"rope_scale", c.rope_scale}};
  for (const auto& [name, value] : positive) {
    if (!std::isfinite(value) || value <= 0) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: " << name << " must be a finite number > 0, got " << value;
    }
  }
}

void Validate(const KVConfig& c) {
  const std::pair<const char*, int64_t> positive[] = {
      {"num_layers", c.num_layers},         {"num_qo_heads", c.num_qo_heads},
      {"num_kv_heads", c.num_kv_heads},     {"head_dim", c.head_dim},
      {"v_head_dim", c.v_head_dim},         {"page_size", c.page_size},
      {"max_batch_size", c.max_batch_size}, {"max_total_seq_len", c.max_total_seq_len},
      {"prefill_chunk_size", c.prefill_chunk_size}};
  for (const auto& [name, value] : positive) {
    if (value < 1) TVM_FFI_THROW(ValueError) << "pagedkv config: " << name << " must be >= 1, got " << value;
  }
  if (c.num_qo_heads % c.num_kv_heads != 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: num_qo_heads (" << c.num_qo_heads
                              << ") is not a multiple of num_kv_heads (" << c.num_kv_heads << ")";
  }
  if (c.v_head_dim != c.head_dim && !c.is_mla()) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: v_head_dim " << c.v_head_dim << " != head_dim "
                              << c.head_dim << " needs MLA layers";
  }
  if (c.rope_mode != "none" && c.head_dim % 2 != 0 && c.rotary_dim == 0) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: RoPE (rope_mode '" << c.rope_mode
                              << "') rotates the two halves of a head and needs an even head_dim, got "
                              << c.head_dim << "; an odd head_dim takes rope_mode 'none'";
  }
  if (static_cast<int64_t>(c.layer_kinds.size()) != c.num_layers) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: layer_kinds has " << c.layer_kinds.size()
                              << " entries for " << c.num_layers << " layers";
  }
  for (const auto& kind : c.layer_kinds) {
    if (!kLayerKinds.count(kind)) TVM_FFI_THROW(ValueError) << "pagedkv config: unknown layer kind '" << kind << "'";
    if (kind != c.layer_kinds[0]) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: a cache holds one layer kind, got both '" << c.layer_kinds[0]
                                << "' and '" << kind << "' in layer_kinds";
    }
  }
  ValidateRope(c);
  ValidateMLA(c);
  ValidateOptions(c);
}

}  // namespace

DLDataType KVConfig::dl_dtype() const {
  if (dtype == "float32") return DLDataType{kDLFloat, 32, 1};
  if (dtype == "bfloat16") return DLDataType{kDLBfloat, 16, 1};
  return DLDataType{kDLFloat, 16, 1};
}

KVConfig ParseConfig(const std::string& json, const ffi::Shape& runtime_values) {
  FieldMap f = ReadFields(json);
  KVConfig c;
  c.schema_version = GetInt(f, "schema_version", 0, /*required=*/true);
  if (c.schema_version > kSchemaVersion || c.schema_version < 1) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: schema_version " << c.schema_version
                              << " is not supported; this runtime knows schema versions 1.." << kSchemaVersion;
  }
  for (const auto& kv : f) {
    if (!kSchema1Fields.count(kv.first) && !(c.schema_version >= 2 && kSchema2Fields.count(kv.first)) &&
        !(c.schema_version >= 3 && kSchema3Fields.count(kv.first)) &&
        !(c.schema_version >= 4 && kSchema4Fields.count(kv.first)) &&
        !(c.schema_version >= 5 && kSchema5Fields.count(kv.first)) &&
        !(c.schema_version >= 6 && kSchema6Fields.count(kv.first)) &&
        !(c.schema_version >= kFp8Schema && kSchemaFp8Fields.count(kv.first)) &&
        !(c.schema_version >= 7 && kSchema7Fields.count(kv.first))) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: unknown field '" << kv.first << "' for schema_version "
                                << c.schema_version;
    }
  }
  ApplyRuntimeFields(&f, runtime_values);
  c.num_layers = GetInt(f, "num_layers", 0, true);
  c.num_qo_heads = GetInt(f, "num_qo_heads", 0, true);
  c.num_kv_heads = GetInt(f, "num_kv_heads", 0, true);
  c.head_dim = GetInt(f, "head_dim", 0, true);
  c.v_head_dim = GetInt(f, "v_head_dim", c.head_dim, false);
  c.dtype = GetString(f, "dtype", "float16", kDTypes);
  c.rope_mode = GetString(f, "rope_mode", "normal", kRopeModes);
  c.rope_theta = GetFloat(f, "rope_theta", 10000.0);
  c.rope_scale = GetFloat(f, "rope_scale", 1.0);
  c.page_size = GetInt(f, "page_size", 16, false);
  c.max_batch_size = GetInt(f, "max_batch_size", 1, false);
  c.max_total_seq_len = GetInt(f, "max_total_seq_len", c.page_size, false);
  c.prefill_chunk_size = GetInt(f, "prefill_chunk_size", c.page_size, false);
  c.layer_kinds = GetStringList(f, "layer_kinds");
  if (!f.count("layer_kinds") && c.num_layers > 0) c.layer_kinds.assign(c.num_layers, "mha");
  c.kv_lora_rank = GetInt(f, "kv_lora_rank", 0, false);
  c.qk_nope_head_dim = GetInt(f, "qk_nope_head_dim", 0, false);
  c.qk_rope_head_dim = GetInt(f, "qk_rope_head_dim", 0, false);
  c.sliding_window = GetInt(f, "sliding_window", 0, false);
  c.logits_soft_cap = GetFloat(f, "logits_soft_cap", 0.0);
  c.cuda_graph_batch = GetInt(f, "cuda_graph_batch", 0, false);
  c.attention_sinks = GetBool(f, "attention_sinks", false);
  c.sink_size = GetInt(f, "sink_size", 0, false);
  ReadRope(f, &c);
  ReadFp8(f, &c);
  ReadLayerGroups(f, &c);
  Validate(c);
  ValidateFp8(c);
  ValidateLayerGroups(&c);
  return c;
}

std::string ConfigToJSON(const KVConfig& c) {
  std::map<std::string, std::string> out;  // sorted keys, values already JSON
  auto str = [](const std::string& s) { return "\"" + s + "\""; };
  out["schema_version"] = std::to_string(c.schema_version);
  out["num_layers"] = std::to_string(c.num_layers);
  out["num_qo_heads"] = std::to_string(c.num_qo_heads);
  out["num_kv_heads"] = std::to_string(c.num_kv_heads);
  out["head_dim"] = std::to_string(c.head_dim);
  out["v_head_dim"] = std::to_string(c.v_head_dim);
  out["dtype"] = str(c.dtype);
  out["rope_mode"] = str(c.rope_mode);
  out["rope_theta"] = FloatJSON(c.rope_theta);
  out["rope_scale"] = FloatJSON(c.rope_scale);
  out["page_size"] = std::to_string(c.page_size);
  out["max_batch_size"] = std::to_string(c.max_batch_size);
  out["max_total_seq_len"] = std::to_string(c.max_total_seq_len);
  out["prefill_chunk_size"] = std::to_string(c.prefill_chunk_size);
  std::string kinds = "[";
  for (size_t i = 0; i < c.layer_kinds.size(); ++i) kinds += (i ? ", " : "") + str(c.layer_kinds[i]);
  out["layer_kinds"] = kinds + "]";
  out["runtime_fields"] = "[]";
  if (c.schema_version >= 2) {
    out["kv_lora_rank"] = std::to_string(c.kv_lora_rank);
    out["qk_nope_head_dim"] = std::to_string(c.qk_nope_head_dim);
    out["qk_rope_head_dim"] = std::to_string(c.qk_rope_head_dim);
  }
  if (c.schema_version >= 3) {
    out["sliding_window"] = std::to_string(c.sliding_window);
    out["logits_soft_cap"] = FloatJSON(c.logits_soft_cap);
  }
  if (c.schema_version >= 4) out["cuda_graph_batch"] = std::to_string(c.cuda_graph_batch);
  if (c.schema_version >= 5) {
    out["attention_sinks"] = c.attention_sinks ? "true" : "false";
    out["sink_size"] = std::to_string(c.sink_size);
  }
  if (c.schema_version >= 6) out["rope"] = c.rope_json.empty() ? "{\"rope_type\": \"default\"}" : c.rope_json;
  if (c.schema_version >= 7) out["layer_groups"] = LayerGroupsJSON(c);
  if (c.schema_version >= kFp8Schema) AddFp8JSON(c, &out);
  std::string json = "{";
  for (const auto& [k, v] : out) json += (json.size() > 1 ? ", " : "") + str(k) + ": " + v;
  return json + "}";
}

std::string DTypeName(DLDataType dtype) { return std::string(tvm::ffi::DLDataTypeToString(dtype)); }

}  // namespace pagedkv