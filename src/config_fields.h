// The config's field readers, shared by config.cc (ParseConfig, ConfigToJSON) and config_fields.cc: the typed
// getters every JSON field goes through, and the readers, validators and JSON writers of the schema 7 (layer
// groups) and schema kFp8Schema (FP8 KV cache) fields. Internal to the config parse; config.h is the interface.
#ifndef PAGEDKV_CONFIG_FIELDS_H_
#define PAGEDKV_CONFIG_FIELDS_H_

#include <tvm/ffi/any.h>
#include <tvm/ffi/container/map.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "config.h"

namespace pagedkv {
namespace config_fields {

// The config fields as JSON values by name; runtime fields are merged in as ints.
using FieldMap = std::map<std::string, tvm::ffi::Any>;

// Typed getters: a field absent takes `fallback` (or, if `required`, is an error); a field of the wrong type is a
// ValueError naming it.
FieldMap ToFieldMap(const tvm::ffi::Map<tvm::ffi::Any, tvm::ffi::Any>* obj);
int64_t GetInt(const FieldMap& f, const std::string& name, int64_t fallback, bool required);
double GetFloat(const FieldMap& f, const std::string& name, double fallback);
bool GetBool(const FieldMap& f, const std::string& name, bool fallback);
std::string GetString(const FieldMap& f, const std::string& name, const std::string& fallback,
                      const std::set<std::string>& allowed);
std::vector<std::string> GetStringList(const FieldMap& f, const std::string& name);

// Writes a double so that it reads back as a JSON float (always with '.' or an exponent).
std::string FloatJSON(double v);

// Schema kFp8Schema: kv_dtype and the scales (ReadFp8), checked once the rest of the config is (ValidateFp8), and
// written into ConfigToJSON's sorted `out` (AddFp8JSON).
void ReadFp8(const FieldMap& f, KVConfig* c);
void ValidateFp8(const KVConfig& c);
void AddFp8JSON(const KVConfig& c, std::map<std::string, std::string>* out);

// Schema 7: the layer groups (ReadLayerGroups), checked, with group_windows and layer_pool derived
// (ValidateLayerGroups), and written back as a JSON list (LayerGroupsJSON).
void ReadLayerGroups(const FieldMap& f, KVConfig* c);
void ValidateLayerGroups(KVConfig* c);
std::string LayerGroupsJSON(const KVConfig& c);

}  // namespace config_fields
}  // namespace pagedkv

#endif  // PAGEDKV_CONFIG_FIELDS_H_
