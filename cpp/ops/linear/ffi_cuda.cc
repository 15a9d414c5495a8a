#include "ffi/cuda_util.h"
#include "ops/linear/ffi.h"
#include "ops/linear/launch.h"

namespace jax_cluster {
namespace {

ffi::Error linear_cuda(cudaStream_t stream, JAX_CLUSTER_LINEAR_ARGS) {
  auto p = JAX_CLUSTER_LINEAR_DECODE;
  if (!p) return p.error();
  return ffi_util::from_cuda(launch_linear(*p, stream), "linear");
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_linear_cuda, jax_cluster::linear_cuda,
    jax_cluster::bind_linear(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
