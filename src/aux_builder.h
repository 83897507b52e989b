// AuxBuilder: stages the int32 index arrays of one forward in one host buffer, copies them to the device
// with one copy, and hands out a device view per array. Each array starts at a 16-byte aligned offset
// (kernels may vectorize loads; views carry the offset as byte_offset / elem_offset).
#ifndef PAGEDKV_AUX_BUILDER_H_
#define PAGEDKV_AUX_BUILDER_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "tensor_util.h"

namespace pagedkv {

class AuxBuilder {
 public:
  AuxBuilder(const TensorFns* fns, DLDevice device, int64_t capacity_elems);

  // Elements an array of n int32 values occupies (padded to 16 bytes).
  static int64_t Padded(int64_t n) { return (n + 3) / 4 * 4; }
  // Makes room for `elems` staged elements (reallocating both buffers when needed). Call it before the
  // cache mutates anything, so an allocation failure leaves the cache unchanged.
  void Reserve(int64_t elems);
  void Reset();
  // Stages `values`; returns the handle of its view. `view_size` (>= values.size(), default: the size) is
  // the view's length and the room the array takes: a layout whose views depend on sizes only (CUDA-graph
  // decode) reserves the most an array can hold. Elements past the values are not uploaded.
  int Add(const std::vector<int32_t>& values, int64_t view_size = -1);
  // Copies everything staged to the device at once and creates the views.
  void Upload();
  const ffi::Tensor& View(int handle) const { return views_.at(handle); }

 private:
  const TensorFns* fns_;
  DLDevice device_;
  int64_t capacity_ = 0;
  int64_t used_ = 0;
  int64_t upload_end_ = 0;  // end of the last staged value: Upload copies [0, upload_end_)
  ffi::Tensor host_buf_;  // on the CPU: written directly
  ffi::Tensor dev_buf_;  // on the cache's device
  std::vector<std::pair<int64_t, int64_t>> arrays_;  // (offset, view size) in elements
  std::vector<ffi::Tensor> views_;
};

}  // namespace pagedkv

#endif  // PAGEDKV_AUX_BUILDER_H_
