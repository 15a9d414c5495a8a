#include "cpu/swiglu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/numerics.h"

namespace jax_cluster::cpu {

namespace {

// Row `row` of a [rows, cols] matrix of dtype t, widened to fp32.
void load_row(DType t, const void* base, int64_t row, int64_t cols, float* dst) {
  for (int64_t j = 0; j < cols; ++j) dst[j] = load(t, base, row * cols + j);
}

}  // namespace

void swiglu(const SwigluParams& p) {
  const int64_t m = p.m, d = p.d, f = p.f;
  // Each weight row is widened once and applied to every row of x; every output element
  // is still a sum in index order (k = 0, 1, ...), one rounding at the end.
  std::vector<float> x(m * d), gate(m * f, 0.f), up(m * f, 0.f), wrow(std::max(d, f));
  for (int64_t i = 0; i < m; ++i) load_row(p.dtype, p.x, i, d, &x[i * d]);
  for (int64_t k = 0; k < d; ++k) {
    load_row(p.dtype, p.w_gate, k, f, wrow.data());
    for (int64_t i = 0; i < m; ++i) {
      const float xv = x[i * d + k];
      float* g = &gate[i * f];
      for (int64_t j = 0; j < f; ++j) g[j] += xv * wrow[j];
    }
    load_row(p.dtype, p.w_up, k, f, wrow.data());
    for (int64_t i = 0; i < m; ++i) {
      const float xv = x[i * d + k];
      float* u = &up[i * f];
      for (int64_t j = 0; j < f; ++j) u[j] += xv * wrow[j];
    }
  }
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
  for (int64_t j = 0; j < f; ++j) {
    load_row(p.dtype, p.w_down, j, d, wrow.data());
    for (int64_t i = 0; i < m; ++i) {
      const float av = a2[i * f + j];
      float* yr = &y[i * d];
      for (int64_t n = 0; n < d; ++n) yr[n] += av * wrow[n];
    }
  }
  for (int64_t e = 0; e < m * d; ++e) {
    float v = y[e];
    if (p.has_residual) v += load(p.dtype, p.residual, e);
    store(p.dtype, p.out, e, v);
  }
}

}  // namespace jax_cluster::cpu
