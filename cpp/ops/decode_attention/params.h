// Split-K (flash-decoding) GQA attention of one decode step over a KV cache: the attention
// alone (optionally with the new token's RoPE and cache write: append mode), for steps whose
// projections run elsewhere (attention_block's split_k kernel). No XLA includes here.
#pragma once

#include <cstdint>
#include <string>

#include "jax_cluster/types.h"
#include "ops/attention_block/params.h"  // RopeLayout

namespace jax_cluster {

inline constexpr int kDecodeAttentionMaxGroup = 8;      // query heads per KV head
inline constexpr int kDecodeAttentionMaxSplits = 1024;  // token splits per (row, KV head)

struct DecodeAttentionParams {
  DType dtype;                  // q, caches and out: fp16 or bf16 (fp32: CPU only)
  int64_t batch, num_kv_heads;  // B, Hkv
  int64_t group, head_dim;      // G query heads per KV head, Dh
  int64_t max_seq;              // S_max
  int64_t splits;               // blocks per (row, KV head), each a slice of the tokens
  const void* q;                // [B, Hkv, G, Dh], already scaled (softmax(q . k))
  const void* k_cache;          // [B, Hkv, S_max, Dh]
  const void* v_cache;
  // [B]: tokens cached before this step; the step's token is at slot lengths[b] and the
  // attention covers slots 0..lengths[b]. Outside [0, S_max): the row's output is NaN.
  const int32_t* lengths;
  void* out;                    // [B, Hkv, G, Dh]
  float* out_f32 = nullptr;     // set: out in fp32 here instead (decoder_layer's one launch)
  float* partial;               // workspace: decode_attention_workspace_floats(p)

  // Append mode (qkv set; decode_attention_append): the step's new token. q comes from the
  // projection output qkv [B, (Hq + 2 Hkv) Dh] (fp32, columns [Q heads | K | V]), RoPE'd at
  // lengths[b] with scale applied in the kernel; k, v (RoPE'd k) are rounded to the cache
  // dtype; attention covers the lengths[b] cached tokens and the new one; the merge kernel
  // writes k, v at slot lengths[b] of the caches (k_cache, v_cache: the aliased outputs).
  // Nothing is written for a row whose length is out of range. Unset: q is the given
  // scaled query.
  const float* qkv = nullptr;
  const float* inv_freq = nullptr;  // [rotary_dim / 2]
  int64_t rotary_dim = 0;
  RopeLayout rope_layout = RopeLayout::kHalf;
  float scale = 1.f;
  // Append mode over a sliding window's rolling buffer (slot = position % S_max, the caches
  // holding exactly the window once full): the new token, RoPE'd at position lengths[b], goes
  // to slot lengths[b] % S_max and the attention covers the min(lengths[b], S_max - 1) + 1
  // filled slots with the new token in place of the slot's old one. Any length >= 0 is valid.
  bool rolling = false;
};

// Append mode: the slot the new token of a row at position `length` goes to, the slots
// attended (the new token's included) and whether the length is valid.
struct AppendSlots {
  int64_t slot, attended;
  bool valid;
};
JAX_CLUSTER_HOST_DEVICE inline AppendSlots append_slots(int64_t length, int64_t max_seq, bool rolling) {
  if (!rolling) {
    const bool valid = length >= 0 && length < max_seq;
    return {length, valid ? length + 1 : 0, valid};
  }
  if (length < 0) return {0, 0, false};
  return {length % max_seq, length < max_seq ? length + 1 : max_seq, true};
}

// Which split kernel streams the tokens: MHA on CUDA cores (K/V straight into registers),
// GQA on tensor cores (mma.sync for the whole group), where the CUDA-core loop would do G
// dot products per cache element (measurements: docs/decode_attention.md).
JAX_CLUSTER_HOST_DEVICE inline bool decode_attention_uses_tensor_cores(const DecodeAttentionParams& p) {
  return p.group >= 2;
}

// Per (row, KV head, split, head): o[Dh] (scaled to m), l, m (exp2 domain); then per (row,
// KV head) the new token's k, v (append mode), which the merge kernel writes to the caches.
JAX_CLUSTER_HOST_DEVICE inline int64_t decode_attention_partial_floats(const DecodeAttentionParams& p) {
  return p.batch * p.num_kv_heads * p.splits * p.group * (p.head_dim + 2);
}
inline int64_t decode_attention_workspace_floats(const DecodeAttentionParams& p) {
  return decode_attention_partial_floats(p) + p.batch * p.num_kv_heads * 2 * p.head_dim;
}

// Why p's sizes are out of the op's range (every platform), or "".
inline std::string decode_attention_check(const DecodeAttentionParams& p) {
  if (p.splits < 1 || p.splits > kDecodeAttentionMaxSplits) {
    return "splits must be in 1.." + std::to_string(kDecodeAttentionMaxSplits) + ", got " +
           std::to_string(p.splits);
  }
  if (p.group < 1 || p.group > kDecodeAttentionMaxGroup) {
    return "at most " + std::to_string(kDecodeAttentionMaxGroup) + " query heads per KV head, got " +
           std::to_string(p.group);
  }
  if (p.qkv != nullptr && (p.rotary_dim < 0 || p.rotary_dim > p.head_dim || p.rotary_dim % 2)) {
    return "rotary_dim (" + std::to_string(p.rotary_dim) + ") must be even and <= head_dim (" +
           std::to_string(p.head_dim) + ")";
  }
  return "";
}

// Why the CUDA kernels cannot run p, or "".
inline std::string decode_attention_cuda_check(const DecodeAttentionParams& p) {
  if (!is_attention_cuda_head_dim(p.head_dim) || p.dtype == DType::kF32) {
    return "no CUDA kernel for head_dim=" + std::to_string(p.head_dim) + ", dtype " +
           (p.dtype == DType::kF32 ? "float32" : "16-bit") +
           " (supported: head_dim 64, 80, 96, 128 or 256; float16 or bfloat16)";
  }
  return "";
}

}  // namespace jax_cluster
