#include "aux_builder.h"

#include <tvm/ffi/error.h>

#include <algorithm>
#include <cstring>

namespace pagedkv {

AuxBuilder::AuxBuilder(const TensorFns* fns, DLDevice device, int64_t capacity_elems)
    : fns_(fns), device_(device) {
  Reserve(capacity_elems);
}

void AuxBuilder::Reserve(int64_t elems) {
  if (elems <= capacity_) return;
  int64_t capacity = std::max(elems, capacity_ * 2);
  // Allocate both before replacing either, so a failure keeps the old buffers.
  ffi::Tensor host = fns_->Alloc({capacity}, kInt32, DLDevice{kDLCPU, 0});
  ffi::Tensor device = fns_->Alloc({capacity}, kInt32, device_);
  host_buf_ = host;
  dev_buf_ = device;
  capacity_ = capacity;
  Reset();
}

void AuxBuilder::Reset() {
  used_ = 0;
  upload_end_ = 0;
  arrays_.clear();
  views_.clear();
}

int AuxBuilder::Add(const std::vector<int32_t>& values, int64_t view_size) {
  int64_t size = static_cast<int64_t>(values.size());
  if (view_size < 0) view_size = size;
  TVM_FFI_ICHECK_GE(view_size, size) << "pagedkv: an aux array is longer than its view";
  TVM_FFI_ICHECK_LE(used_ + Padded(view_size), capacity_) << "pagedkv: aux buffer was not reserved";
  auto* base = reinterpret_cast<int32_t*>(static_cast<char*>(host_buf_.data_ptr()) + host_buf_.byte_offset());
  if (size > 0) std::memcpy(base + used_, values.data(), size * sizeof(int32_t));
  arrays_.emplace_back(used_, view_size);
  if (size > 0) upload_end_ = used_ + size;
  used_ += Padded(view_size);
  return static_cast<int>(arrays_.size() - 1);
}

void AuxBuilder::Upload() {
  views_.clear();
  if (upload_end_ > 0) {
    fns_->Copy(fns_->View(host_buf_, {upload_end_}, kInt32, 0), fns_->View(dev_buf_, {upload_end_}, kInt32, 0));
  }
  for (const auto& [offset, size] : arrays_) {
    views_.push_back(fns_->View(dev_buf_, {size}, kInt32, static_cast<uint64_t>(offset) * sizeof(int32_t)));
  }
}

}  // namespace pagedkv
