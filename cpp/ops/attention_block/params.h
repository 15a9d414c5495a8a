// One decode step of a Llama-family attention block, fused (ClusterFusion
// Alg. 3): norm -> QKV projection -> RoPE -> KV-cache write -> attention over
// the cache -> output projection (+ bias, + residual). No XLA includes here.
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
// Batch rows one cluster of the batch-tiled register kernel may serve (rows_per_cluster).
inline constexpr int kAttnMaxRowsPerCluster = 16;

struct AttentionDecodeParams {
  DType dtype;  // activations, weights and caches: fp16 or bf16
  int64_t batch, hidden;         // B, D
  int64_t num_q_heads, num_kv_heads, head_dim, max_seq;  // Hq, Hkv, Dh, S_max
  int64_t rotary_dim;
  RopeLayout rope_layout;
  NormKind norm;
  float eps, scale;
  bool residual, has_qkv_bias, has_o_bias;
  int cluster_size;  // blocks per cluster: 1..8 or 16 (3, 5, 6, 7: SplitToken, R = 1 only)
  // At most this many query heads per cluster (1..8): fewer heads = more clusters per KV
  // head (each re-reads that head's K/V columns and cache) = more SMs busy for GQA at
  // small batch. A tuning knob; the chunks split the group evenly.
  int max_heads_per_cluster = kAttnMaxHeadsPerCluster;
  AttnDataflow dataflow = AttnDataflow::kSplitToken;
  AttnPipeline pipeline = AttnPipeline::kRegisters;
  // Batch rows per cluster (1, 2, 4, 8, 16): R > 1 runs the batch-tiled register kernel
  // (attention_decode_tiled.cu), which reads a KV head's weights once per tile of R rows
  // instead of once per row. 1 = one cluster per row (the original kernels).
  int rows_per_cluster = 1;

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
  // Tiles of rows_per_cluster batch rows (the last one may be partial).
  JAX_CLUSTER_HOST_DEVICE int64_t row_tiles() const {
    return (batch + rows_per_cluster - 1) / rows_per_cluster;
  }
};

// Shared memory of the batch-tiled kernel (mirrored by jax_cluster/ops/attention_decode.py,
// _tiled_shared_bytes, which rejects a configuration that does not fit before tracing).
// Regions, each 128-byte aligned:
//   A: the normalised rows h [D][R] (fp32, or the activation dtype: h_bytes_per_value),
//      then, once h is dead, the blocks' per-row
//      attention states (read by the peers), the warps' states and the normalised
//      attention output [hpc Dh][R];
//   B: the block's own Q|K|V columns for the R rows (read by the peers);
//   C: the tile's full Q|K|V [R][(hpc + 2) Dh], which also serves as the GEMVs' row-group
//      reduction scratch while it is not live.
struct TiledLayout {
  int rows, hpc, dh, n;
  int qkv_vecs, vecs_per_blk;  // 8-column vectors of the group's Q|K|V; per block (ceil)
  int state_stride;            // floats per (row, head) state: o[dh], m, l, 2 pad
  int64_t h_off, states_off, warp_off, attn_off, coef_off, slice_off, qkv_off, bytes;

  static constexpr int kRedRows = 2;  // rows per pass of the GEMV's row-group reduction
  static constexpr int kWarps = 8, kThreads = 256;

  // h in fp32, or in the activation dtype at R = 16 and where the kernel is built for two
  // blocks per SM (R = 8 with <= 2 heads per cluster and Dh % 64 == 0: fp32 would not fit
  // twice; kTiledMinBlocks in attention_decode_tiled.cuh).
  JAX_CLUSTER_HOST_DEVICE static int h_bytes_per_value(int rows, int hpc, int dh) {
    return rows >= 16 || (rows == 8 && hpc <= 2 && dh % 64 == 0) ? 2 : 4;
  }

  JAX_CLUSTER_HOST_DEVICE TiledLayout(int64_t hidden, int rows_, int hpc_, int dh_, int n_)
      : rows(rows_), hpc(hpc_), dh(dh_), n(n_) {
    qkv_vecs = (hpc + 2) * dh / 8;
    vecs_per_blk = (qkv_vecs + n - 1) / n;
    state_stride = dh + 4;
    int64_t off = 0;
    auto take = [&](int64_t b) {
      const int64_t at = off;
      off += (b + 127) / 128 * 128;
      return at;
    };
    h_off = 0;
    states_off = take(4LL * rows * hpc * state_stride);
    warp_off = take(4LL * kWarps * kAttnMaxHeadsPerCluster * (dh + 2));
    attn_off = take(4LL * hpc * dh * rows);
    coef_off = take(4LL * rows * hpc * (kMaxClusterBlocks + 1));
    const int64_t h_bytes = (hidden * rows * h_bytes_per_value(rows, hpc, dh) + 127) / 128 * 128;
    off = off > h_bytes ? off : h_bytes;
    slice_off = take(4LL * rows * vecs_per_blk * 8);
    const int64_t qkv_bytes = 4LL * rows * (hpc + 2) * dh;
    const int64_t red_bytes = 4LL * kRedRows * kThreads * 8;
    qkv_off = take(qkv_bytes > red_bytes ? qkv_bytes : red_bytes);
    bytes = off;
  }

  static constexpr int kMaxClusterBlocks = 16;
};

inline int64_t attention_decode_workspace_bytes(const AttentionDecodeParams& p) {
  return p.batch * p.num_kv_heads * p.head_chunks() * p.hidden * 4;
}

}  // namespace jax_cluster
