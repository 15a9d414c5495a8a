// CUDA-side FFI helpers: turning launch errors into FFI errors.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_cluster::ffi_util {

inline xla::ffi::Error from_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorName(err) + ": " +
                                   cudaGetErrorString(err));
}

}  // namespace jax_cluster::ffi_util
