// The CPU handlers' matmul: plain loops, fp32, every sum in index order.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/numerics.h"

namespace jax_cluster::cpu {

// y [m, n] += a [m, k] (fp32) @ w [k, n] (dtype t). Each weight row is widened once and
// applied to every row of a; y[i][j] still sums over k = 0, 1, ... in order.
inline void matmul_accumulate(DType t, const float* a, int64_t m, int64_t k, const void* w,
                              int64_t n, float* y) {
  std::vector<float> wrow(n);
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t j = 0; j < n; ++j) wrow[j] = load(t, w, kk * n + j);
    for (int64_t i = 0; i < m; ++i) {
      const float av = a[i * k + kk];
      float* yr = y + i * n;
      for (int64_t j = 0; j < n; ++j) yr[j] += av * wrow[j];
    }
  }
}

}  // namespace jax_cluster::cpu
