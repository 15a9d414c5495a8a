#include "ffi/cuda_util.h"
#include "ops/linear/ffi.h"
#include "ops/linear/launch.h"

namespace jax_cluster {
namespace {

ffi::Error run_linear(const LinearParams& p, cudaStream_t stream) {
  return ffi_util::from_cuda(launch_linear(p, stream), "linear");
}

}  // namespace
}  // namespace jax_cluster

JAX_CLUSTER_FFI_CUDA_HANDLER(linear, jax_cluster::decode_linear, jax_cluster::run_linear);
