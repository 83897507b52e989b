#include "tensor_util.h"

#include <tvm/ffi/error.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "config.h"

namespace pagedkv {
namespace {

ffi::Function Lookup(const char* name) {
  auto f = ffi::Function::GetGlobal(name);
  if (!f.has_value()) {
    TVM_FFI_THROW(RuntimeError) << "pagedkv: TVM runtime global '" << name
                                << "' is not registered; load TVM's runtime first (e.g. `import tvm`)";
  }
  return *f;
}

}  // namespace

std::string DeviceStr(DLDevice d) {
  std::ostringstream os;
  os << "device(" << d.device_type << ", " << d.device_id << ")";
  return os.str();
}

std::optional<int64_t> DeviceTotalMemory(DLDevice device) {
  constexpr int kTotalGlobalMemory = 14;  // TVM's DeviceAttrKind
  auto get_attr = ffi::Function::GetGlobal("runtime.GetDeviceAttr");
  if (!get_attr.has_value()) return std::nullopt;
  ffi::Any value;
  try {
    value = (*get_attr)(static_cast<int>(device.device_type), device.device_id, kTotalGlobalMemory);
  } catch (const ffi::Error&) {
    return std::nullopt;  // a device API without the attribute: only the allocation can tell
  }
  std::optional<int64_t> bytes = value.try_cast<int64_t>();
  if (!bytes.has_value() || *bytes <= 0) return std::nullopt;
  return bytes;
}

bool DeviceSupportsPDL(DLDevice device) {
  constexpr int kComputeVersion = 4;  // TVM's DeviceAttrKind: "major.minor"
  if (device.device_type != kDLCUDA) return false;
  auto get_attr = ffi::Function::GetGlobal("runtime.GetDeviceAttr");
  if (!get_attr.has_value()) return false;
  try {
    std::optional<ffi::String> v =
        (*get_attr)(static_cast<int>(device.device_type), device.device_id, kComputeVersion).try_cast<ffi::String>();
    return v.has_value() && std::atoi(std::string(*v).c_str()) >= 9;
  } catch (const ffi::Error&) {
    return false;
  }
}

TensorFns::TensorFns()
    : alloc_(Lookup("runtime.TVMTensorAllocWithScope")),
      copy_from_to_(Lookup("runtime.TVMTensorCopyFromTo")),
      copy_from_bytes_(Lookup("runtime.TVMTensorCopyFromBytes")),
      copy_to_bytes_(Lookup("runtime.TVMTensorCopyToBytes")),
      create_view_(Lookup("runtime.TVMTensorCreateView")) {}

ffi::Tensor TensorFns::Alloc(const std::vector<int64_t>& shape, DLDataType dtype, DLDevice device) const {
  return alloc_(ffi::Shape(shape), dtype, device, ffi::Optional<ffi::String>()).cast<ffi::Tensor>();
}

ffi::Tensor TensorFns::View(const ffi::Tensor& base, const std::vector<int64_t>& shape, DLDataType dtype,
                            uint64_t byte_offset) const {
  return create_view_(base, ffi::Shape(shape), dtype, byte_offset).cast<ffi::Tensor>();
}

void TensorFns::Copy(const ffi::Tensor& from, const ffi::Tensor& to) const { copy_from_to_(from, to); }

void TensorFns::CopyFromBytes(const ffi::Tensor& to, const void* data, size_t nbytes) const {
  copy_from_bytes_(to, const_cast<void*>(data), static_cast<int64_t>(nbytes));
}

void TensorFns::CopyToBytes(const ffi::Tensor& from, void* data, size_t nbytes) const {
  copy_to_bytes_(from, data, static_cast<int64_t>(nbytes));
}

std::string ShapeStr(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

void CheckDefined(const ffi::Tensor& t, const char* name) {
  if (!t.defined()) TVM_FFI_THROW(TypeError) << "pagedkv: tensor '" << name << "' is None; expected a tensor";
}

void CheckTensor(const ffi::Tensor& t, const char* name, const std::vector<int64_t>& shape,
                 DLDataType dtype, DLDevice device) {
  CheckDefined(t, name);
  std::vector<int64_t> given(t.shape().begin(), t.shape().end());
  bool ok = given == shape && t.dtype() == dtype && t.device().device_type == device.device_type &&
            t.device().device_id == device.device_id;
  if (!ok) {
    TVM_FFI_THROW(ValueError) << "pagedkv: tensor '" << name << "' expected " << ShapeStr(shape) << " "
                              << DTypeName(dtype) << " on " << DeviceStr(device) << ", given "
                              << ShapeStr(given) << " " << DTypeName(t.dtype()) << " on "
                              << DeviceStr(t.device());
  }
  if (!t.IsContiguous()) TVM_FFI_THROW(ValueError) << "pagedkv: tensor '" << name << "' must be contiguous";
}

size_t NumBytes(const std::vector<int64_t>& shape, DLDataType dtype) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n * ((dtype.bits * dtype.lanes + 7) / 8);
}

std::vector<uint8_t> NaNBytes(DLDataType dtype, size_t count) {
  size_t elem = (dtype.bits + 7) / 8;
  std::vector<uint8_t> out(count * elem);
  uint32_t f32 = 0x7FC00000u;
  uint16_t f16 = dtype.code == kDLBfloat ? 0x7FC0 : 0x7E00;
  // One byte an element: FP8 e4m3 pages (uint8 tensors), whose NaN is 0x7F.
  if (elem == 1) return std::vector<uint8_t>(count, 0x7F);
  for (size_t i = 0; i < count; ++i) {
    if (elem == 4) std::memcpy(out.data() + i * 4, &f32, 4);
    else std::memcpy(out.data() + i * 2, &f16, 2);
  }
  return out;
}

}  // namespace pagedkv
