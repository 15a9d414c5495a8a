// One decode step of a Llama-family attention block, fused (ClusterFusion Alg. 3):
// norm -> QKV projection -> RoPE -> KV-cache write -> attention over the cache -> output
// projection (+ bias, + residual). No XLA includes here.
#pragma once

#include <cstdint>

#include "jax_cluster/types.h"

namespace jax_cluster {

enum class NormKind : int32_t { kNone = 0, kRms = 1, kLayer = 2 };
enum class RopeLayout : int32_t { kHalf = 0, kInterleaved = 1 };
// How a cluster's blocks share the attention: by tokens (the main kernel) or by head
// dimension (ClusterFusion's SplitHead alternative; needs Dh % (8 N) == 0).
enum class AttnDataflow : int32_t { kSplitToken = 0, kSplitHead = 1 };
// How SplitToken streams weights and KV: straight into registers (every thread loads and
// computes), or through a TMA/mbarrier ring of shared-memory stages fed by a producer warp.
enum class AttnPipeline : int32_t { kRegisters = 0, kTma = 1 };

inline constexpr int kAttnMaxHeadsPerCluster = 8;  // query heads one cluster serves

// Head dims with CUDA kernels (attention_block's, decode_attention's and decoder_layer's).
inline constexpr int kAttnCudaHeadDims[] = {64, 80, 96, 128, 256};
inline bool is_attention_cuda_head_dim(int64_t dh) {
  for (int d : kAttnCudaHeadDims) {
    if (dh == d) return true;
  }
  return false;
}

struct AttentionBlockParams {
  DType dtype;  // activations, weights and caches: fp16 or bf16 (fp32: CPU only)
  int64_t batch, hidden;         // B, D
  int64_t num_q_heads, num_kv_heads, head_dim, max_seq;  // Hq, Hkv, Dh, S_max
  int64_t rotary_dim;
  RopeLayout rope_layout;
  NormKind norm;
  float eps, scale;
  bool residual, has_qkv_bias, has_o_bias;
  int cluster_size;  // blocks per cluster: 1..8 or 16 (3, 5, 6, 7: SplitToken only)
  // At most this many query heads per cluster (1..8): fewer heads = more clusters per KV
  // head (each re-reads that head's K/V columns and cache) = more SMs busy for GQA at
  // small batch. A tuning knob; the chunks split the group evenly.
  int max_heads_per_cluster = kAttnMaxHeadsPerCluster;
  AttnDataflow dataflow = AttnDataflow::kSplitToken;
  AttnPipeline pipeline = AttnPipeline::kRegisters;

  const void* x;          // [B, D]
  const void* norm_w;     // [D] (norm != kNone)
  const void* norm_b;     // [D] (norm == kLayer)
  const void* w_qkv;      // [D, (Hq + 2 Hkv) Dh], columns [Q heads | K heads | V heads]
  const void* qkv_bias;   // [(Hq + 2 Hkv) Dh]
  const void* w_o;        // [Hq Dh, D]
  const void* o_bias;     // [D]
  const float* inv_freq;  // [rotary_dim / 2]
  const int32_t* lengths; // [B]: tokens already cached; the new token goes at lengths[b]
  void* k_cache;          // [B, Hkv, S_max, Dh], updated in place
  void* v_cache;
  void* y;                // [B, D]
  float* partial;         // workspace [B, Hkv * head_chunks, D]: per-cluster output partials

  // Query heads per KV head, and how they are split over clusters.
  JAX_CLUSTER_HOST_DEVICE int64_t group() const { return num_q_heads / num_kv_heads; }
  JAX_CLUSTER_HOST_DEVICE int64_t head_chunks() const {
    int64_t c = (group() + max_heads_per_cluster - 1) / max_heads_per_cluster;
    while (group() % c) ++c;
    return c;
  }
  JAX_CLUSTER_HOST_DEVICE int64_t heads_per_cluster() const { return group() / head_chunks(); }
};

inline int64_t attention_block_workspace_bytes(const AttentionBlockParams& p) {
  return p.batch * p.num_kv_heads * p.head_chunks() * p.hidden * 4;
}

}  // namespace jax_cluster
