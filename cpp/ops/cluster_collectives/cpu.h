#pragma once

#include "ops/cluster_collectives/params.h"

namespace jax_cluster::cpu {

// Same order of operations and rounding as the CUDA kernels (the butterfly
// for impl=dsmem, rank order in fp32 for impl=global): results match bitwise.
void cluster_reduce(const ClusterCollectiveParams& p);
void cluster_gather(const ClusterCollectiveParams& p);

}  // namespace jax_cluster::cpu
