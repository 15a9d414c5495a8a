#include "ffi/cuda_util.h"
#include "ops/swiglu/ffi.h"
#include "ops/swiglu/launch.h"

namespace jax_cluster {
namespace {

ffi::Error run_swiglu(const SwigluParams& p, cudaStream_t stream) {
  return ffi_util::from_cuda(launch_swiglu(p, stream), "swiglu");
}

}  // namespace
}  // namespace jax_cluster

JAX_CLUSTER_FFI_CUDA_HANDLER(swiglu, jax_cluster::decode_swiglu, jax_cluster::run_swiglu);
