// Test/benchmark harness ops for the cluster collectives: x [groups, N, size],
// one cluster of N blocks per group, block b holds x[g, b] in shared memory.
#pragma once

#include <cstdint>

#include "jax_cluster/types.h"

namespace jax_cluster {

enum class CollectiveImpl : int32_t {
  kDsmem = 0,   // on-chip: distributed shared memory (the library collectives)
  kGlobal = 1,  // off-chip baseline: through global memory + a cluster barrier
};

struct ClusterCollectiveParams {
  DType dtype;
  ReduceOp op;  // reduce only
  CollectiveImpl impl;
  int64_t groups;
  int cluster_size;
  int64_t size;     // elements per block
  int repeat;       // collective calls per kernel (in-kernel timing; >= 1)
  bool all_blocks;  // write every block's copy of the result
  const void* x;
  void* out;        // reduce: [G, size] or [G, N, size]; gather: [G, N*size] or [G, N, N*size]
  void* workspace;  // global impl: 2 * G * N * padded bytes of one block's slice
};

// Padded bytes of one block's slice (16-byte vectors).
inline int64_t collective_slice_bytes(DType t, int64_t size) {
  return (size * dtype_size(t) + 15) / 16 * 16;
}

// Dynamic shared memory one block needs (jax_cluster/ops/cluster_collectives.py
// mirrors these formulas to reject oversized inputs at trace time).
inline int64_t cluster_reduce_smem_bytes(DType t, int cluster_size, int64_t size,
                                         CollectiveImpl impl) {
  const int64_t slice = collective_slice_bytes(t, size);
  // data + its receive slots (DSMEM); data alone (global).
  return impl == CollectiveImpl::kDsmem ? slice * (1 + cluster_exchange_slots(cluster_size)) : slice;
}

inline int64_t cluster_gather_smem_bytes(DType t, int cluster_size, int64_t size,
                                         CollectiveImpl /*impl*/) {
  // gathered result (N segments) + the local segment staged once per kernel.
  return collective_slice_bytes(t, size) * (cluster_size + 1);
}

// Global-memory exchange area of the off-chip baseline (double-buffered by call).
inline int64_t cluster_collective_workspace_bytes(const ClusterCollectiveParams& p) {
  if (p.impl != CollectiveImpl::kGlobal) return 0;
  return 2 * p.groups * p.cluster_size * collective_slice_bytes(p.dtype, p.size);
}

}  // namespace jax_cluster
