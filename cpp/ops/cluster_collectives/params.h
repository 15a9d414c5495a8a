// cluster_reduce / cluster_gather: the cluster collectives of
// jax_cluster/cluster_collectives.cuh as ops (tests, the collectives' benchmark).
// x [groups, N, size], one cluster of N blocks per group, block b holds x[g, b] in shared
// memory.
#pragma once

#include <cstdint>

#include "jax_cluster/types.h"

namespace jax_cluster {

// How the blocks of a cluster exchange their slices.
enum class ClusterExchange : int32_t {
  kDsmem = 0,   // on-chip: distributed shared memory (the library collectives)
  kGlobal = 1,  // off-chip baseline: through global memory + a cluster barrier
};

// Dynamic shared memory a block of these kernels may use: the opt-in limit less 1 KiB
// for the barriers and static shared memory.
inline constexpr int64_t kMaxDynamicSharedBytes = kMaxSharedBytesPerBlock - 1024;

struct ClusterCollectiveParams {
  DType dtype;
  ReduceOp op;  // reduce only
  ClusterExchange exchange;
  int64_t groups;
  int cluster_size;
  int64_t size;     // elements per block
  int repeat;       // collective calls per kernel (in-kernel timing; >= 1)
  bool all_blocks;  // write every block's copy of the result
  const void* x;
  void* out;        // reduce: [G, size] or [G, N, size]; gather: [G, N*size] or [G, N, N*size]
  void* workspace;  // global exchange: 2 * G * N * padded bytes of one block's slice
};

// Padded bytes of one block's slice (16-byte vectors).
inline int64_t collective_slice_bytes(DType t, int64_t size) {
  return (size * dtype_size(t) + 15) / 16 * 16;
}

// Dynamic shared memory one block needs (Python reads it through the extension's plans,
// cpp/ops/cluster_collectives/plan.cc, to reject oversized inputs at trace time).
inline int64_t cluster_collective_smem_bytes(bool gather, DType t, int cluster_size,
                                             int64_t size, ClusterExchange exchange) {
  const int64_t slice = collective_slice_bytes(t, size);
  // gather: the gathered result (N segments) + the local segment staged once per kernel.
  if (gather) return slice * (cluster_size + 1);
  // reduce: data + its receive slots (DSMEM); data alone (global).
  return exchange == ClusterExchange::kDsmem ? slice * (1 + cluster_exchange_slots(cluster_size))
                                             : slice;
}

// Global-memory exchange area of the off-chip baseline (double-buffered by call).
inline int64_t cluster_collective_workspace_bytes(DType t, int64_t groups, int cluster_size,
                                                  int64_t size, ClusterExchange exchange) {
  if (exchange != ClusterExchange::kGlobal) return 0;
  return 2 * groups * cluster_size * collective_slice_bytes(t, size);
}

}  // namespace jax_cluster
