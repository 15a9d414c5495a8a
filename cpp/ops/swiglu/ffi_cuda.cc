#include "ffi/cuda_util.h"
#include "ops/swiglu/ffi.h"
#include "ops/swiglu/launch.h"

namespace jax_cluster {
namespace {

ffi::Error swiglu_cuda(cudaStream_t stream, JAX_CLUSTER_SWIGLU_ARGS) {
  auto p = JAX_CLUSTER_SWIGLU_DECODE;
  if (!p) return p.error();
  return ffi_util::from_cuda(launch_swiglu(*p, stream), "swiglu");
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_swiglu_cuda, jax_cluster::swiglu_cuda,
    jax_cluster::bind_swiglu(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
