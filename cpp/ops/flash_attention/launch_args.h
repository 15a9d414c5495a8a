// What both flash-attention launchers (launch.cu, launch_wgmma.cu) do before their launch:
// the kernel arguments common to both, and each chunk's descriptor with its first tile.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "jax_cluster/launch.cuh"
#include "ops/flash_attention/params.h"

namespace jax_cluster {

// A query chunk in both kernels' parameters: its running state in (o_in, lse_in; null: the
// empty state) and out (o, lse), its rows, and its first block x.
struct FlashQDesc {
  const float* o_in;
  const float* lse_in;
  void* o;
  float* lse;
  int32_t len;
  int32_t tile_start;
};

// Fills args' heads, num_q, num_kv, scale_log2, finalize and kv_tiles, and
// each chunk's descriptor through fill_q(i, chunk, first q tile) and fill_kv(j, chunk, first
// KV tile) (each returning a cudaError_t); q tiles of q_rows rows, KV tiles of kv_rows.
// *q_tiles: the grid's query tiles, 0 where there is nothing to launch.
template <typename Args, typename FillQ, typename FillKV>
cudaError_t flash_launch_args(const FlashAttentionParams& p, int q_rows, int kv_rows, float scale_log2,
                              Args* args, int* q_tiles, FillQ fill_q, FillKV fill_kv) {
  args->heads = static_cast<int32_t>(p.heads);
  args->num_q = p.num_q;
  args->num_kv = p.num_kv;
  args->scale_log2 = scale_log2;
  args->finalize = p.finalize ? 1 : 0;
  int64_t q_total = 0, kv_total = 0;
  for (int i = 0; i < p.num_q; ++i) {
    const FlashQChunk& c = p.q[i];
    if (c.len > INT_MAX) return cudaErrorInvalidValue;
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(fill_q(i, c, static_cast<int32_t>(q_total)));
    q_total += (c.len + q_rows - 1) / q_rows;
  }
  for (int j = 0; j < p.num_kv; ++j) {
    const FlashKVChunk& c = p.kv[j];
    if (c.len > INT_MAX) return cudaErrorInvalidValue;
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(fill_kv(j, c, static_cast<int32_t>(kv_total)));
    kv_total += (c.len + kv_rows - 1) / kv_rows;
  }
  if (kv_total > INT_MAX || q_total > INT_MAX) return cudaErrorInvalidValue;
  args->kv_tiles = static_cast<int32_t>(kv_total);
  *q_tiles = 0;
  if (q_total == 0 || p.batch == 0 || p.heads == 0) return cudaSuccess;  // nothing to do
  if (p.heads > 65535 || p.batch > 65535) return cudaErrorInvalidConfiguration;
  *q_tiles = static_cast<int>(q_total);
  return cudaSuccess;
}

}  // namespace jax_cluster
