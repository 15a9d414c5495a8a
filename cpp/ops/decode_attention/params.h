// Split-K (flash-decoding) GQA attention of one decode step over a KV cache: the
// attention alone (optionally with the new token's RoPE and cache write: append mode),
// for steps whose projections run as XLA dots (attention_decode's impl="splitk"). No XLA
// includes here.
#pragma once

#include <cstdint>

#include "jax_cluster/types.h"
#include "ops/attention_block/params.h"  // RopeLayout

namespace jax_cluster {

inline constexpr int kDecodeAttentionMaxGroup = 8;     // query heads per KV head
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
  const int32_t* pos;           // [B]: attend over slots 0..pos[b]; outside [0, S_max): NaN
  void* out;                    // [B, Hkv, G, Dh]
  float* partial;               // workspace: decode_attention_workspace_floats(p)

  // Append mode (qkv set; decode_attention_append): the step's new token. q comes from the
  // projection output qkv [B, (Hq + 2 Hkv) Dh] (fp32, columns [Q heads | K | V]), RoPE'd at
  // pos[b] with scale applied in the kernel; k, v (RoPE'd k) are rounded to the cache dtype;
  // attention covers the pos[b] cached tokens and the new one; the merge kernel writes k, v
  // at slot pos[b] of the caches (k_cache, v_cache: the aliased outputs). Nothing is
  // written for a row whose pos is out of range. Unset: q is the given scaled query.
  const float* qkv = nullptr;
  const float* inv_freq = nullptr;  // [rotary_dim / 2]
  int64_t rotary_dim = 0;
  RopeLayout rope_layout = RopeLayout::kHalf;
  float scale = 1.f;
};

// Which split kernel streams the tokens. MHA: CUDA cores (K/V straight into registers,
// decode_attention.cu): 3.06-3.08 TB/s against 2.85 for the tensor-core kernel at batch 16,
// 32 KV heads, 4K tokens. GQA: tensor cores (K/V tiles staged by cp.async, mma.sync for
// the whole group, decode_attention_mma.cuh): 6-12% faster at G = 4, where the CUDA-core
// loop does G dot products per cache element (H100, session 22).
inline bool decode_attention_uses_tensor_cores(const DecodeAttentionParams& p) {
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

}  // namespace jax_cluster
