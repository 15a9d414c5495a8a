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

}  // namespace jax_cluster::cpu
