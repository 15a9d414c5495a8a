#include "ops/moe_decode/cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/numerics.h"

namespace jax_cluster::cpu {

namespace {

// y [cols] += a [rows] (fp32) @ w [rows, cols] (dtype t at element offset `base`), in
// row order.
void gemv_accumulate(DType t, const float* a, int64_t rows, const void* w, int64_t base, int64_t cols,
                     float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float av = a[r];
    for (int64_t c = 0; c < cols; ++c) y[c] += av * load(t, w, base + r * cols + c);
  }
}

}  // namespace

void moe_decode(const MoeDecodeParams& p) {
  const int64_t h = p.h, i = p.i;
  std::vector<float> x(h), g(i), u(i), y(h), acc(h);
  for (int64_t n = 0; n < p.n; ++n) {
    for (int64_t c = 0; c < h; ++c) x[c] = load(p.dtype, p.x, n * h + c);
    bool valid = true;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t s = 0; s < p.k; ++s) {
      const int64_t e = p.ids[n * p.k + s];
      if (e < 0 || e >= p.e) {
        valid = false;
        continue;
      }
      std::fill(g.begin(), g.end(), 0.f);
      std::fill(u.begin(), u.end(), 0.f);
      gemv_accumulate(p.dtype, x.data(), h, p.w_gate, e * h * i, i, g.data());
      gemv_accumulate(p.dtype, x.data(), h, p.w_up, e * h * i, i, u.data());
      for (int64_t c = 0; c < i; ++c) g[c] = round_to(p.dtype, g[c] / (1.f + std::exp(-g[c])) * u[c]);
      std::fill(y.begin(), y.end(), 0.f);
      gemv_accumulate(p.dtype, g.data(), i, p.w_down, e * i * h, h, y.data());
      const float w = p.weights[n * p.k + s];
      for (int64_t c = 0; c < h; ++c) acc[c] += w * y[c];
    }
    for (int64_t c = 0; c < h; ++c) {
      if (p.has_residual) acc[c] += load(p.dtype, p.residual, n * h + c);
    }
    if (p.i_s > 0) {  // the shared experts: one SwiGLU, added to the rounded routed sum
      std::vector<float> sg(p.i_s, 0.f), su(p.i_s, 0.f);
      gemv_accumulate(p.dtype, x.data(), h, p.s_gate, 0, p.i_s, sg.data());
      gemv_accumulate(p.dtype, x.data(), h, p.s_up, 0, p.i_s, su.data());
      for (int64_t c = 0; c < p.i_s; ++c) sg[c] = round_to(p.dtype, sg[c] / (1.f + std::exp(-sg[c])) * su[c]);
      std::fill(y.begin(), y.end(), 0.f);
      gemv_accumulate(p.dtype, sg.data(), p.i_s, p.s_down, 0, h, y.data());
      for (int64_t c = 0; c < h; ++c) acc[c] = round_to(p.dtype, acc[c]) + y[c];
    }
    for (int64_t c = 0; c < h; ++c) {
      store(p.dtype, p.out, n * h + c, valid ? acc[c] : std::numeric_limits<float>::quiet_NaN());
    }
  }
}

void moe_route(const MoeRouteParams& p) {
  const int64_t h = p.h, e = p.e, k = p.k;
  const int64_t per = p.group_limited ? e / p.n_group : e;
  std::vector<float> sc(e), best(p.group_limited ? p.n_group : 0);
  for (int64_t n = 0; n < p.n; ++n) {
    std::fill(sc.begin(), sc.end(), 0.f);
    for (int64_t r = 0; r < h; ++r) {
      const float xv = load(p.dtype, p.x, n * h + r);
      for (int64_t c = 0; c < e; ++c) sc[c] += xv * load(p.router_dtype, p.router, r * e + c);
    }
    float m = -std::numeric_limits<float>::infinity(), z = 0.f;
    for (float v : sc) m = std::max(m, v);
    for (float& v : sc) z += (v = std::exp(v - m));
    for (float& v : sc) v /= z;
    if (p.group_limited) {
      for (int64_t g = 0; g < p.n_group; ++g) {
        best[g] = -std::numeric_limits<float>::infinity();
        for (int64_t c = g * per; c < (g + 1) * per; ++c) best[g] = std::max(best[g], sc[c]);
      }
      for (int64_t c = 0; c < e; ++c) {
        const int64_t g = c / per;
        int64_t above = 0;
        for (int64_t o = 0; o < p.n_group; ++o) above += best[o] > best[g] || (best[o] == best[g] && o < g);
        if (above >= p.topk_group) sc[c] = 0.f;
      }
    }
    float sum = 0.f;
    for (int64_t s = 0; s < k; ++s) {
      int64_t bi = -1;
      float bv = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < e; ++c) {
        if (sc[c] > bv || (sc[c] == bv && bi < 0)) bv = sc[c], bi = c;
      }
      p.ids[n * k + s] = static_cast<int32_t>(bi);
      p.weights[n * k + s] = bv;
      sum += bv;
      if (bi >= 0) sc[bi] = std::numeric_limits<float>::quiet_NaN();
    }
    for (int64_t s = 0; s < k; ++s) {
      float& w = p.weights[n * k + s];
      w = p.norm_topk_prob && k > 1 ? w / (sum + 1e-20f) : w * p.scaling;
    }
  }
}

}  // namespace jax_cluster::cpu
