// The config's field readers (config_fields.h): the typed getters every JSON field goes through, and the schema 7
// (layer groups) and schema kFp8Schema (FP8 KV cache) fields, read, checked and written back.
#include "config_fields.h"

#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/json.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <utility>

namespace pagedkv {
namespace config_fields {

namespace ffi = tvm::ffi;

namespace {

const std::set<std::string> kKVDTypes = {"float8_e4m3fn"};

// A scale field: one number (per tensor) or a list (per kv head; its length is checked by ValidateFp8).
std::vector<double> GetScales(const FieldMap& f, const std::string& name) {
  auto it = f.find(name);
  if (it == f.end()) return {1.0};
  if (auto arr = it->second.as<ffi::Array<ffi::Any>>()) {
    std::vector<double> out;
    for (const ffi::Any& item : *arr) {
      FieldMap one{{name, item}};
      out.push_back(GetFloat(one, name, 0.0));
    }
    return out;
  }
  return {GetFloat(f, name, 1.0)};
}

}  // namespace

FieldMap ToFieldMap(const ffi::Map<ffi::Any, ffi::Any>* obj) {
  FieldMap fields;
  for (const auto& kv : *obj) {
    auto key = kv.first.as<ffi::String>();
    if (!key.has_value()) TVM_FFI_THROW(ValueError) << "pagedkv config: non-string key";
    fields[std::string(*key)] = kv.second;
  }
  return fields;
}

int64_t GetInt(const FieldMap& f, const std::string& name, int64_t fallback, bool required) {
  auto it = f.find(name);
  if (it == f.end()) {
    if (required) TVM_FFI_THROW(ValueError) << "pagedkv config: missing required field '" << name << "'";
    return fallback;
  }
  auto v = it->second.as<int64_t>();
  if (!v.has_value()) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: field '" << name << "' must be an int, got "
                              << it->second.GetTypeKey();
  }
  return *v;
}

double GetFloat(const FieldMap& f, const std::string& name, double fallback) {
  auto it = f.find(name);
  if (it == f.end()) return fallback;
  if (auto v = it->second.as<double>()) return *v;
  if (auto v = it->second.as<int64_t>()) return static_cast<double>(*v);
  TVM_FFI_THROW(ValueError) << "pagedkv config: field '" << name << "' must be a number";
}

bool GetBool(const FieldMap& f, const std::string& name, bool fallback) {
  auto it = f.find(name);
  if (it == f.end()) return fallback;
  if (it->second.type_index() != ffi::TypeIndex::kTVMFFIBool) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: field '" << name << "' must be a bool, got "
                              << it->second.GetTypeKey();
  }
  return it->second.cast<bool>();
}

std::string GetString(const FieldMap& f, const std::string& name, const std::string& fallback,
                      const std::set<std::string>& allowed) {
  auto it = f.find(name);
  if (it == f.end()) return fallback;
  auto v = it->second.as<ffi::String>();
  if (!v.has_value()) TVM_FFI_THROW(ValueError) << "pagedkv config: field '" << name << "' must be a string";
  std::string s(*v);
  if (!allowed.count(s)) {
    std::ostringstream os;
    for (const auto& a : allowed) os << " " << a;
    TVM_FFI_THROW(ValueError) << "pagedkv config: " << name << " '" << s << "' is not one of:" << os.str();
  }
  return s;
}

std::vector<std::string> GetStringList(const FieldMap& f, const std::string& name) {
  std::vector<std::string> out;
  auto it = f.find(name);
  if (it == f.end()) return out;
  auto arr = it->second.as<ffi::Array<ffi::Any>>();
  if (!arr.has_value()) TVM_FFI_THROW(ValueError) << "pagedkv config: field '" << name << "' must be a list";
  for (const ffi::Any& item : *arr) {
    auto s = item.as<ffi::String>();
    if (!s.has_value()) TVM_FFI_THROW(ValueError) << "pagedkv config: '" << name << "' must hold strings";
    out.emplace_back(*s);
  }
  return out;
}

// Writes a double so that it reads back as a JSON float (always with '.' or an exponent).
std::string FloatJSON(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  std::string s(buf);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

// Schema kFp8Schema: kv_dtype equal to dtype is stored as "" (the pages hold dtype).
void ReadFp8(const FieldMap& f, KVConfig* c) {
  std::set<std::string> kv_dtypes = kKVDTypes;
  kv_dtypes.insert(c->dtype);
  c->kv_dtype = GetString(f, "kv_dtype", c->dtype, kv_dtypes);
  if (c->kv_dtype == c->dtype) c->kv_dtype.clear();
  c->k_scale = GetScales(f, "k_scale");
  c->v_scale = GetScales(f, "v_scale");
  c->ckv_scale = GetFloat(f, "ckv_scale", 1.0);
  c->kpe_scale = GetFloat(f, "kpe_scale", 1.0);
}

// Scales finite and > 0, of the right length, and only where FP8 pages and the layer kind apply them: a scale the
// kernels would not apply is an error, never ignored.
void ValidateFp8(const KVConfig& c) {
  const std::pair<const char*, const std::vector<double>*> lists[] = {{"k_scale", &c.k_scale}, {"v_scale", &c.v_scale}};
  bool scaled = c.ckv_scale != 1.0 || c.kpe_scale != 1.0;
  for (const auto& [name, values] : lists) {
    if (values->size() != 1 && static_cast<int64_t>(values->size()) != c.num_kv_heads) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: " << name << " has " << values->size()
                                << " values; it takes one (per tensor) or num_kv_heads (" << c.num_kv_heads << ")";
    }
    for (double v : *values) {
      if (!std::isfinite(v) || v <= 0) {
        TVM_FFI_THROW(ValueError) << "pagedkv config: " << name << " must hold finite numbers > 0, got " << v;
      }
      scaled = scaled || v != 1.0;
      if (v != 1.0 && c.is_mla()) {
        TVM_FFI_THROW(ValueError) << "pagedkv config: " << name << " does not apply to MLA layers (ckv_scale, kpe_scale)";
      }
    }
  }
  for (const auto& [name, v] : {std::pair<const char*, double>{"ckv_scale", c.ckv_scale}, {"kpe_scale", c.kpe_scale}}) {
    if (!std::isfinite(v) || v <= 0) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: " << name << " must be a finite number > 0, got " << v;
    }
    if (v != 1.0 && !c.is_mla()) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: " << name << " does not apply to MHA layers (k_scale, v_scale)";
    }
  }
  if (scaled && !c.fp8()) {
    TVM_FFI_THROW(ValueError) << "pagedkv config: FP8 scales need kv_dtype 'float8_e4m3fn' (the pages hold " << c.dtype
                              << ", so they would be ignored)";
  }
}

// Schema kFp8Schema's fields into ConfigToJSON's `out` (sorted keys, values already JSON); kv_dtype is written
// as dtype when the pages hold dtype.
void AddFp8JSON(const KVConfig& c, std::map<std::string, std::string>* out) {
  auto str = [](const std::string& s) { return "\"" + s + "\""; };
  auto scales = [](const std::vector<double>& v) {
    if (v.size() == 1) return FloatJSON(v[0]);
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + FloatJSON(v[i]);
    return s + "]";
  };
  (*out)["kv_dtype"] = str(c.fp8() ? c.kv_dtype : c.dtype);
  (*out)["k_scale"] = scales(c.k_scale);
  (*out)["v_scale"] = scales(c.v_scale);
  (*out)["ckv_scale"] = FloatJSON(c.ckv_scale);
  (*out)["kpe_scale"] = FloatJSON(c.kpe_scale);
}

// Schema 7's "layer_groups": each an object of name, layers (ints) and sliding_window (int, default 0).
void ReadLayerGroups(const FieldMap& f, KVConfig* c) {
  auto it = f.find("layer_groups");
  if (it == f.end()) return;
  auto arr = it->second.as<ffi::Array<ffi::Any>>();
  if (!arr.has_value()) TVM_FFI_THROW(ValueError) << "pagedkv config: field 'layer_groups' must be a list";
  for (const ffi::Any& item : *arr) {
    auto obj = item.as<ffi::Map<ffi::Any, ffi::Any>>();
    if (!obj.has_value()) TVM_FFI_THROW(ValueError) << "pagedkv config: each of 'layer_groups' must be an object";
    FieldMap g = ToFieldMap(&*obj);
    for (const auto& kv : g) {
      if (kv.first != "name" && kv.first != "layers" && kv.first != "sliding_window") {
        TVM_FFI_THROW(ValueError) << "pagedkv config: unknown layer group field '" << kv.first << "'";
      }
    }
    LayerGroup group;
    auto name = g.count("name") ? g.at("name").as<ffi::String>() : std::nullopt;
    if (!name.has_value() || name->empty()) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: each layer group needs a non-empty string 'name'";
    }
    group.name = std::string(*name);
    group.sliding_window = GetInt(g, "sliding_window", 0, false);
    auto layers = g.count("layers") ? g.at("layers").as<ffi::Array<ffi::Any>>() : std::nullopt;
    if (!layers.has_value()) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: layer group '" << group.name << "' needs a list 'layers'";
    }
    for (const ffi::Any& layer : *layers) {
      auto v = layer.as<int64_t>();
      if (!v.has_value()) {
        TVM_FFI_THROW(ValueError) << "pagedkv config: layer group '" << group.name << "' layers must be ints";
      }
      group.layers.push_back(*v);
    }
    c->layer_groups.push_back(std::move(group));
  }
}

// Each layer in exactly one group, names unique, windows >= 0, and none of the options planned for one window
// (python/pagedkv/config.py says the same); then the per-layer pool map.
void ValidateLayerGroups(KVConfig* c) {
  if (c->layer_groups.empty()) return;
  std::vector<std::string> owner(static_cast<size_t>(c->num_layers));
  std::set<std::string> names;
  std::set<int64_t> windows;
  for (const LayerGroup& g : c->layer_groups) {
    if (!names.insert(g.name).second) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: layer group name '" << g.name << "' is given twice";
    }
    if (g.sliding_window < 0) {
      TVM_FFI_THROW(ValueError) << "pagedkv config: layer group '" << g.name << "': sliding_window must be >= 0 "
                                << "(0: full attention), got " << g.sliding_window;
    }
    if (g.sliding_window > 0) windows.insert(g.sliding_window);
    for (int64_t layer : g.layers) {
      if (layer < 0 || layer >= c->num_layers) {
        TVM_FFI_THROW(ValueError) << "pagedkv config: layer group '" << g.name << "' names layer " << layer
                                  << ", outside [0, " << c->num_layers << ")";
      }
      if (!owner[layer].empty()) {
        TVM_FFI_THROW(ValueError) << "pagedkv config: layer " << layer << " is in two layer groups ('" << owner[layer]
                                  << "' and '" << g.name << "')";
      }
      owner[layer] = g.name;
    }
  }
  for (int64_t l = 0; l < c->num_layers; ++l) {
    if (owner[l].empty()) TVM_FFI_THROW(ValueError) << "pagedkv config: layer " << l << " is in no layer group";
  }
  const std::pair<bool, const char*> refused[] = {
      {c->sliding_window != 0, "the top-level sliding_window (each group's sliding_window says it)"},
      {c->cuda_graph(), "cuda_graph_batch (not implemented with layer groups yet)"},
      {c->is_mla(), "MLA layers (they take no window)"}};
  for (const auto& [bad, what] : refused) {
    if (bad) TVM_FFI_THROW(ValueError) << "pagedkv config: layer_groups with " << what;
  }
  c->group_windows.assign(windows.begin(), windows.end());
  c->layer_pool.assign(static_cast<size_t>(c->num_layers), 0);
  for (const LayerGroup& g : c->layer_groups) {
    if (g.sliding_window == 0) continue;
    int pool = 1 + static_cast<int>(std::lower_bound(c->group_windows.begin(), c->group_windows.end(),
                                                     g.sliding_window) - c->group_windows.begin());
    for (int64_t layer : g.layers) c->layer_pool[layer] = pool;
  }
}

std::string LayerGroupsJSON(const KVConfig& c) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < c.layer_groups.size(); ++i) {
    const LayerGroup& g = c.layer_groups[i];
    os << (i ? ", " : "") << "{\"layers\": [";
    for (size_t j = 0; j < g.layers.size(); ++j) os << (j ? ", " : "") << g.layers[j];
    os << "], \"name\": \"" << g.name << "\", \"sliding_window\": " << g.sliding_window << "}";
  }
  os << "]";
  return os.str();
}

}  // namespace config_fields

DLDataType KVConfig::page_dl_dtype() const {
  return fp8() ? DLDataType{kDLUInt, 8, 1} : dl_dtype();
}

std::string KVConfig::PoolGroupNames(int pool) const {
  std::string out;
  for (const LayerGroup& g : layer_groups) {
    if (pool >= 1 && g.sliding_window == group_windows[pool - 1]) out += (out.empty() ? "'" : ", '") + g.name + "'";
  }
  return out;
}

}  // namespace pagedkv
