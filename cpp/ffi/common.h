// Helpers shared by every FFI handler: dtype mapping, argument errors.
#pragma once

#include <string>

#include "jax_cluster/types.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cluster::ffi_util {

namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument(what); }

inline ffi::ErrorOr<DType> to_dtype(ffi::DataType t, const char* arg) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::F16: return DType::kF16;
    case ffi::DataType::BF16: return DType::kBF16;
    default:
      return ffi::Unexpected(invalid(std::string(arg) + ": dtype must be float32, float16 or bfloat16"));
  }
}

inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

}  // namespace jax_cluster::ffi_util
