// attention_block's launch plan, in one place: the kernels' shared-memory layouts (which
// the kernels carve with and the launcher sizes with), the grid, the workspace, and the
// checks a configuration must pass. Host-safe: the CPU module's plan.cc exposes it to Python
// (jax_cluster._extension.plans().attention_block), so nothing of it is written twice.
#pragma once

#include <cstdint>
#include <string>

#include "jax_cluster/types.h"
#include "ops/attention_block/params.h"

namespace jax_cluster {

// Threads of the plain (not warp-specialised) kernels: SplitHead, and SplitToken with
// pipeline registers.
inline constexpr int kBlockThreads = 256;
inline constexpr int kBlockWarps = kBlockThreads / 32;
inline constexpr int kMaxH = kAttnMaxHeadsPerCluster;
inline constexpr int kOutTileCols = 64;  // W_o / output columns are split over a cluster in these

// The TMA pipeline: 7 consumer warps and a producer warp, a ring of 16 KB stages. (8 warps in
// all: Hopper places a block's warps round-robin on the SM's 4 register-file quarters, so a
// 9th warp would cut every warp's registers to 168 at one block per SM, 96 at two.)
inline constexpr int kConsumerWarps = 7;
inline constexpr int kConsumerThreads = kConsumerWarps * 32;
inline constexpr int kStreamThreads = kConsumerThreads + 32;  // + the producer warp
inline constexpr int kStageBytes = 16 * 1024;
inline constexpr int kMaxStages = 8;
inline constexpr int kQkvBoxRows = 64;  // W_qkv rows per box; D is a multiple of 64
// Whether the TMA pipeline's W_qkv box of head_dim 16-bit columns fits one ring stage (it
// does up to 128; the box is one stage's whole load).
constexpr bool tma_qkv_box_fits_stage(int64_t head_dim) {
  return kQkvBoxRows * head_dim * 2 <= kStageBytes;
}
// W_o rows per box at most: a [rows, 64] 16-bit box within a stage.
inline constexpr int kMaxOutBoxRows = kStageBytes / (kOutTileCols * 2);

inline constexpr int kSplitHeadReduceFloats = 1024;  // one SplitHead ClusterReduce call

// Bytes of a block's shared memory kept for its static __shared__ variables (barriers, the
// norm's statistics, the ring: at most 1.4 KB) beside the dynamic carve-up.
inline constexpr int64_t kAttnStaticSharedBytes = 2048;

// Register arrays are sized for the heads a cluster serves, rounded up to 1, 2, 4 or 8.
JAX_CLUSTER_HOST_DEVICE constexpr int attention_heads_bucket(int64_t hpc) {
  return hpc == 1 ? 1 : hpc == 2 ? 2 : hpc <= 4 ? 4 : 8;
}

// Blocks per SM the SplitToken kernels are built for: 2 where ptxas fits them without
// spills (lets clusters of 8 and 16 find enough SMs: at one block per SM an H100 keeps
// only 7 clusters of 16 resident), else 1.
JAX_CLUSTER_HOST_DEVICE constexpr int attention_min_blocks_per_sm(int dh, int mh) {
  return mh <= 4 && dh % 64 == 0 ? 2 : 1;
}

// One block's attention state, as the blocks of a cluster exchange it: o[hpc * DH] (scaled
// to the block's max), l[kMaxH], m[kMaxH] (fp32; heads >= hpc: l = 0, m = -inf).
struct BlockStateLayout {
  int l_off, m_off, floats;  // floats: a multiple of 4 (whole 16-byte vectors)
  JAX_CLUSTER_HOST_DEVICE BlockStateLayout(int hpc, int dh)
      : l_off(hpc * dh), m_off(hpc * dh + kMaxH), floats(hpc * dh + 2 * kMaxH) {}
};

// Shared memory of the register-pipeline SplitToken kernel.
struct RegistersLayout {
  int hpc, dh, n;
  int qkv_vecs;      // 8-column vectors of the group's Q|K|V columns
  int vecs_per_blk;  // their share per block (ceil)
  int state_floats;  // one block's attention state: BlockStateLayout
  int64_t h_off, states_off, qkv_off, red_off, warp_off, attn_off, bytes;

  JAX_CLUSTER_HOST_DEVICE RegistersLayout(int hidden, int hpc_, int dh_, int n_)
      : hpc(hpc_), dh(dh_), n(n_) {
    qkv_vecs = (hpc + 2) * dh / 8;
    vecs_per_blk = (qkv_vecs + n - 1) / n;
    state_floats = BlockStateLayout(hpc, dh).floats;
    int64_t off = 0;
    auto take = [&](int64_t bytes) {
      int64_t at = off;
      off += (bytes + 127) / 128 * 128;
      return at;
    };
    // The normalised input h and the gathered block states share a region: h is dead once
    // this block's QKV columns are projected, and no peer sends its state before the QKV
    // gather, which needs those columns.
    const int64_t states_bytes = 4LL * state_floats * n;
    h_off = states_off = take(4LL * hidden > states_bytes ? 4LL * hidden : states_bytes);
    qkv_off = take(32LL * vecs_per_blk * n);  // gathered Q|K|V, fp32, natural column order
    red_off = take(4LL * kBlockThreads * 8);  // GEMV partial sums across row groups
    warp_off = take(4LL * kBlockWarps * kMaxH * (dh + 2));
    attn_off = take(4LL * hpc * dh);  // the cluster's attention output, normalised
    bytes = off;
  }
};

// Shared memory of the TMA-pipeline SplitToken kernel. Stages first (TMA destinations,
// aligned); then the collectives' buffers; then scratch that phase 2 (h, row-group
// partials) and phases 3-4 (warp states, W_o partials) use in turn (local data only: never
// a buffer that a peer writes into).
struct StreamLayout {
  int qkv_floats, state_floats, groups;
  int64_t qkv_off, qkv_recv_off, states_off;
  int64_t h_off, red_off, warp_off, ored_off, attn_off, fixed, bytes;

  JAX_CLUSTER_HOST_DEVICE StreamLayout(int hidden, int hpc, int dh, int mh, int n, int stages) {
    const int rounds = cluster_exchange_slots(n);  // receive slots of the collectives
    qkv_floats = (hpc + 2) * dh;
    state_floats = BlockStateLayout(hpc, dh).floats;
    groups = kConsumerThreads / (dh / 8);  // row groups of the QKV GEMV
    int64_t off = static_cast<int64_t>(stages) * kStageBytes;
    auto take = [&](int64_t bytes) {
      const int64_t at = off;
      off += (bytes + 127) / 128 * 128;
      return at;
    };
    qkv_off = take(4LL * qkv_floats);
    qkv_recv_off = take(4LL * qkv_floats * rounds);
    states_off = take(4LL * state_floats * n);  // every block's attention state (gathered)
    const int64_t local = off;
    h_off = take(4LL * hidden);
    red_off = take(4LL * groups * dh);
    const int64_t phase2_end = off;
    off = local;
    warp_off = take(4LL * kConsumerWarps * mh * (dh + 2));
    ored_off = take(4LL * 2 * kConsumerWarps * kOutTileCols);
    attn_off = take(4LL * hpc * dh);
    off = off > phase2_end ? off : phase2_end;
    bytes = off;
    fixed = bytes - static_cast<int64_t>(stages) * kStageBytes;
  }
};

// Shared memory of the SplitHead kernel.
struct SplitHeadLayout {
  int hpc, dh, n, w, wv, tokens;  // tokens per chunk: kSplitHeadReduceFloats / MH
  int qkv_vecs, vecs_per_blk;
  int64_t h_off, qkv_off, red_off, scores_off, recv_off, stats_off, attn_off, bytes;

  JAX_CLUSTER_HOST_DEVICE SplitHeadLayout(int hidden, int hpc_, int dh_, int n_, int mh)
      : hpc(hpc_), dh(dh_), n(n_) {
    const int rounds = cluster_exchange_slots(n);  // receive slots of the collectives
    w = dh / n;
    wv = w / 8;
    tokens = kSplitHeadReduceFloats / mh;
    qkv_vecs = (hpc + 2) * dh / 8;
    vecs_per_blk = (qkv_vecs + n - 1) / n;
    int64_t off = 0;
    auto take = [&](int64_t bytes) {
      int64_t at = off;
      off += (bytes + 127) / 128 * 128;
      return at;
    };
    h_off = take(4LL * hidden);  // normalised x, later the partial output row
    qkv_off = take(32LL * vecs_per_blk * n);
    red_off = take(4LL * kBlockThreads * 8);  // block_gemv; then the P x V partials of one head
    scores_off = take(4LL * kSplitHeadReduceFloats);
    recv_off = take(4LL * kSplitHeadReduceFloats * rounds);
    stats_off = take(4LL * 4 * kAttnMaxHeadsPerCluster);  // m, l, rescale, chunk max
    attn_off = take(4LL * kAttnMaxHeadsPerCluster * dh);  // this block's dims of o
    bytes = off;
  }
};

// The TMA ring's stages: as many as kMaxStages and the shared memory of the blocks built to
// share an SM allow; < 2 when the rest of the layout leaves no room for a ring.
inline int attention_tma_stages(int hidden, int hpc, int dh, int mh, int n) {
  const int64_t budget =
      (kMaxSharedBytesPerBlock + 1024) / attention_min_blocks_per_sm(dh, mh) - kAttnStaticSharedBytes;
  const StreamLayout none(hidden, hpc, dh, mh, n, 0);
  const int64_t stages = (budget - none.fixed) / kStageBytes;
  return static_cast<int>(stages < kMaxStages ? stages : kMaxStages);
}

// What a launch of p runs: the grid, the block's threads and shared memory, the workspace.
struct AttentionBlockPlan {
  int64_t heads_per_cluster, head_chunks, clusters;
  int heads_bucket;        // MH: the register arrays' head count (attention_heads_bucket)
  int threads;             // per block
  int stages;              // TMA ring stages (pipeline tma), else 0
  int64_t shared_bytes;    // dynamic shared memory per block
  int64_t workspace_bytes;
};

inline AttentionBlockPlan attention_block_plan(const AttentionBlockParams& p) {
  AttentionBlockPlan plan{};
  plan.heads_per_cluster = p.heads_per_cluster();
  plan.head_chunks = p.head_chunks();
  plan.clusters = p.batch * p.num_kv_heads * plan.head_chunks;
  plan.heads_bucket = attention_heads_bucket(plan.heads_per_cluster);
  plan.workspace_bytes = attention_block_workspace_bytes(p);
  const int hidden = static_cast<int>(p.hidden), hpc = static_cast<int>(plan.heads_per_cluster);
  const int dh = static_cast<int>(p.head_dim), n = p.cluster_size;
  if (p.dataflow == AttnDataflow::kSplitHead) {
    plan.threads = kBlockThreads;
    plan.shared_bytes = SplitHeadLayout(hidden, hpc, dh, n, plan.heads_bucket).bytes;
  } else if (p.pipeline == AttnPipeline::kTma) {
    plan.threads = kStreamThreads;
    plan.stages = attention_tma_stages(hidden, hpc, dh, plan.heads_bucket, n);
    plan.shared_bytes = StreamLayout(hidden, hpc, dh, plan.heads_bucket, n, plan.stages).bytes;
  } else {
    plan.threads = kBlockThreads;
    plan.shared_bytes = RegistersLayout(hidden, hpc, dh, n).bytes;
  }
  return plan;
}

// Why p's attributes do not describe a valid step and launch configuration, or "" (every
// platform: the FFI handlers and Python's validation report it).
inline std::string attention_block_check(const AttentionBlockParams& p) {
  if (p.num_kv_heads < 1 || p.num_q_heads < 1 || p.num_q_heads % p.num_kv_heads) {
    return "num_q_heads (" + std::to_string(p.num_q_heads) + ") must be a multiple of num_kv_heads (" +
           std::to_string(p.num_kv_heads) + ")";
  }
  if (p.rotary_dim < 0 || p.rotary_dim > p.head_dim || p.rotary_dim % 2) {
    return "rotary_dim (" + std::to_string(p.rotary_dim) + ") must be even and <= head_dim (" +
           std::to_string(p.head_dim) + ")";
  }
  if (p.max_heads_per_cluster < 1 || p.max_heads_per_cluster > kAttnMaxHeadsPerCluster) {
    return "heads_per_cluster must be in 1.." + std::to_string(kAttnMaxHeadsPerCluster);
  }
  if (!is_valid_cluster_size(p.cluster_size)) return "cluster_size must be 1..8 or 16";
  if (p.dataflow != AttnDataflow::kSplitToken && p.dataflow != AttnDataflow::kSplitHead) {
    return "dataflow must be split_token or split_head";
  }
  if (p.pipeline != AttnPipeline::kRegisters && p.pipeline != AttnPipeline::kTma) {
    return "pipeline must be registers or tma";
  }
  if (p.dataflow == AttnDataflow::kSplitHead) {
    if (p.pipeline != AttnPipeline::kRegisters) return "pipeline tma is a split_token pipeline";
    if (!is_pow2_cluster_size(p.cluster_size)) {
      return "cluster_size " + std::to_string(p.cluster_size) +
             " (not a power of two) is for dataflow split_token only";
    }
    if (p.head_dim % (8 * p.cluster_size)) {
      return "dataflow split_head needs head_dim (" + std::to_string(p.head_dim) +
             ") divisible by 8 * cluster_size (" + std::to_string(p.cluster_size) + ")";
    }
  }
  return "";
}

// Why the CUDA kernels cannot run p (a valid step: attention_block_check), or "".
inline std::string attention_block_cuda_check(const AttentionBlockParams& p) {
  if (!is_attention_cuda_head_dim(p.head_dim) || p.hidden % 64 || p.dtype == DType::kF32) {
    return "no CUDA kernel for head_dim=" + std::to_string(p.head_dim) + ", hidden=" +
           std::to_string(p.hidden) + ", dtype " + (p.dtype == DType::kF32 ? "float32" : "16-bit") +
           " (supported: head_dim 64, 80, 96, 128 or 256, hidden % 64 == 0, float16 or bfloat16)";
  }
  if (p.pipeline == AttnPipeline::kTma && p.dataflow == AttnDataflow::kSplitToken &&
      !tma_qkv_box_fits_stage(p.head_dim)) {
    return "pipeline tma: head_dim " + std::to_string(p.head_dim) + "'s W_qkv box (" +
           std::to_string(kQkvBoxRows) + " rows) is larger than a ring stage (" +
           std::to_string(kStageBytes / 1024) + " KB)";
  }
  const AttentionBlockPlan plan = attention_block_plan(p);
  if (p.pipeline == AttnPipeline::kTma && p.dataflow == AttnDataflow::kSplitToken && plan.stages < 2) {
    return "pipeline tma: hidden=" + std::to_string(p.hidden) +
           " leaves no shared memory for a ring of two stages";
  }
  if (plan.shared_bytes > kMaxSharedBytesPerBlock - kAttnStaticSharedBytes) {
    return "this configuration needs " + std::to_string(plan.shared_bytes) +
           " bytes of shared memory per block, more than the " +
           std::to_string(kMaxSharedBytesPerBlock - kAttnStaticSharedBytes) + " a block has";
  }
  return "";
}

}  // namespace jax_cluster
