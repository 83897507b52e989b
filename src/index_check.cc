// PagedKVCache::CheckIndices (`pagedkv.check_indices`): the range check a compiled model runs on its token
// ids (and logit rows) before the embedding gather. TVM's `take` reads out of bounds without a check ("fast
// mode"): an id past the vocabulary crashes the process, a negative one returns another row's numbers. The
// check runs on the host, so it works in a process that has only the TVM runtime and this library.
#include <tvm/ffi/error.h>

#include <cstring>
#include <sstream>
#include <vector>

#include "paged_kv_cache.h"

namespace pagedkv {

namespace {

// The element `flat` of a row-major tensor of `shape`, as "[i, j, ...]".
std::string IndexStr(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  std::ostringstream os;
  os << "[";
  for (size_t d = 0; d < index.size(); ++d) os << (d ? ", " : "") << index[d];
  os << "]";
  return os.str();
}

// The values of an int32 or int64 tensor, widened to int64, on the host.
std::vector<int64_t> HostValues(const TensorFns& fns, const ffi::Tensor& t) {
  size_t count = static_cast<size_t>(t.numel());
  size_t elem = t.dtype().bits / 8;
  std::vector<uint8_t> bytes(count * elem);
  if (count > 0) fns.CopyToBytes(t, bytes.data(), bytes.size());  // copies from a GPU, waits for it
  std::vector<int64_t> out(count);
  for (size_t i = 0; i < count; ++i) {
    if (elem == 4) {
      int32_t v;
      std::memcpy(&v, bytes.data() + i * 4, 4);
      out[i] = v;
    } else {
      std::memcpy(&out[i], bytes.data() + i * 8, 8);
    }
  }
  return out;
}

}  // namespace

void PagedKVCacheObj::CheckIndices(const ffi::Tensor& values, const std::string& name, int64_t bound,
                                   const std::string& bound_name) const {
  DLDataType dt = values.dtype();
  if (dt.code != kDLInt || (dt.bits != 32 && dt.bits != 64) || dt.lanes != 1) {
    TVM_FFI_THROW(TypeError) << "pagedkv: '" << name << "' must be an int32 or int64 tensor, given "
                             << DTypeName(dt);
  }
  if (!values.IsContiguous()) TVM_FFI_THROW(ValueError) << "pagedkv: tensor '" << name << "' must be contiguous";
  std::vector<int64_t> host = HostValues(fns_, values);
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < host.size(); ++i) {
    if (host[i] < 0 || host[i] >= bound) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  if (first < 0) return;
  std::vector<int64_t> shape(values.shape().begin(), values.shape().end());
  std::ostringstream os;
  os << "pagedkv: " << name << IndexStr(shape, first) << " = " << host[first] << " is outside [0, " << bound_name
     << "=" << bound << ")";
  if (bad > 1) os << " (" << bad << " of its " << host.size() << " values are)";
  // Raised inside a model function, whose caller opened a forward: say how to undo it.
  if (forward_.has_value()) os << "; pagedkv.abort_forward takes back the tokens of the open forward";
  TVM_FFI_THROW(ValueError) << os.str();
}

}  // namespace pagedkv
