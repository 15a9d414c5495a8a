// RoPE on the host, shared by the CPU reference handlers (the kernels' formula: the fp32
// angle pos * inv_freq[i], rotation of pairs (i, i + half) or (2i, 2i + 1)).
#pragma once

#include <cmath>
#include <cstdint>

#include "ops/attention_block/params.h"  // RopeLayout

namespace jax_cluster::cpu {

inline void rope(float* v, int pos, const float* inv_freq, int64_t rotary_dim, RopeLayout layout) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = std::cos(angle), s = std::sin(angle);
    const int64_t i1 = layout == RopeLayout::kHalf ? i : 2 * i;
    const int64_t i2 = layout == RopeLayout::kHalf ? i + half : 2 * i + 1;
    const float x1 = v[i1], x2 = v[i2];
    v[i1] = x1 * c - x2 * s;
    v[i2] = x2 * c + x1 * s;
  }
}

}  // namespace jax_cluster::cpu
