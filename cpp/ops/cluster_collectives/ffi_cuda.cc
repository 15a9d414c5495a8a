#include "ffi/cuda_util.h"
#include "ops/cluster_collectives/ffi.h"
#include "ops/cluster_collectives/launch.h"

JAX_CLUSTER_FFI_CUDA_LAUNCH_HANDLER(cluster_reduce, jax_cluster::decode_cluster_collective<false>,
                                    jax_cluster::launch_cluster_reduce);
JAX_CLUSTER_FFI_CUDA_LAUNCH_HANDLER(cluster_gather, jax_cluster::decode_cluster_collective<true>,
                                    jax_cluster::launch_cluster_gather);
