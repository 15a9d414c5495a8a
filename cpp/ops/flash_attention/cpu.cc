#include "ops/flash_attention/cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/numerics.h"

namespace jax_cluster::cpu {

void flash_attention(const FlashAttentionParams& p) {
  const int64_t B = p.batch, H = p.heads, D = p.head_dim;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t total_keys = 0;
  for (int j = 0; j < p.num_kv; ++j) total_keys += p.kv[j].len;
  std::vector<float> q(D), scores(total_keys), o_new(D);
  for (int i = 0; i < p.num_q; ++i) {
    const FlashQChunk& c = p.q[i];
    const int64_t L = c.len;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t r = 0; r < L; ++r) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t row = ((b * L + r) * H + h) * D;  // q / o element offset
          const int64_t stat = (b * H + h) * L + r;        // lse offset
          for (int64_t d = 0; d < D; ++d) q[d] = load(p.dtype, c.q, row + d);
          // 1. the new part: scores over every key of every chunk
          float mx = neg_inf;
          int64_t n = 0;
          for (int j = 0; j < p.num_kv; ++j) {
            const FlashKVChunk& kv = p.kv[j];
            for (int64_t t = 0; t < kv.len; ++t, ++n) {
              const int64_t krow = ((b * kv.len + t) * H + h) * D;
              float s = 0.f;
              for (int64_t d = 0; d < D; ++d) s += q[d] * load(p.dtype, kv.k, krow + d);
              scores[n] = s * p.scale;
              mx = std::max(mx, scores[n]);
            }
          }
          float lse_new = neg_inf;
          std::fill(o_new.begin(), o_new.end(), 0.f);
          if (n > 0) {
            float sum = 0.f;
            n = 0;
            for (int j = 0; j < p.num_kv; ++j) {
              const FlashKVChunk& kv = p.kv[j];
              for (int64_t t = 0; t < kv.len; ++t, ++n) {
                const int64_t vrow = ((b * kv.len + t) * H + h) * D;
                const float e = std::exp(scores[n] - mx);
                sum += e;
                for (int64_t d = 0; d < D; ++d) o_new[d] += e * load(p.dtype, kv.v, vrow + d);
              }
            }
            for (float& v : o_new) v /= sum;
            lse_new = mx + std::log(sum);
          }
          // 2. merge with the incoming state (lse = -inf: empty, its o ignored)
          const bool has_state = c.lse_in != nullptr && c.lse_in[stat] > neg_inf;  // NaN: empty too
          const float lse_old = has_state ? c.lse_in[stat] : neg_inf;
          float lse = lse_new, w_old = 0.f, w_new = lse_new == neg_inf ? 0.f : 1.f;
          if (has_state && lse_new == neg_inf) {
            lse = lse_old, w_old = 1.f, w_new = 0.f;
          } else if (has_state) {
            const float hi = std::max(lse_old, lse_new), lo = std::min(lse_old, lse_new);
            lse = hi + std::log1p(std::exp(lo - hi));
            w_old = 1.f / (1.f + std::exp(lse_new - lse_old));  // sigmoid(old - new)
            w_new = 1.f / (1.f + std::exp(lse_old - lse_new));
          }
          for (int64_t d = 0; d < D; ++d) {
            float o = w_new * o_new[d];
            if (w_old != 0.f) o += w_old * c.o_in[row + d];
            if (p.finalize) {
              store(p.dtype, c.o, row + d, o);
            } else {
              static_cast<float*>(c.o)[row + d] = o;
            }
          }
          c.lse[stat] = lse;
        }
      }
    }
  }
}

}  // namespace jax_cluster::cpu
