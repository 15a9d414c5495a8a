// Plain enums shared by kernels, CPU references and FFI handlers (host-safe).
#pragma once

#include <cstdint>
#include <string_view>

// Small helpers of params structs that kernels call too.
#ifdef __CUDACC__
#define JAX_CLUSTER_HOST_DEVICE __host__ __device__
#else
#define JAX_CLUSTER_HOST_DEVICE
#endif

namespace jax_cluster {

enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline int dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }

// The DType of a numpy dtype name ("float32", "float16", "bfloat16"), for the launch plans
// Python reads (cpp/ops/<op>/plan.cc); false for any other name.
inline bool dtype_from_name(std::string_view name, DType* out) {
  if (name == "float32") return *out = DType::kF32, true;
  if (name == "float16") return *out = DType::kF16, true;
  if (name == "bfloat16") return *out = DType::kBF16, true;
  return false;
}

enum class ReduceOp : int32_t { kSum = 0, kMax = 1 };

// Largest dynamic shared memory one block may opt into on sm_90 (227 KiB).
inline constexpr int64_t kMaxSharedBytesPerBlock = 232448;

// Cluster sizes 1..8 and 16 (16 is non-portable: needs an opt-in attribute). Sizes that
// are not powers of two (3, 5, 6, 7) exist for grids whose clusters would otherwise not
// fit the GPU at once (an H100 keeps 31 clusters of 4 resident, not 32: 32 clusters of 3
// run in one wave); kernels that split work by powers of two check is_pow2_cluster_size.
inline constexpr int kMaxClusterSize = 16;

JAX_CLUSTER_HOST_DEVICE inline bool is_pow2_cluster_size(int64_t n) {
  return n >= 1 && n <= kMaxClusterSize && (n & (n - 1)) == 0;
}

JAX_CLUSTER_HOST_DEVICE inline bool is_valid_cluster_size(int64_t n) {
  return (n >= 1 && n <= 8) || n == 16;
}

// Receive slots a cluster collective (cluster_collectives.cuh) needs per block: one per
// butterfly round, log2(n), for a power of two; else one per peer, n - 1.
JAX_CLUSTER_HOST_DEVICE inline int cluster_exchange_slots(int64_t n) {
  if ((n & (n - 1)) != 0) return static_cast<int>(n - 1);
  int r = 0;
  while ((int64_t{1} << r) < n) ++r;
  return r;
}

}  // namespace jax_cluster
