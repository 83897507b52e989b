// Device memory through TVM runtime globals looked up by name once (the runtime links tvm-ffi only: no TVM
// library symbol is called, only registered globals), plus argument checks that name the offending tensor.
#ifndef PAGEDKV_TENSOR_UTIL_H_
#define PAGEDKV_TENSOR_UTIL_H_

#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pagedkv {

namespace ffi = tvm::ffi;

class TensorFns {
 public:
  // Looks up runtime.TVMTensor{AllocWithScope,CopyFromTo,CopyFromBytes,CopyToBytes,CreateView}; throws
  // naming a missing one (TVM's runtime must be loaded, e.g. `import tvm`).
  TensorFns();
  ffi::Tensor Alloc(const std::vector<int64_t>& shape, DLDataType dtype, DLDevice device) const;
  // A view of `base` (contiguous) with `shape` starting `byte_offset` bytes after base's start.
  ffi::Tensor View(const ffi::Tensor& base, const std::vector<int64_t>& shape, DLDataType dtype,
                   uint64_t byte_offset) const;
  void Copy(const ffi::Tensor& from, const ffi::Tensor& to) const;
  void CopyFromBytes(const ffi::Tensor& to, const void* data, size_t nbytes) const;
  // Copies a contiguous tensor of any device to host memory; returns once the data is there.
  void CopyToBytes(const ffi::Tensor& from, void* data, size_t nbytes) const;

 private:
  ffi::Function alloc_, copy_from_to_, copy_from_bytes_, copy_to_bytes_, create_view_;
};

inline constexpr DLDataType kInt32 = {kDLInt, 32, 1};
inline constexpr DLDataType kFloat32 = {kDLFloat, 32, 1};

std::string ShapeStr(const std::vector<int64_t>& shape);
std::string DeviceStr(DLDevice device);
// The device's total memory in bytes as the TVM runtime reports it (runtime.GetDeviceAttr,
// kTotalGlobalMemory); nullopt when it does not.
std::optional<int64_t> DeviceTotalMemory(DLDevice device);
// Whether `device` is a CUDA device of compute capability 9.0 or newer (runtime.GetDeviceAttr's compute
// version), where kernels may be launched with programmatic dependent launch; false when it cannot tell.
bool DeviceSupportsPDL(DLDevice device);
// Throws TypeError naming `name` if `t` is undefined: None where a tensor was due (tvm-ffi's tensors are
// nullable, and TVM's `vm.builtin.*` wrappers pass None through).
void CheckDefined(const ffi::Tensor& t, const char* name);
// Throws ValueError naming `name` unless `t` is contiguous, on `device`, with `shape` and `dtype` (and
// TypeError, as CheckDefined, if it is undefined).
void CheckTensor(const ffi::Tensor& t, const char* name, const std::vector<int64_t>& shape,
                 DLDataType dtype, DLDevice device);
// Element count × element size.
size_t NumBytes(const std::vector<int64_t>& shape, DLDataType dtype);
// `count` elements of `dtype` all set to a quiet NaN (for poisoning).
std::vector<uint8_t> NaNBytes(DLDataType dtype, size_t count);

// Identity of a tensor view (data + byte offset): how an adapter's Run finds the pass begin_forward saw, by
// the index tensor it is given.
inline uint64_t ViewKey(tvm::ffi::AnyView v) {
  const DLTensor* d = v.cast<DLTensor*>();
  return reinterpret_cast<uint64_t>(d->data) + d->byte_offset;
}
inline uint64_t ViewKey(const tvm::ffi::Tensor& t) { return ViewKey(tvm::ffi::AnyView(t)); }

}  // namespace pagedkv

#endif  // PAGEDKV_TENSOR_UTIL_H_
