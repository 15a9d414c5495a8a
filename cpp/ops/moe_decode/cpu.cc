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
  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::vector<float> sc(e), ch(e), best(p.group_limited ? p.n_group : 0), xr(h);
  for (int64_t n = 0; n < p.n; ++n) {
    for (int64_t r = 0; r < h; ++r) xr[r] = load(p.dtype, p.x, n * h + r);
    if (p.norm != nullptr) {  // h = RMSNorm(x), rounded as jnp rounds, written for the experts
      float ss = 0.f;
      for (float v : xr) ss += v * v;
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(h) + p.norm_eps);
      for (int64_t r = 0; r < h; ++r) {
        xr[r] = round_to(p.dtype, load(p.dtype, p.norm, r) * round_to(p.dtype, xr[r] * rstd));
        store(p.dtype, p.normed, n * h + r, xr[r]);
      }
    }
    std::fill(sc.begin(), sc.end(), 0.f);
    for (int64_t r = 0; r < h; ++r) {
      for (int64_t c = 0; c < e; ++c) sc[c] += xr[r] * load(p.router_dtype, p.router, r * e + c);
    }
    if (p.noaux_tc) {  // sigmoid scores; the choice biased, a group scored by its two best
      for (int64_t c = 0; c < e; ++c) {
        sc[c] = 1.f / (1.f + std::exp(-sc[c]));
        ch[c] = sc[c] + p.score_bias[c];
      }
      for (int64_t g = 0; g < p.n_group; ++g) {
        float b1 = -kInf, b2 = -kInf;
        for (int64_t c = g * per; c < (g + 1) * per; ++c) {
          if (ch[c] > b1) b2 = b1, b1 = ch[c];
          else if (ch[c] > b2) b2 = ch[c];
        }
        best[g] = b1 + b2;
      }
    } else {
      float m = -kInf, z = 0.f;
      for (float v : sc) m = std::max(m, v);
      for (float& v : sc) z += (v = std::exp(v - m));
      for (float& v : sc) v /= z;
      ch = sc;
      for (int64_t g = 0; g < static_cast<int64_t>(best.size()); ++g) {
        best[g] = -kInf;
        for (int64_t c = g * per; c < (g + 1) * per; ++c) best[g] = std::max(best[g], sc[c]);
      }
    }
    if (p.group_limited) {  // outside the topk_group best groups: 0 (V2), -inf (V3)
      for (int64_t c = 0; c < e; ++c) {
        const int64_t g = c / per;
        int64_t above = 0;
        for (int64_t o = 0; o < p.n_group; ++o) above += best[o] > best[g] || (best[o] == best[g] && o < g);
        if (above >= p.topk_group) ch[c] = p.noaux_tc ? -kInf : 0.f;
      }
    }
    float sum = 0.f;
    for (int64_t s = 0; s < k; ++s) {
      int64_t bi = -1;
      float bv = -kInf;
      for (int64_t c = 0; c < e; ++c) {
        if (ch[c] > bv || (ch[c] == bv && bi < 0)) bv = ch[c], bi = c;
      }
      p.ids[n * k + s] = static_cast<int32_t>(bi);
      const float w = bi < 0 ? 0.f : p.noaux_tc ? sc[bi] : bv;  // V3: the unbiased score
      p.weights[n * k + s] = w;
      sum += w;
      if (bi >= 0) ch[bi] = std::numeric_limits<float>::quiet_NaN();
    }
    const bool norm = p.norm_topk_prob && (p.noaux_tc || k > 1);
    const float scale = p.noaux_tc || !norm ? p.scaling : 1.f;
    for (int64_t s = 0; s < k; ++s) {
      float& w = p.weights[n * k + s];
      w = (norm ? w / (sum + 1e-20f) : w) * scale;
    }
  }
}

}  // namespace jax_cluster::cpu
