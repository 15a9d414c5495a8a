#pragma once

#include "ops/cluster_collectives/params.h"

namespace jax_cluster::cpu {

// Same order of operations and rounding as the CUDA kernels (the butterfly
// of the DSMEM exchange, rank order in fp32 for the global one): results match bitwise.
void cluster_reduce(const ClusterCollectiveParams& p);
void cluster_gather(const ClusterCollectiveParams& p);

}  // namespace jax_cluster::cpu
