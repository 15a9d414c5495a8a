#include <string>

#include "ffi/cuda_util.h"
#include "ops/moe_decode/ffi.h"
#include "ops/moe_decode/launch.h"

namespace jax_cluster {
namespace {

// The CUDA kernels' own limit (float16 / bfloat16), then the launch.
xla::ffi::Error run_moe_decode_cuda(const MoeDecodeParams& p, cudaStream_t stream) {
  if (const std::string why = moe_decode_cuda_check(p); !why.empty()) {
    return ffi_util::invalid("moe_decode: " + why);
  }
  return ffi_util::from_cuda(launch_moe_decode(p, stream), "moe_decode");
}

xla::ffi::Error run_moe_route_cuda(const MoeRouteParams& p, cudaStream_t stream) {
  if (const std::string why = moe_route_cuda_check(p); !why.empty()) return ffi_util::invalid("moe_route: " + why);
  return ffi_util::from_cuda(launch_moe_route(p, stream), "moe_route");
}

}  // namespace
}  // namespace jax_cluster

JAX_CLUSTER_FFI_CUDA_HANDLER(moe_decode, jax_cluster::decode_moe_decode, jax_cluster::run_moe_decode_cuda);
JAX_CLUSTER_FFI_CUDA_HANDLER(moe_route, jax_cluster::decode_moe_route, jax_cluster::run_moe_route_cuda);
