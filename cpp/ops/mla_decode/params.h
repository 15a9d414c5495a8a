// mla_decode's latent attention: DeepSeek-V2's absorbed multi-head latent attention (MLA)
// for one decode step, over a latent cache that every head shares.
//
//   row b, head h:  s_h(t) = scale * (q[b, h] . cache[b, t])      t = 0..lengths[b]
//                   out[b, h] = sum_t softmax(s_h)(t) * cache[b, t, :r]
//
// Each cached token is E = r + dr features: the normalised compressed KV c (r =
// kv_lora_rank) followed by the shared rotary key k_rope (dr = qk_rope_head_dim). q holds,
// per head, q_nope already absorbed through W_uk (r features) and the rotated q_rope (dr):
// so keys are the whole token, values its first r features, and the cache is read once for
// all heads. The step's own token (new_latent: [c | rotated k_rope]) is rounded to the
// cache dtype, written at slot lengths[b] and attended like the others. The projections
// around it (q, kv_a, W_uk, W_uv, W_o) are projections.h's kernels or XLA's dots
// (jax_cluster/ops/mla_decode.py).
//
// The cache is contiguous [B, S_max, E], or paged: a pool [num_pages, page_size, E] and a
// block table [B, max_blocks] (slot t of row b is page block_table[b, t / page_size],
// offset t % page_size). A row whose lengths[b] is outside [0, capacity), or one of whose
// used blocks (0..lengths[b] / page_size) names a page outside the pool, gets NaN and
// writes nothing. No XLA includes here.
#pragma once

#include <cstdint>
#include <string>

#include "jax_cluster/types.h"

namespace jax_cluster {

inline constexpr int kMlaDecodeMaxSplits = 256;    // token splits per (row, head tile)
inline constexpr int kMlaDecodeMaxRank = 512;      // r on the GPU (the CPU handler: any)
inline constexpr int kMlaDecodeMaxRopeDim = 64;    // dr on the GPU
inline constexpr int kMlaDecodeHeadTile = 16;      // heads per block (the mma M dimension)
inline constexpr int kMlaDecodeTileTokens = 32;    // cache tokens per pipeline stage

struct MlaDecodeParams {
  DType dtype;                      // cache and out: fp16 or bf16 (fp32: CPU only)
  int64_t batch, num_heads;         // B, H
  int64_t rank, rope_dim;           // r, dr (E = r + dr)
  int64_t splits;                   // blocks per (row, head tile), each a slice of the tokens
  bool paged = false;
  int64_t capacity;                 // S_max, or max_blocks * page_size
  int64_t page_size = 0, max_blocks = 0, num_pages = 0;  // paged only
  float scale = 1.f;                // multiplies q . cache (YaRN's mscale folded in)
  const float* q;                   // [B, H, E] float32
  const float* new_latent;          // [B, E] float32
  void* cache;                      // contiguous or the page pool (aliased to the result)
  const int32_t* block_table = nullptr;  // [B, max_blocks] (paged)
  const int32_t* lengths;           // [B]: tokens cached before this step
  void* out;                        // [B, H, r]
  float* partial;                   // workspace: mla_decode_workspace_floats(p)

  int64_t latent_dim() const { return rank + rope_dim; }
};

// Per (row, head, split): o[r] (scaled to m), m (exp2 domain), l. None with one split (the
// split kernel normalises and writes out itself).
inline int64_t mla_decode_workspace_floats(const MlaDecodeParams& p) {
  return p.splits > 1 ? p.batch * p.num_heads * p.splits * (p.rank + 2) : 0;
}

// Why p's sizes are out of the op's range (every platform), or "".
inline std::string mla_decode_check(const MlaDecodeParams& p) {
  if (p.batch < 1 || p.num_heads < 1 || p.rank < 1 || p.rope_dim < 0 || p.capacity < 1) {
    return "batch, num_heads, kv_lora_rank and the cache capacity must be positive and "
           "qk_rope_head_dim non-negative";
  }
  if (p.splits < 1 || p.splits > kMlaDecodeMaxSplits) {
    return "splits must be in 1.." + std::to_string(kMlaDecodeMaxSplits) + ", got " +
           std::to_string(p.splits);
  }
  if (p.paged && (p.page_size < 1 || p.max_blocks < 1 || p.num_pages < 1)) {
    return "a paged cache needs page_size, max_blocks and num_pages >= 1";
  }
  return "";
}

// The padded rank the CUDA kernel is instantiated for (r <= it), or 0.
inline int mla_decode_kernel_rank(int64_t rank) {
  if (rank <= 128) return 128;
  if (rank <= kMlaDecodeMaxRank) return kMlaDecodeMaxRank;
  return 0;
}

// Why the CUDA kernels cannot run p, or "".
inline std::string mla_decode_cuda_check(const MlaDecodeParams& p) {
  if (p.dtype == DType::kF32) return "no CUDA kernel for float32 (float16 or bfloat16)";
  if (mla_decode_kernel_rank(p.rank) == 0 || p.rank % 8 || p.rope_dim % 8 ||
      p.rope_dim > kMlaDecodeMaxRopeDim) {
    return "no CUDA kernel for kv_lora_rank=" + std::to_string(p.rank) + ", qk_rope_head_dim=" +
           std::to_string(p.rope_dim) + " (kv_lora_rank <= " + std::to_string(kMlaDecodeMaxRank) +
           " and qk_rope_head_dim <= " + std::to_string(kMlaDecodeMaxRopeDim) +
           ", both multiples of 8)";
  }
  return "";
}

}  // namespace jax_cluster
