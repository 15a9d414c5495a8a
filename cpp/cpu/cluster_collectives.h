#pragma once

#include "kernels/cluster_collectives.h"

namespace jax_cluster::cpu {

// Same butterfly and rounding as the CUDA kernels, so results match bitwise.
void cluster_reduce(const ClusterCollectiveParams& p);
void cluster_gather(const ClusterCollectiveParams& p);

}  // namespace jax_cluster::cpu
