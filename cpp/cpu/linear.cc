#include "cpu/linear.h"

#include <vector>

#include "cpu/numerics.h"

namespace jax_cluster::cpu {

void linear(const LinearParams& p) {
  const int64_t m = p.m, k = p.k, n = p.n;
  // Each weight row is widened once and applied to every row of a.
  std::vector<float> a(m * k), y(m * n, 0.f), wrow(n);
  for (int64_t e = 0; e < m * k; ++e) a[e] = load(p.dtype, p.a, e);
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t j = 0; j < n; ++j) wrow[j] = load(p.dtype, p.w, kk * n + j);
    for (int64_t i = 0; i < m; ++i) {
      const float av = a[i * k + kk];
      float* yr = &y[i * n];
      for (int64_t j = 0; j < n; ++j) yr[j] += av * wrow[j];
    }
  }
  for (int64_t e = 0; e < m * n; ++e) {
    float v = y[e];
    if (p.has_residual) v += load(p.dtype, p.residual, e);
    if (p.out_f32) {
      static_cast<float*>(p.out)[e] = v;
    } else {
      store(p.dtype, p.out, e, v);
    }
  }
}

}  // namespace jax_cluster::cpu
