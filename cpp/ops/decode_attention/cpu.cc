#include "ops/decode_attention/cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/numerics.h"
#include "cpu/rope.h"

namespace jax_cluster::cpu {

void decode_attention(const DecodeAttentionParams& p) {
  const int64_t G = p.group, D = p.head_dim, S = p.splits;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float log2e = 1.4426950408889634f;
  const int64_t hq = p.num_kv_heads * G, cols = (hq + 2 * p.num_kv_heads) * D;
  std::vector<float> q(D), o(D), k_new(D), v_new(D);
  auto rope = [&](float* x, int32_t at) { cpu::rope(x, at, p.inv_freq, p.rotary_dim, p.rope_layout); };
  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t length = p.lengths[b];
    const AppendSlots slots = append_slots(length, p.max_seq, p.qkv != nullptr && p.rolling);
    const bool valid = slots.valid;
    const int64_t len = slots.attended, per = (len + S - 1) / S;
    for (int64_t g = 0; g < p.num_kv_heads; ++g) {
      const int64_t bg = b * p.num_kv_heads + g, row0 = bg * p.max_seq;
      if (p.qkv != nullptr && valid) {  // the new k, v into the caches at their slot first
        const float* row = p.qkv + b * cols;
        for (int64_t d = 0; d < D; ++d) {
          k_new[d] = row[(hq + g) * D + d];
          v_new[d] = row[(hq + p.num_kv_heads + g) * D + d];
        }
        rope(k_new.data(), length);
        for (int64_t d = 0; d < D; ++d) {
          store(p.dtype, const_cast<void*>(p.k_cache), (row0 + slots.slot) * D + d, k_new[d]);
          store(p.dtype, const_cast<void*>(p.v_cache), (row0 + slots.slot) * D + d, v_new[d]);
        }
      }
      for (int64_t h = 0; h < G; ++h) {
        if (p.qkv != nullptr) {
          for (int64_t d = 0; d < D; ++d) q[d] = p.qkv[b * cols + (g * G + h) * D + d];
          rope(q.data(), valid ? length : 0);
          for (int64_t d = 0; d < D; ++d) q[d] *= p.scale * log2e;
        } else {
          for (int64_t d = 0; d < D; ++d) q[d] = load(p.dtype, p.q, (bg * G + h) * D + d) * log2e;
        }
        // Each split's state (exp2 domain), as the split kernel leaves it.
        for (int64_t s = 0; s < S; ++s) {
          float* st = p.partial + ((bg * S + s) * G + h) * (D + 2);
          const int64_t t0 = std::min(len, s * per), t1 = std::min(len, t0 + per);
          float m = neg_inf, l = 0.f;
          std::fill(o.begin(), o.end(), 0.f);
          for (int64_t t = t0; t < t1; ++t) {
            float score = 0.f;
            for (int64_t d = 0; d < D; ++d) score += q[d] * load(p.dtype, p.k_cache, (row0 + t) * D + d);
            const float mn = std::max(m, score), a = std::exp2(m - mn), w = std::exp2(score - mn);
            l = l * a + w;
            for (int64_t d = 0; d < D; ++d) o[d] = o[d] * a + w * load(p.dtype, p.v_cache, (row0 + t) * D + d);
            m = mn;
          }
          for (int64_t d = 0; d < D; ++d) st[d] = o[d];
          st[D] = l;
          st[D + 1] = m;
        }
        // The merge, in split order.
        const float* base = p.partial + (bg * S * G + h) * (D + 2);
        float m = neg_inf;
        for (int64_t s = 0; s < S; ++s) m = std::max(m, base[s * G * (D + 2) + D + 1]);
        float l = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t s = 0; s < S; ++s) {
          const float* st = base + s * G * (D + 2);
          if (st[D + 1] == neg_inf) continue;
          const float w = std::exp2(st[D + 1] - m);
          for (int64_t d = 0; d < D; ++d) o[d] += st[d] * w;
          l += st[D] * w;
        }
        for (int64_t d = 0; d < D; ++d) {
          store(p.dtype, p.out, (bg * G + h) * D + d, valid ? o[d] / l : std::nanf(""));
        }
      }
    }
  }
}

}  // namespace jax_cluster::cpu
