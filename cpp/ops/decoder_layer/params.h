// decoder_layer: one decode step of a whole Llama or GPT-NeoX decoder layer (ClusterFusion++'s
// whole-layer dataflow):
//   h = x + Attn(Norm(x))                       Attn: QKV (+ bias) -> RoPE on the first
//   y = h + MLP(Norm'(h))       sequential            rotary_dim features -> cache write at
//   y = x + Attn(Norm(x)) + MLP(Norm'(x))  parallel    lengths[b] -> attention over
//                                                     0..lengths[b] -> out-proj (+ bias)
// MLP: SwiGLU (w1 = w_gate, w2 = w_up, w3 = w_down) or GeLU (w1 = w_in + b1, w3 = w_out + b3).
// Every intermediate stays fp32; the new k, v are rounded to the cache dtype (attention reads
// the rounded values) and y once. The contract is jax_cluster.reference.decoder_layer; the
// one-launch CUDA kernel (kernel.cuh) runs what decoder_layer_cuda_check allows. No XLA includes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "jax_cluster/types.h"
#include "ops/attention_block/params.h"  // NormKind, RopeLayout, the head dims

namespace jax_cluster {

enum class MlpKind : int32_t { kSwiglu = 0, kGelu = 1, kGeluTanh = 2 };

struct DecoderLayerParams {
  DType dtype;  // activations, weights and caches (fp32: CPU only)
  int64_t batch, hidden, num_q_heads, num_kv_heads, head_dim, max_seq, inter, rotary_dim;
  RopeLayout rope_layout;
  NormKind norm;  // both norms: kRms (Llama) or kLayer (GPT-NeoX)
  MlpKind mlp;
  bool parallel_residual;
  // The caches are a sliding window's rolling buffer (slot = position % S_max): the new token
  // goes to slot lengths[b] % S_max and attends the filled slots (DecodeAttentionParams).
  bool rolling;
  float eps, scale;
  const void* x;                           // [B, D]
  const void* norm_w; const void* norm_b;  // [D] (norm_b: kLayer)
  const void* w_qkv; const void* qkv_bias; // [D, (Hq + 2 Hkv) Dh], columns [Q | K | V]; bias or null
  const void* w_o; const void* o_bias;     // [Hq Dh, D]; bias or null
  const void* post_norm_w; const void* post_norm_b;
  const void* w1; const void* w2; const void* w3;  // [D, F], [D, F] (SwiGLU only), [F, D]
  const void* b1; const void* b3;                  // GeLU biases [F], [D] or null
  const float* inv_freq;                   // [rotary_dim / 2]
  const int32_t* lengths;                  // [B]
  void* k_cache; void* v_cache;            // [B, Hkv, S_max, Dh], updated in place
  void* y;                                 // [B, D]
  float* workspace;                        // the CUDA kernel's (plan.h); unused on CPU
};

// Why p's sizes are out of the op's range (every platform), or "".
inline std::string decoder_layer_check(const DecoderLayerParams& p) {
  if (p.batch < 1 || p.hidden < 1 || p.head_dim < 1 || p.max_seq < 1 || p.inter < 1) {
    return "batch, hidden, head_dim, S_max and the MLP width must be positive";
  }
  if (p.num_q_heads < 1 || p.num_kv_heads < 1 || p.num_q_heads % p.num_kv_heads) {
    return "num_q_heads must be a positive multiple of num_kv_heads";
  }
  if (p.rotary_dim < 0 || p.rotary_dim > p.head_dim || p.rotary_dim % 2) {
    return "rotary_dim must be even and at most head_dim";
  }
  if (p.norm != NormKind::kRms && p.norm != NormKind::kLayer) return "norm must be RMSNorm or LayerNorm";
  return "";
}

inline constexpr int64_t kDecoderLayerMaxBatch = 8;  // rows: B x 8 fp32 accumulators per thread (gemv.cuh)
inline constexpr int64_t kDecoderLayerMaxGroup = 8;  // decode_attention's query heads per KV head
// Inputs a GEMV may stage over all of its K chunks: staged rows (the batch rounded up to 1, 4
// or 8) x K <= kLayerMaxChunks x kLayerStageFloats (plan.h asserts the product).
inline constexpr int64_t kDecoderLayerMaxStagedInputs = 32 * 8192;

// The input rows the kernel stages per GEMV unit: the batch rounded up to 1, 4 or 8 (its NB).
inline int64_t layer_staged_rows(int64_t batch) { return batch <= 1 ? 1 : batch <= 4 ? 4 : 8; }

// Why the one-launch CUDA kernel cannot run p, or "" (the per-op path can: auto falls back).
inline std::string decoder_layer_cuda_check(const DecoderLayerParams& p) {
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) return "the kernel runs float16 or bfloat16 only";
  if (p.batch > kDecoderLayerMaxBatch) {
    return "batch " + std::to_string(p.batch) + " > " + std::to_string(kDecoderLayerMaxBatch) + " rows";
  }
  if (!is_attention_cuda_head_dim(p.head_dim)) {
    return "head_dim " + std::to_string(p.head_dim) + " (supported: 64, 80, 96, 128, 256)";
  }
  if (p.num_q_heads / p.num_kv_heads > kDecoderLayerMaxGroup) {
    return "more than " + std::to_string(kDecoderLayerMaxGroup) + " query heads per KV head";
  }
  const int64_t staged = layer_staged_rows(p.batch);
  const int64_t o_in = p.num_q_heads * p.head_dim + (p.parallel_residual ? p.inter : 0);  // [attn | act]
  const int64_t widest = std::max({p.hidden, p.inter, o_in});
  if (staged * widest > kDecoderLayerMaxStagedInputs) {
    return "a GEMV input of " + std::to_string(widest) + " values x " + std::to_string(staged) +
           " staged rows exceeds the kernel's " + std::to_string(kDecoderLayerMaxStagedInputs) +
           " (K chunks x staging buffer)";
  }
  if (p.hidden % 8 || p.inter % 8) {
    return "hidden (" + std::to_string(p.hidden) + ") and the MLP width (" + std::to_string(p.inter) +
           ") must be multiples of 8 (16-byte weight rows)";
  }
  return "";
}

}  // namespace jax_cluster
