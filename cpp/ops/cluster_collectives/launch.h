// CUDA launchers of the cluster-collective harness kernels (no XLA here).
#pragma once

#include <cuda_runtime.h>

#include "ops/cluster_collectives/params.h"

namespace jax_cluster {

cudaError_t launch_cluster_reduce(const ClusterCollectiveParams& p, cudaStream_t stream);
cudaError_t launch_cluster_gather(const ClusterCollectiveParams& p, cudaStream_t stream);

}  // namespace jax_cluster
