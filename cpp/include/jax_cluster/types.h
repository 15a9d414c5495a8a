// Plain enums shared by kernels, CPU references and FFI handlers (host-safe).
#pragma once

#include <cstdint>

// Small helpers of params structs that kernels call too.
#ifdef __CUDACC__
#define JAX_CLUSTER_HOST_DEVICE __host__ __device__
#else
#define JAX_CLUSTER_HOST_DEVICE
#endif

namespace jax_cluster {

enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline int dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }

enum class ReduceOp : int32_t { kSum = 0, kMax = 1 };

// Largest dynamic shared memory one block may opt into on sm_90 (227 KiB).
inline constexpr int64_t kMaxSharedBytesPerBlock = 232448;

// Cluster sizes 1..16; 16 is non-portable (needs an opt-in attribute).
inline constexpr int kMaxClusterSize = 16;

inline bool is_valid_cluster_size(int64_t n) {
  return n >= 1 && n <= kMaxClusterSize && (n & (n - 1)) == 0;
}

inline int log2_exact(int64_t n) {
  int r = 0;
  while ((int64_t{1} << r) < n) ++r;
  return r;
}

}  // namespace jax_cluster
