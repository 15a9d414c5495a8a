// mla_decode's projections at small batch: the GEMVs before and after the latent attention
// as two cluster kernels, so a batch-1 layer is four launches (project, split, merge,
// output) instead of a dozen XLA kernels (ClusterFusion's Alg. 4 dataflow).
//
//   mla_project   one cluster of kMlaClusterBlocks blocks per head and per latent column tile:
//     head h     q_h = src W_q[:, h] with K split over the cluster; the partial sums meet
//                over DSMEM (every block reads all ranks' partials in rank order: the same
//                bits everywhere); rank 0 rotates q_rope_h -> q_full[b, h, r:]; each rank
//                absorbs its share of the r rows: q_full[b, h, n] = q_nope_h . W_kv_b[n, h, :dn]
//     latent     kv = h W_kv_a (+ b), tiles of a head's width, K split the same way; each
//                tile's rank 0 writes its columns to the workspace, and the last tile to
//                finish (a counter, zeroed before the launch) writes
//                new_latent = [RMSNorm(kv[:r]) | RoPE(kv[r:])]
//     src is h = RMSNorm(x) (every block normalises its K chunk itself: the sum of squares
//     of x is its slices' sums, read over DSMEM in rank order), or, with q LoRA, the q_a
//     branch's normalised output (computed by XLA) for the heads.
//   mla_output    one cluster per head: o_h = o_lat[b, h] W_uv_h (K split, DSMEM sums), then
//     each rank multiplies o_h by its column slice of W_o's rows of head h into a per-head
//     fp32 partial; the last head to finish a column slice (a counter, zeroed before the
//     launch) sums the heads in head order, adds the bias and the residual: y.
//
// Every value is rounded where the jnp formulation (jax_cluster/ops/mla_decode.py) rounds
// to x's dtype: q, kv, the norms' products, the rotated halves, o_h, y. No float atomics:
// bitwise reproducible. Rows up to kMlaProjectMaxRows; larger batches take XLA's dots.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "jax_cluster/types.h"

namespace jax_cluster {

#ifndef JAX_CLUSTER_MLA_CLUSTER_BLOCKS
#define JAX_CLUSTER_MLA_CLUSTER_BLOCKS 8
#endif
// blocks per cluster (K split of one head); a probe build may set another (4 or 16)
inline constexpr int kMlaClusterBlocks = JAX_CLUSTER_MLA_CLUSTER_BLOCKS;
inline constexpr int kMlaProjectThreads = 256;
inline constexpr int kMlaProjectMaxRows = 8;    // rows per launch (registers: rows x 8 sums)
inline constexpr int kMlaProjectMaxCols = 1024; // columns of one cluster's GEMV (dn + dr, r + dr)

struct MlaProjectParams {
  DType dtype;                      // fp16 or bf16 (fp32: CPU only)
  int64_t batch, hidden, num_heads;
  int64_t nope, rope, rank, v_dim;  // dn, dr, r, dv
  int64_t q_in;                     // K of W_q: hidden, or q_lora_rank
  int64_t capacity;                 // rows with lengths outside [0, capacity) rotate at 0
  float eps, latent_eps, rope_factor;
  const void* x;                    // [B, hidden]
  const void* norm;                 // [hidden]
  const void* q_src;                // [B, q_in] (q LoRA), or nullptr: q from RMSNorm(x)
  const void* w_q;                  // [q_in, H (dn + dr)]
  const void* w_kv_a;               // [hidden, r + dr]
  const void* kv_a_bias;            // [r + dr] or nullptr
  const void* kv_a_norm;            // [r]
  const void* w_kv_b;               // [r, H (dn + dv)]
  const int32_t* lengths;           // [B]: the new token's position
  const float* inv_freq;            // [dr / 2]
  float* q_full;                    // [B, H, r + dr]: q_nope W_uk^T | rotated q_rope
  float* new_latent;                // [B, r + dr]
  float* kv_raw;                    // workspace: [B, r + dr]
  unsigned int* counters;           // [kMlaCounterWords]: zeroed before the launch (below)

  JAX_CLUSTER_HOST_DEVICE int64_t head_cols() const { return nope + rope; }
  JAX_CLUSTER_HOST_DEVICE int64_t latent_cols() const { return rank + rope; }
};

struct MlaOutputParams {
  DType dtype;
  int64_t batch, hidden, num_heads;
  int64_t nope, rank, v_dim;        // dn (W_kv_b's column offset of W_uv), r, dv
  const void* o_lat;                // [B, H, r]
  const void* w_kv_b;               // [r, H (dn + dv)]
  const void* w_o;                  // [H dv, hidden]
  const void* o_bias;               // [hidden] or nullptr
  const void* residual;             // [B, hidden] or nullptr
  void* y;                          // [B, hidden]
  float* partial;                   // workspace: mla_output_workspace_floats
  unsigned int* counters;           // mla_project's counters: [kMlaOutputCounter + slice], zero at launch
};

// The arrival counters of a layer's two projection kernels, one buffer that mla_project
// returns and mla_output takes (aliased in and out): [0] the latent tiles' counter of
// mla_project, then one per W_o column slice of mla_output. mla_project's launcher zeroes
// them all (zero_words, ahead of mla_project), so nothing sits between the attention
// kernels and mla_output, whose programmatic launch then overlaps the merge kernel's tail.
inline constexpr int64_t kMlaOutputCounter = 1;
inline constexpr int64_t kMlaCounterWords = kMlaOutputCounter + kMlaClusterBlocks;

// Clusters of the latent's kv_a GEMV: column tiles of a head's width.
JAX_CLUSTER_HOST_DEVICE inline int64_t mla_project_latent_tiles(const MlaProjectParams& p) {
  return (p.latent_cols() + p.head_cols() - 1) / p.head_cols();
}

// The latent's rounded kv [B, r + dr].
inline int64_t mla_project_workspace_floats(int64_t batch, int64_t latent_cols) {
  return std::max<int64_t>(1, batch * latent_cols);
}

// Columns of W_o each rank of a head's cluster owns (a multiple of 8).
JAX_CLUSTER_HOST_DEVICE inline int64_t mla_output_slice_cols(int64_t hidden) {
  const int64_t per = (hidden + kMlaClusterBlocks - 1) / kMlaClusterBlocks;
  return (per + 7) / 8 * 8;
}

// Per-head fp32 partials [H, B, hidden].
inline int64_t mla_output_workspace_floats(const MlaOutputParams& p) {
  return p.num_heads * p.batch * p.hidden;
}

// Why the projection kernels cannot run these sizes, or "" (both ops; every platform runs
// what the CPU handler runs, the GPU needs the 16-byte vectors below).
inline std::string mla_projections_check(DType dtype, int64_t batch, int64_t hidden, int64_t q_in, int64_t nope,
                                         int64_t rope, int64_t rank, int64_t v_dim, bool on_gpu) {
  if (batch < 1 || hidden < 1 || q_in < 1 || nope < 1 || rope < 0 || rope % 2 || rank < 1 || v_dim < 1) {
    return "sizes must be positive (qk_rope_head_dim even)";
  }
  if (!on_gpu) return "";
  if (dtype == DType::kF32) return "no CUDA kernel for float32 (float16 or bfloat16)";
  if (batch > kMlaProjectMaxRows) {
    return "at most " + std::to_string(kMlaProjectMaxRows) + " rows, got " + std::to_string(batch);
  }
  if (hidden % 8 || q_in % 8 || nope % 8 || rope % 8 || rank % 8 || v_dim % 8) {
    return "hidden, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank and v_head_dim must be "
           "multiples of 8";
  }
  if (nope + rope > kMlaProjectMaxCols || rank + rope > kMlaProjectMaxCols || v_dim > kMlaProjectMaxCols ||
      mla_output_slice_cols(hidden) > kMlaProjectMaxCols) {
    return "qk_nope_head_dim + qk_rope_head_dim, kv_lora_rank + qk_rope_head_dim and v_head_dim must be <= " +
           std::to_string(kMlaProjectMaxCols) + " and hidden <= " +
           std::to_string(kMlaProjectMaxCols * kMlaClusterBlocks);
  }
  return "";
}

}  // namespace jax_cluster
