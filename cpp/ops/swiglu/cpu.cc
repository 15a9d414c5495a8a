#include "ops/swiglu/cpu.h"

#include <cmath>
#include <vector>

#include "cpu/matmul.h"
#include "cpu/numerics.h"

namespace jax_cluster::cpu {

void swiglu(const SwigluParams& p) {
  const int64_t m = p.m, d = p.d, f = p.f;
  // Every output element is a sum in index order (k = 0, 1, ...), one rounding at the end.
  std::vector<float> x(m * d), gate(m * f, 0.f), up(m * f, 0.f);
  for (int64_t e = 0; e < m * d; ++e) x[e] = load(p.dtype, p.x, e);
  matmul_accumulate(p.dtype, x.data(), m, d, p.w_gate, f, gate.data());
  matmul_accumulate(p.dtype, x.data(), m, d, p.w_up, f, up.data());
  // A2 = silu(g) * u, rounded to the activation dtype (as every implementation stores it).
  std::vector<float>& a2 = gate;
  for (int64_t e = 0; e < m * f; ++e) {
    const float g = gate[e];
    a2[e] = round_to(p.dtype, g / (1.f + std::exp(-g)) * up[e]);
  }
  if (!p.has_down) {
    for (int64_t e = 0; e < m * f; ++e) store(p.dtype, p.out, e, a2[e]);
    return;
  }
  std::vector<float> y(m * d, 0.f);
  matmul_accumulate(p.dtype, a2.data(), m, f, p.w_down, d, y.data());
  for (int64_t e = 0; e < m * d; ++e) {
    float v = y[e];
    if (p.has_residual) v += load(p.dtype, p.residual, e);
    store(p.dtype, p.out, e, v);
  }
}

}  // namespace jax_cluster::cpu
