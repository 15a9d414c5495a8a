// SwiGLU MLP (DeepFusionKernel): y = (silu(x @ w_gate) * (x @ w_up)) @ w_down (+ residual),
// x [M, D], w_gate/w_up [D, F], w_down [F, D]; without w_down the op returns the
// activation A2 = silu(x @ w_gate) * (x @ w_up), [M, F]. fp16/bf16, fp32 accumulation,
// A2 rounded to the activation dtype (it feeds a 16-bit tensor-core GEMM).
//
// Variants (all deterministic; no floating-point atomics; docs/swiglu.md has the findings):
//  * kTma (any M; launch_tma.cu): each GEMM (up: x @ [w_gate | w_up] -> SiLU * mul -> A2;
//    down: A2 @ w_down + residual -> y) is ONE persistent stream-K kernel of at most one
//    block per SM, fed by the bulk tensor copy engine: a producer warp streams 64 x 64
//    128B-swizzled weight boxes and the x / A2 box into a ring of shared-memory stages,
//    8 consumer warps run mma.sync. Equal shares of the (work tile, K block) units per
//    block; a split tile is summed in block order by the blocks whose ranges end in it.
//    With one row group and few down tiles the down GEMM runs in clusters that sum their
//    partials over DSMEM. The down kernel launches programmatically (PDL).
//  * kGemv (M <= 16; launch_gemv.cu): no shared-memory staging of weights: each thread
//    streams 16-byte weight vectors into registers, byte-permuted into mma.sync fragments
//    of the transposed weights with x as the other operand. A block owns a 128-column tile
//    (gate AND up for the up GEMM) and one of `k_splits` K chunks; the chunks' fp32
//    partials meet in the workspace and the tile's last block sums them in chunk order.
//  * kFused (launch.cu; DeepFusionKernel's single deeply fused kernel, with w_down only):
//    ONE persistent cluster kernel, A2 never reaches global memory. Cluster c owns a range
//    of 64-column F tiles, processed in groups of `f_group` tiles; its blocks split D for
//    the gate/up GEMMs, reduce-scatter the partials over DSMEM (fixed rank order), apply
//    SiLU*mul to their piece and all-gather A2; block r multiplies A2 by its columns of
//    w_down; the last cluster to finish a column range sums every cluster's partial in
//    cluster order. Slower than kTma at every measured shape: kept as the paper's method.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "jax_cluster/types.h"

namespace jax_cluster {

enum class SwigluVariant : int32_t { kTma = 0, kGemv = 1, kFused = 2 };

inline constexpr int64_t kSwigluAlign = 64;  // D and F must be multiples of this

// Fused kernel: a cp.async stage is B = 64 K-rows x 128 columns (plus the A rows).
inline constexpr int64_t kSwigluStageB = 64 * 128 * 2;  // bytes of one B stage [64][128]
inline constexpr int kSwigluMaxStages = 8;
// Shared-memory budgets of a fused block: two blocks per SM, or one.
inline constexpr int64_t kSwigluSmemBudget2 = 112 * 1024;
inline constexpr int64_t kSwigluSmemBudget1 = 220 * 1024;
static_assert(kSwigluSmemBudget1 <= kMaxSharedBytesPerBlock, "the one-block budget fits a block");
inline constexpr int64_t kSwigluFusedMaxRows = 64;  // larger M runs in chunks of this many rows
inline constexpr int64_t kSwigluCounterBytes = 64;  // fused workspace: one counter per rank

// Gemv: rows of x per call (larger M runs in chunks), columns per block, x chunk bytes.
inline constexpr int64_t kSwigluGemvMaxRows = 16;
inline constexpr int64_t kSwigluGemvCols = 128;
inline constexpr int64_t kSwigluGemvXBytes = 64 * 1024;

// Tma: work tiles of 128 F columns (of w_gate AND of w_up) for the up GEMM and 256 D
// columns for the down GEMM: each weight row segment a block streams is 256 or 512
// contiguous bytes (narrower segments, read at other times by other blocks, cost DRAM
// bandwidth). Partial slots of 256 fp32 columns.
inline constexpr int64_t kSwigluTmaUpCols = 128;
inline constexpr int64_t kSwigluTmaDownCols = 256;
inline constexpr int64_t kSwigluTmaSlotCols = 256;

struct SwigluParams {
  DType dtype;
  SwigluVariant variant;
  int64_t m, d, f;
  bool has_down, has_residual;
  int row_tiles;      // tma, fused: 16-row mma tiles per block (1, 2 or 4)
  int blocks;         // tma: at most this many blocks per kernel (the SM count)
  int clusters;       // fused: clusters of the persistent grid
  int cluster_size;   // fused: blocks per cluster
  int f_group;        // fused: 64-column F tiles per DSMEM exchange
  int k_splits_up;    // gemv: K chunks of the up GEMM (blocks per column tile)
  int k_splits_down;  // gemv: K chunks of the down GEMM
  bool pdl;           // tma, gemv: the down kernel launches programmatically (PDL)
  const void* x;
  const void* w_gate;
  const void* w_up;
  const void* w_down;
  const void* residual;
  void* out;        // [M, D] with w_down, else A2 [M, F]
  void* workspace;  // fused: counters + partials; gemv: SwigluGemvLayout; tma: SwigluTmaLayout
};

inline int64_t swiglu_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t swiglu_align16(int64_t v) { return (v + 15) / 16 * 16; }

// The fewest 16-row mma tiles per block that hold `rows` rows (at most 4: more rows are
// more row groups): the tma kernels' and the linear projection's default.
inline int swiglu_default_row_tiles(int64_t rows) { return rows <= 16 ? 1 : rows <= 32 ? 2 : 4; }

// ---------------------------------------------------------------- fused: shared memory
inline int64_t swiglu_stage_bytes(int64_t rows) { return kSwigluStageB + rows * 128; }

// Largest output-column range (64-column chunks) a rank of the fused kernel owns.
inline int64_t swiglu_fused_cols_per_rank(int64_t d, int cluster_size) {
  return swiglu_ceil_div(d / 64, cluster_size) * 64;
}

// Bytes of a fused block besides its stages.
inline int64_t swiglu_fused_fixed_bytes(int64_t d, int row_tiles, int f_group, int cluster_size) {
  const int64_t rows = 16 * row_tiles, group = 64 * f_group;
  return 2 * rows * 2 * group * 4                                    // partial + receive slots, fp32
         + rows * group * 2                                          // the group's A2 (all-gathered)
         + rows * swiglu_fused_cols_per_rank(d, cluster_size) * 4;  // output accumulator, fp32
}

struct SwigluSmemPlan {
  int stages;     // 0: does not fit
  int64_t bytes;  // dynamic shared memory per block
};

// Two blocks per SM when at least 3 stages fit in half the SM, else one block with up to
// kSwigluMaxStages stages.
inline SwigluSmemPlan swiglu_fused_smem(int64_t d, int row_tiles, int f_group, int cluster_size) {
  const int64_t fixed = swiglu_fused_fixed_bytes(d, row_tiles, f_group, cluster_size);
  const int64_t stage = swiglu_stage_bytes(16 * row_tiles);
  int64_t budget = kSwigluSmemBudget2;
  if ((budget - fixed) / stage < 3) budget = kSwigluSmemBudget1;
  const int64_t s = std::min<int64_t>(kSwigluMaxStages, (budget - fixed) / stage);
  if (s < 2) return {0, 0};
  return {static_cast<int>(s), fixed + s * stage};
}

inline SwigluSmemPlan swiglu_fused_smem(const SwigluParams& p) {
  return swiglu_fused_smem(p.d, p.row_tiles, p.f_group, p.cluster_size);
}

// ---------------------------------------------------------------- tma: workspace
// [A2 [M, F] (with w_down) | counters (one per work tile of either GEMM) | fp32 partial
// slots [segments][slot_rows][256]]. A GEMM of T work tiles split over G blocks has at most
// G + T - 1 (block, tile) segments; segment (b, t) writes slot b + t. Both GEMMs reuse the
// slots (they run in turn).
struct SwigluTmaLayout {
  int64_t tiles_up, tiles_down;    // work tiles: column tiles x row groups
  int64_t slot_rows;               // min(M, rows per block)
  int64_t counters, slots, total;  // byte offsets, bytes
};

inline SwigluTmaLayout swiglu_tma_layout(const SwigluParams& p) {
  const int64_t rows = 16 * p.row_tiles, groups = swiglu_ceil_div(p.m, rows);
  SwigluTmaLayout l;
  l.tiles_up = swiglu_ceil_div(p.f, kSwigluTmaUpCols) * groups;
  l.tiles_down = p.has_down ? swiglu_ceil_div(p.d, kSwigluTmaDownCols) * groups : 0;
  l.slot_rows = std::min(p.m, rows);
  l.counters = p.has_down ? swiglu_align16(p.m * p.f * dtype_size(p.dtype)) : 0;
  l.slots = l.counters + swiglu_align16(4 * (l.tiles_up + l.tiles_down));
  const int64_t segments = p.blocks + std::max(l.tiles_up, l.tiles_down) - 1;
  l.total = l.slots + segments * l.slot_rows * kSwigluTmaSlotCols * 4;
  return l;
}

// ---------------------------------------------------------------- gemv
// x rows padded to the kernel's template rows: 8 or 16 (n8 tiles of the mma).
inline int64_t swiglu_gemv_rows(int64_t m) { return m <= 8 ? 8 : 16; }
// Bytes of one K row of x in shared memory (16-bit).
inline int64_t swiglu_gemv_x_row_bytes(int64_t m) { return swiglu_gemv_rows(m) * 2; }
// x row stride (16-bit elements) in shared memory for a chunk of `rows` K rows (a multiple
// of 16): padded to an odd multiple of 32 bytes, so the 8 rows a warp reads per step hit
// distinct banks.
constexpr int swiglu_gemv_x_stride(int rows) { return rows + ((rows / 16) % 2 ? 0 : 16); }
// Dynamic shared memory of a gemv block: the x chunk, later overlaid by the row groups'
// fp32 partials [4 groups of both matrices][rows][128].
inline size_t swiglu_gemv_smem_bytes(int64_t chunk, int rows) {
  const size_t x = static_cast<size_t>(rows) * swiglu_gemv_x_stride(static_cast<int>(chunk)) * 2;
  const size_t red = static_cast<size_t>(4) * rows * kSwigluGemvCols * 4;
  return std::max(x, red);
}
// K rows per chunk when K is split `splits` ways (a multiple of 16: whole row passes).
inline int64_t swiglu_gemv_chunk(int64_t k, int64_t splits) {
  return swiglu_ceil_div(swiglu_ceil_div(k, splits), 16) * 16;
}
// Whether K split `splits` ways is a valid gemv launch for `m` rows of x.
inline bool swiglu_gemv_splits_fit(int64_t k, int64_t splits, int64_t m) {
  return splits >= 1 && splits <= k / 16 &&
         swiglu_gemv_chunk(k, splits) * swiglu_gemv_x_row_bytes(m) <= kSwigluGemvXBytes;
}

// Workspace: [A2 [M, F] (with w_down) | counters (one per column tile of either GEMM) |
// fp32 partials [tile][k chunk][M][cols] (256 cols up: gate | up, 128 down)].
struct SwigluGemvLayout {
  int64_t tiles_up, tiles_down;
  int64_t counters, slots, total;  // byte offsets, bytes
};

inline SwigluGemvLayout swiglu_gemv_layout(const SwigluParams& p) {
  SwigluGemvLayout l;
  l.tiles_up = swiglu_ceil_div(p.f, kSwigluGemvCols);
  l.tiles_down = p.has_down ? swiglu_ceil_div(p.d, kSwigluGemvCols) : 0;
  l.counters = p.has_down ? swiglu_align16(p.m * p.f * dtype_size(p.dtype)) : 0;
  l.slots = l.counters + swiglu_align16(4 * (l.tiles_up + l.tiles_down));
  const int64_t up = p.k_splits_up > 1 ? l.tiles_up * p.k_splits_up * 2 : 0;
  const int64_t down = p.has_down && p.k_splits_down > 1 ? l.tiles_down * p.k_splits_down : 0;
  l.total = l.slots + std::max(up, down) * p.m * kSwigluGemvCols * 4;
  return l;
}

// ---------------------------------------------------------------- every variant
// Fused workspace: the counters, then fp32 partials [clusters][M][D] (several clusters).
inline int64_t swiglu_workspace_bytes(const SwigluParams& p) {
  switch (p.variant) {
    case SwigluVariant::kTma: return swiglu_tma_layout(p).total;
    case SwigluVariant::kGemv: return swiglu_gemv_layout(p).total;
    case SwigluVariant::kFused:
      return kSwigluCounterBytes + (p.clusters > 1 ? int64_t{p.clusters} * p.m * p.d * 4 : 0);
  }
  return 0;
}

// Why the launch fields of p (its variant, row tiles, grid, splits) are not a valid launch
// for its shape; empty when they are. The FFI decoder and the Python planner
// (cpp/ops/swiglu/plan.cc) both ask this.
inline std::string swiglu_launch_error(const SwigluParams& p) {
  const auto n = [](int64_t v) { return std::to_string(v); };
  switch (p.variant) {
    case SwigluVariant::kTma:
      if (p.row_tiles != 1 && p.row_tiles != 2 && p.row_tiles != 4) return "row_tiles must be 1, 2 or 4";
      if (p.blocks < 1 || p.blocks > 65535) return "blocks (of the tma kernels) must be in 1..65535";
      return "";
    case SwigluVariant::kGemv:
      if (p.m > kSwigluGemvMaxRows) return "the gemv variant takes at most " + n(kSwigluGemvMaxRows) + " rows of x";
      if (!swiglu_gemv_splits_fit(p.d, p.k_splits_up, p.m)) {
        return "k_splits_up must be in 1..D/16 with D/k_splits_up rows of x fitting 64 KB of shared memory, got " +
               n(p.k_splits_up);
      }
      if (p.has_down && !swiglu_gemv_splits_fit(p.f, p.k_splits_down, p.m)) {
        return "k_splits_down must be in 1..F/16 with F/k_splits_down rows of x fitting 64 KB of shared memory, got " +
               n(p.k_splits_down);
      }
      return "";
    case SwigluVariant::kFused:
      if (!p.has_down) return "the fused variant needs w_down";
      if (p.m > kSwigluFusedMaxRows) return "the fused variant takes at most " + n(kSwigluFusedMaxRows) + " rows of x";
      if (p.row_tiles != 1 && p.row_tiles != 2 && p.row_tiles != 4) return "row_tiles must be 1, 2 or 4";
      if (!is_pow2_cluster_size(p.cluster_size) || p.cluster_size > p.d / 64) {
        return "cluster_size must be 1, 2, 4, 8 or 16 and at most D / 64";
      }
      if (p.f_group < 1 || p.f_group > 64) return "f_group must be in 1..64";
      if (p.clusters < 1 || p.clusters > p.f / 64) return "clusters must be in 1..F/64";
      if (swiglu_fused_smem(p).stages == 0) {
        return "this fused configuration needs more shared memory than a block has (row_tiles " +
               n(p.row_tiles) + ", f_group " + n(p.f_group) + ", cluster_size " + n(p.cluster_size) + ")";
      }
      return "";
  }
  return "variant must be 0 (tma), 1 (gemv) or 2 (fused)";
}

}  // namespace jax_cluster
