#include "ops/mla_decode/cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/numerics.h"
#include "ops/mla_decode/slots.h"

namespace jax_cluster::cpu {

void mla_decode(const MlaDecodeParams& p) {
  const int64_t E = p.latent_dim(), R = p.rank;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> s, o(R);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t length = p.lengths[b];
    if (!mla_decode_row_valid(p, b, length)) {
      for (int64_t i = 0; i < p.num_heads * R; ++i) store(p.dtype, p.out, b * p.num_heads * R + i, nan);
      continue;
    }
    const int64_t at = mla_decode_slot_offset(p, b, length) * E;
    for (int64_t e = 0; e < E; ++e) store(p.dtype, p.cache, at + e, p.new_latent[b * E + e]);
    s.assign(length + 1, 0.f);
    for (int64_t h = 0; h < p.num_heads; ++h) {
      const float* q = p.q + (b * p.num_heads + h) * E;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t <= length; ++t) {
        const int64_t row = mla_decode_slot_offset(p, b, t) * E;
        float dot = 0.f;
        for (int64_t e = 0; e < E; ++e) dot += q[e] * load(p.dtype, p.cache, row + e);
        s[t] = dot * p.scale;
        m = std::max(m, s[t]);
      }
      float l = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t t = 0; t <= length; ++t) {
        const float w = std::exp(s[t] - m);
        const int64_t row = mla_decode_slot_offset(p, b, t) * E;
        l += w;
        for (int64_t c = 0; c < R; ++c) o[c] += w * load(p.dtype, p.cache, row + c);
      }
      for (int64_t c = 0; c < R; ++c) store(p.dtype, p.out, (b * p.num_heads + h) * R + c, o[c] / l);
    }
  }
}

namespace {

// a @ W[:, c0 : c0 + n] for one row a [k] (W row-major with leading dimension ld), fp32 sums.
std::vector<float> gemv(DType t, const float* a, int64_t k, const void* W, int64_t ld, int64_t c0, int64_t n) {
  std::vector<float> y(n, 0.f);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t c = 0; c < n; ++c) y[c] += a[i] * load(t, W, i * ld + c0 + c);
  }
  return y;
}

void rotate(DType t, float* pair, int pos, float inv_freq, float factor) {
  const float angle = static_cast<float>(pos) * inv_freq;
  const float c = std::cos(angle) * factor, s = std::sin(angle) * factor, a = pair[0], b = pair[1];
  pair[0] = round_to(t, a * c - b * s);
  pair[1] = round_to(t, a * s + b * c);
}

}  // namespace

void mla_project(const MlaProjectParams& p) {
  const DType t = p.dtype;
  const int64_t hc = p.head_cols(), E = p.latent_cols(), ldb = p.num_heads * (p.nope + p.v_dim);
  std::vector<float> h(p.hidden), src;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t len = p.lengths[b];
    const int pos = len >= 0 && len < p.capacity ? len : 0;
    float ss = 0.f;
    for (int64_t k = 0; k < p.hidden; ++k) {
      const float v = load(t, p.x, b * p.hidden + k);
      ss += v * v;
    }
    const float rstd = 1.f / std::sqrt(ss / static_cast<float>(p.hidden) + p.eps);
    for (int64_t k = 0; k < p.hidden; ++k) {
      h[k] = round_to(t, load(t, p.norm, k) * round_to(t, load(t, p.x, b * p.hidden + k) * rstd));
    }
    if (p.q_src != nullptr) {
      src.resize(p.q_in);
      for (int64_t k = 0; k < p.q_in; ++k) src[k] = load(t, p.q_src, b * p.q_in + k);
    }
    const float* q_in = p.q_src != nullptr ? src.data() : h.data();
    const int64_t K = p.q_src != nullptr ? p.q_in : p.hidden;
    for (int64_t hd = 0; hd < p.num_heads; ++hd) {
      std::vector<float> q = gemv(t, q_in, K, p.w_q, p.num_heads * hc, hd * hc, hc);
      for (float& v : q) v = round_to(t, v);
      float* out = p.q_full + (b * p.num_heads + hd) * E;
      for (int64_t n = 0; n < p.rank; ++n) {
        float s = 0.f;
        for (int64_t d = 0; d < p.nope; ++d) s += q[d] * load(t, p.w_kv_b, n * ldb + hd * (p.nope + p.v_dim) + d);
        out[n] = s;
      }
      for (int64_t i = 0; i < p.rope / 2; ++i) {
        rotate(t, q.data() + p.nope + 2 * i, pos, p.inv_freq[i], p.rope_factor);
        out[p.rank + 2 * i] = q[p.nope + 2 * i];
        out[p.rank + 2 * i + 1] = q[p.nope + 2 * i + 1];
      }
    }
    std::vector<float> kv = gemv(t, h.data(), p.hidden, p.w_kv_a, E, 0, E);
    float kss = 0.f;
    for (int64_t c = 0; c < E; ++c) {
      kv[c] = round_to(t, kv[c] + (p.kv_a_bias != nullptr ? load(t, p.kv_a_bias, c) : 0.f));
      if (c < p.rank) kss += kv[c] * kv[c];
    }
    const float lrstd = 1.f / std::sqrt(kss / static_cast<float>(p.rank) + p.latent_eps);
    float* out = p.new_latent + b * E;
    for (int64_t c = 0; c < p.rank; ++c) out[c] = round_to(t, load(t, p.kv_a_norm, c) * round_to(t, kv[c] * lrstd));
    for (int64_t i = 0; i < p.rope / 2; ++i) {
      rotate(t, kv.data() + p.rank + 2 * i, pos, p.inv_freq[i], p.rope_factor);
      out[p.rank + 2 * i] = kv[p.rank + 2 * i];
      out[p.rank + 2 * i + 1] = kv[p.rank + 2 * i + 1];
    }
  }
}

void mla_output(const MlaOutputParams& p) {
  const DType t = p.dtype;
  const int64_t ldb = p.num_heads * (p.nope + p.v_dim);
  std::vector<float> o(p.num_heads * p.v_dim), lat(p.rank);
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.num_heads; ++h) {
      for (int64_t n = 0; n < p.rank; ++n) lat[n] = load(t, p.o_lat, (b * p.num_heads + h) * p.rank + n);
      std::vector<float> oh = gemv(t, lat.data(), p.rank, p.w_kv_b, ldb, h * (p.nope + p.v_dim) + p.nope, p.v_dim);
      for (int64_t j = 0; j < p.v_dim; ++j) o[h * p.v_dim + j] = round_to(t, oh[j]);
    }
    std::vector<float> y = gemv(t, o.data(), p.num_heads * p.v_dim, p.w_o, p.hidden, 0, p.hidden);
    for (int64_t c = 0; c < p.hidden; ++c) {
      float v = round_to(t, y[c] + (p.o_bias != nullptr ? load(t, p.o_bias, c) : 0.f));
      if (p.residual != nullptr) v += load(t, p.residual, b * p.hidden + c);
      store(t, p.y, b * p.hidden + c, v);
    }
  }
}

}  // namespace jax_cluster::cpu
