// CUDA-side FFI helpers: turning launch errors into FFI errors, and the CUDA handler of the
// binding pattern described in ffi/common.h.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "ffi/common.h"

namespace jax_cluster::ffi_util {

inline xla::ffi::Error from_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorName(err) + ": " +
                                   cudaGetErrorString(err));
}

}  // namespace jax_cluster::ffi_util

// The CUDA handler jax_cluster_<op>_cuda: stream first, then decode's parameters; run is
// ffi::Error(const Params&, cudaStream_t). Every handler is command-buffer compatible
// (XLA may capture it in a CUDA graph): launchers never synchronise or allocate.
#define JAX_CLUSTER_FFI_CUDA_HANDLER(op, decode, run)                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                             \
      jax_cluster_##op##_cuda,                                                               \
      (&::jax_cluster::ffi_util::Handler<&decode>::with_stream<cudaStream_t, &run>),         \
      ::jax_cluster::ffi_util::Handler<&decode>::bind(                                       \
          ::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()),          \
      {::xla::ffi::Traits::kCmdBufferCompatible})

// The CUDA handler of an op whose launcher needs no check beyond decode's: run is
// launch(const Params&, cudaStream_t), its error reported under the op's name.
#define JAX_CLUSTER_FFI_CUDA_LAUNCH_HANDLER(op, decode, launch)                              \
  namespace jax_cluster::ffi_util {                                                          \
  static xla::ffi::Error run_##op(const Handler<&decode>::ParamsType& p, cudaStream_t stream) { \
    return from_cuda(launch(p, stream), #op);                                                \
  }                                                                                          \
  }                                                                                          \
  JAX_CLUSTER_FFI_CUDA_HANDLER(op, decode, ::jax_cluster::ffi_util::run_##op)
