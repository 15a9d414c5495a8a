#include "ffi/cuda_util.h"
#include "ops/cluster_collectives/ffi.h"
#include "ops/cluster_collectives/launch.h"

namespace jax_cluster {
namespace {

ffi::Error run_cluster_reduce(const ClusterCollectiveParams& p, cudaStream_t stream) {
  return ffi_util::from_cuda(launch_cluster_reduce(p, stream), "cluster_reduce");
}

ffi::Error run_cluster_gather(const ClusterCollectiveParams& p, cudaStream_t stream) {
  return ffi_util::from_cuda(launch_cluster_gather(p, stream), "cluster_gather");
}

}  // namespace
}  // namespace jax_cluster

JAX_CLUSTER_FFI_CUDA_HANDLER(cluster_reduce, jax_cluster::decode_cluster_collective<false>,
                             jax_cluster::run_cluster_reduce);
JAX_CLUSTER_FFI_CUDA_HANDLER(cluster_gather, jax_cluster::decode_cluster_collective<true>,
                             jax_cluster::run_cluster_gather);
