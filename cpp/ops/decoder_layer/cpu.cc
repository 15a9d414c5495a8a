#include "ops/decoder_layer/cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/matmul.h"
#include "cpu/numerics.h"
#include "cpu/rope.h"
#include "ops/decode_attention/params.h"  // append_slots

namespace jax_cluster::cpu {
namespace {

// RMSNorm / LayerNorm of one fp32 row (statistics in double, as attention_block's handler).
void normalize(const DecoderLayerParams& p, const float* in, const void* w, const void* b, float* out) {
  const int64_t d = p.hidden;
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < d; ++i) {
    sum += in[i];
    sq += static_cast<double>(in[i]) * in[i];
  }
  const float mean = static_cast<float>(sum / d);
  if (p.norm == NormKind::kRms) {
    const float r = 1.f / std::sqrt(static_cast<float>(sq / d) + p.eps);
    for (int64_t i = 0; i < d; ++i) out[i] = in[i] * r * load(p.dtype, w, i);
  } else {
    const float var = std::max(static_cast<float>(sq / d) - mean * mean, 0.f);
    const float r = 1.f / std::sqrt(var + p.eps);
    for (int64_t i = 0; i < d; ++i) out[i] = (in[i] - mean) * r * load(p.dtype, w, i) + load(p.dtype, b, i);
  }
}

void add_bias(DType t, const void* bias, float* v, int64_t n) {
  if (bias == nullptr) return;
  for (int64_t i = 0; i < n; ++i) v[i] += load(t, bias, i);
}

float gelu(float v, bool tanh_form) {
  if (!tanh_form) return 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * v * (1.f + std::tanh(c * (v + 0.044715f * v * v * v)));
}

// The attention of row b (norm -> QKV -> RoPE -> cache write -> attention -> out-proj) -> a.
void attend(const DecoderLayerParams& p, int64_t b, const float* x, float* a) {
  const int64_t d = p.hidden, dh = p.head_dim, hq = p.num_q_heads, hkv = p.num_kv_heads;
  const int64_t cols = (hq + 2 * hkv) * dh, group = hq / hkv, len = p.lengths[b];
  const AppendSlots slots = append_slots(len, p.max_seq, p.rolling);  // the new token's slot
  const int64_t last = slots.attended - 1;                             // slots 0..last attended
  std::vector<float> h(d), qkv(cols, 0.f), o(hq * dh, 0.f), s(last + 1);
  normalize(p, x, p.norm_w, p.norm_b, h.data());
  matmul_accumulate(p.dtype, h.data(), 1, d, p.w_qkv, cols, qkv.data());
  add_bias(p.dtype, p.qkv_bias, qkv.data(), cols);
  for (int64_t head = 0; head < hq + hkv; ++head) {  // RoPE on the query and key heads
    rope(qkv.data() + head * dh, static_cast<int>(len), p.inv_freq, p.rotary_dim, p.rope_layout);
  }
  for (int64_t g = 0; g < hkv; ++g) {  // the new k, v into their slot, rounded
    const int64_t row = ((b * hkv + g) * p.max_seq + slots.slot) * dh;
    for (int64_t i = 0; i < dh; ++i) {
      store(p.dtype, p.k_cache, row + i, qkv[(hq + g) * dh + i]);
      store(p.dtype, p.v_cache, row + i, qkv[(hq + hkv + g) * dh + i]);
    }
  }
  for (int64_t head = 0; head < hq; ++head) {
    const int64_t g = head / group, base = (b * hkv + g) * p.max_seq * dh;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t <= last; ++t) {
      float dot = 0.f;
      for (int64_t i = 0; i < dh; ++i) dot += qkv[head * dh + i] * load(p.dtype, p.k_cache, base + t * dh + i);
      s[t] = dot * p.scale;
      m = std::max(m, s[t]);
    }
    float l = 0.f;
    for (int64_t t = 0; t <= last; ++t) {
      const float w = std::exp(s[t] - m);
      l += w;
      for (int64_t i = 0; i < dh; ++i) o[head * dh + i] += w * load(p.dtype, p.v_cache, base + t * dh + i);
    }
    for (int64_t i = 0; i < dh; ++i) o[head * dh + i] /= l;
  }
  std::fill(a, a + d, 0.f);
  matmul_accumulate(p.dtype, o.data(), 1, hq * dh, p.w_o, d, a);
  add_bias(p.dtype, p.o_bias, a, d);
}

// m = MLP(Norm'(in)).
void mlp(const DecoderLayerParams& p, const float* in, float* m) {
  const int64_t d = p.hidden, f = p.inter;
  std::vector<float> h(d), u(f, 0.f), g(f, 0.f);
  normalize(p, in, p.post_norm_w, p.post_norm_b, h.data());
  matmul_accumulate(p.dtype, h.data(), 1, d, p.w1, f, g.data());
  if (p.mlp == MlpKind::kSwiglu) {
    matmul_accumulate(p.dtype, h.data(), 1, d, p.w2, f, u.data());
    for (int64_t i = 0; i < f; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  } else {
    add_bias(p.dtype, p.b1, g.data(), f);
    for (int64_t i = 0; i < f; ++i) g[i] = gelu(g[i], p.mlp == MlpKind::kGeluTanh);
  }
  std::fill(m, m + d, 0.f);
  matmul_accumulate(p.dtype, g.data(), 1, f, p.w3, d, m);
  if (p.mlp != MlpKind::kSwiglu) add_bias(p.dtype, p.b3, m, d);
}

}  // namespace

void decoder_layer(const DecoderLayerParams& p) {
  const int64_t d = p.hidden;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x(d), a(d), h(d), m(d);
  for (int64_t b = 0; b < p.batch; ++b) {
    if (!append_slots(p.lengths[b], p.max_seq, p.rolling).valid) {  // NaN row, caches untouched
      for (int64_t i = 0; i < d; ++i) store(p.dtype, p.y, b * d + i, nan);
      continue;
    }
    for (int64_t i = 0; i < d; ++i) x[i] = load(p.dtype, p.x, b * d + i);
    attend(p, b, x.data(), a.data());
    for (int64_t i = 0; i < d; ++i) h[i] = x[i] + a[i];
    mlp(p, p.parallel_residual ? x.data() : h.data(), m.data());
    for (int64_t i = 0; i < d; ++i) store(p.dtype, p.y, b * d + i, h[i] + m[i]);
  }
}

}  // namespace jax_cluster::cpu
