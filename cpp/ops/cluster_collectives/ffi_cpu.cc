#include "ops/cluster_collectives/cpu.h"
#include "ops/cluster_collectives/ffi.h"

JAX_CLUSTER_FFI_CPU_HANDLER(cluster_reduce, jax_cluster::decode_cluster_collective<false>,
                            jax_cluster::cpu::cluster_reduce);
JAX_CLUSTER_FFI_CPU_HANDLER(cluster_gather, jax_cluster::decode_cluster_collective<true>,
                            jax_cluster::cpu::cluster_gather);
