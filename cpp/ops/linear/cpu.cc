#include "ops/linear/cpu.h"

#include <vector>

#include "cpu/matmul.h"
#include "cpu/numerics.h"

namespace jax_cluster::cpu {

void linear(const LinearParams& p) {
  const int64_t m = p.m, k = p.k, n = p.n;
  std::vector<float> a(m * k), y(m * n, 0.f);
  for (int64_t e = 0; e < m * k; ++e) a[e] = load(p.dtype, p.a, e);
  matmul_accumulate(p.dtype, a.data(), m, k, p.w, n, y.data());
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
