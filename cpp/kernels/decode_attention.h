// Split-K (flash-decoding) GQA attention of one decode step over a KV cache: the
// attention alone, for steps whose projections run as XLA dots (attention_decode's
// impl="splitk"). No XLA includes here.
#pragma once

#include <cstdint>

#include "jax_cluster/types.h"

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
};

// Per (row, KV head, split, head): o[Dh] (scaled to m), l, m (exp2 domain).
inline int64_t decode_attention_workspace_floats(const DecodeAttentionParams& p) {
  return p.batch * p.num_kv_heads * p.splits * p.group * (p.head_dim + 2);
}

}  // namespace jax_cluster
