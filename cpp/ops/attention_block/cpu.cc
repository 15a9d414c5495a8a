#include "ops/attention_block/cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/numerics.h"
#include "cpu/rope.h"

namespace jax_cluster::cpu {
namespace {

void normalize(const AttentionBlockParams& p, int64_t b, std::vector<float>& h) {
  const int64_t d = p.hidden;
  for (int64_t i = 0; i < d; ++i) h[i] = load(p.dtype, p.x, b * d + i);
  if (p.norm == NormKind::kNone) return;
  double sum = 0, sq = 0;
  for (float v : h) {
    sum += v;
    sq += static_cast<double>(v) * v;
  }
  const float mean = static_cast<float>(sum / d);
  if (p.norm == NormKind::kRms) {
    const float r = 1.f / std::sqrt(static_cast<float>(sq / d) + p.eps);
    for (int64_t i = 0; i < d; ++i) h[i] = h[i] * r * load(p.dtype, p.norm_w, i);
  } else {
    const float var = std::max(static_cast<float>(sq / d) - mean * mean, 0.f);
    const float r = 1.f / std::sqrt(var + p.eps);
    for (int64_t i = 0; i < d; ++i) {
      h[i] = (h[i] - mean) * r * load(p.dtype, p.norm_w, i) + load(p.dtype, p.norm_b, i);
    }
  }
}

void rope(const AttentionBlockParams& p, float* v, int pos) {
  cpu::rope(v, pos, p.inv_freq, p.rotary_dim, p.rope_layout);
}

}  // namespace

void attention_block(const AttentionBlockParams& p) {
  const int64_t D = p.hidden, Hq = p.num_q_heads, Hkv = p.num_kv_heads, Dh = p.head_dim;
  const int64_t cols = (Hq + 2 * Hkv) * Dh, G = p.group(), S = p.max_seq;
  std::vector<float> h(D), qkv(cols), attn(Hq * Dh), scores;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int len = p.lengths[b];
    if (len < 0 || len >= S) {  // an invalid length poisons the row, never memory
      for (int64_t c = 0; c < D; ++c) store(p.dtype, p.y, b * D + c, std::nanf(""));
      continue;
    }
    normalize(p, b, h);
    std::fill(qkv.begin(), qkv.end(), 0.f);
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t c = 0; c < cols; ++c) qkv[c] += h[d] * load(p.dtype, p.w_qkv, d * cols + c);
    }
    if (p.has_qkv_bias) {
      for (int64_t c = 0; c < cols; ++c) qkv[c] += load(p.dtype, p.qkv_bias, c);
    }
    for (int64_t head = 0; head < Hq + Hkv; ++head) rope(p, &qkv[head * Dh], len);
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t row = ((b * Hkv + g) * S + len) * Dh;
      for (int64_t i = 0; i < Dh; ++i) {
        store(p.dtype, p.k_cache, row + i, qkv[(Hq + g) * Dh + i]);
        store(p.dtype, p.v_cache, row + i, qkv[(Hq + Hkv + g) * Dh + i]);
      }
    }
    scores.resize(len + 1);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const int64_t base = (b * Hkv + hq / G) * S * Dh;
      float mx = -std::numeric_limits<float>::infinity();
      for (int t = 0; t <= len; ++t) {
        float s = 0.f;
        for (int64_t i = 0; i < Dh; ++i) s += qkv[hq * Dh + i] * load(p.dtype, p.k_cache, base + t * Dh + i);
        scores[t] = s * p.scale;
        mx = std::max(mx, scores[t]);
      }
      float total = 0.f;
      for (float& s : scores) total += (s = std::exp(s - mx));
      for (int64_t i = 0; i < Dh; ++i) {
        float o = 0.f;
        for (int t = 0; t <= len; ++t) o += scores[t] * load(p.dtype, p.v_cache, base + t * Dh + i);
        attn[hq * Dh + i] = o / total;
      }
    }
    for (int64_t c = 0; c < D; ++c) {
      float y = 0.f;
      for (int64_t r = 0; r < Hq * Dh; ++r) y += attn[r] * load(p.dtype, p.w_o, r * D + c);
      if (p.has_o_bias) y += load(p.dtype, p.o_bias, c);
      if (p.residual) y += load(p.dtype, p.x, b * D + c);
      store(p.dtype, p.y, b * D + c, y);
    }
  }
}

}  // namespace jax_cluster::cpu
