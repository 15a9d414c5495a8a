#include "ffi/cuda_util.h"
#include "ops/mla_decode/ffi.h"
#include "ops/mla_decode/launch.h"

namespace jax_cluster {
namespace {

ffi::Error run_mla_decode_cuda(const MlaDecodeParams& p, cudaStream_t stream) {
  if (auto e = mla_decode_cuda_check(p); !e.empty()) return ffi_util::invalid("mla_decode: " + e);
  return ffi_util::from_cuda(launch_mla_decode(p, stream), "mla_decode");
}

}  // namespace
}  // namespace jax_cluster

JAX_CLUSTER_FFI_CUDA_HANDLER(mla_decode, jax_cluster::decode_mla_decode, jax_cluster::run_mla_decode_cuda);
