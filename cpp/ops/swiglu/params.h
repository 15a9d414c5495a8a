// SwiGLU MLP (DeepFusionKernel): y = (silu(x @ w_gate) * (x @ w_up)) @ w_down (+ residual),
// x [M, D], w_gate/w_up [D, F], w_down [F, D]; without w_down the op returns the
// activation A2 = silu(x @ w_gate) * (x @ w_up), [M, F]. fp16/bf16, fp32 accumulation,
// A2 rounded to the activation dtype (it feeds a 16-bit tensor-core GEMM).
//
// Variants (all deterministic; no floating-point atomics):
//  * kSplit: the two-kernel form. Kernel 1 ("up"): each cluster owns a 64-column tile of
//    w_gate AND w_up (they share every x tile), its N blocks split D, the fp32 partials
//    are reduce-scattered over DSMEM and each block applies SiLU*mul to its piece and
//    writes A2. Kernel 2 ("down"): same engine on A2 @ w_down (128 output columns per
//    cluster, F split over the cluster), residual fused into the epilogue.
//  * kFused: ONE persistent kernel; A2 never reaches global memory. Cluster c owns a
//    contiguous range of 64-column F tiles, processed in groups of `f_group` tiles. Its N
//    blocks split D for the gate/up GEMMs; per group the partials are reduce-scattered
//    (fixed rank order), each block computes its piece of A2 and all-gathers it into
//    every block's shared memory; then block r multiplies the group's A2 [rows, group]
//    by w_down[group rows, columns of rank r] and accumulates in shared memory across
//    groups. Each cluster's partial y goes to the workspace; the last cluster to finish
//    a column range (integer counter) sums all clusters' partials in cluster order.
//  * kStream: the split form's two GEMMs, each as ONE persistent ("stream-K") kernel of
//    G plain blocks (G = resident blocks: no partial last wave). The work of a GEMM is the
//    flat sequence of (work tile, 64-row K block) units, work tiles in tile order, K
//    fastest; block b streams units [b U / G, (b + 1) U / G) without draining its cp.async
//    pipeline between tiles. A block that ends a tile's K range (or its own) writes the
//    fp32 partial to a slot in the workspace; the last of a tile's blocks to arrive
//    (integer counter) sums the partials in block order (deterministic) and applies the
//    epilogue (SiLU*mul / residual). Wave quantisation and per-block pipeline ramps are
//    what cost the split kernels ~15-20% against XLA at M <= 16.
//  * kGemv (M <= 8 on CUDA cores, M <= 16 on tensor cores: gemv_mma): no shared-memory
//    staging of weights: each thread streams 16-byte weight vectors straight into
//    registers (8 loads in flight) and FMAs them with x held in shared memory (CUDA
//    cores), or permutes them into mma.sync A fragments of the transposed weights with x
//    as the B operand (tensor cores; kernels/swiglu_gemv.cu). A block
//    owns a 128-column tile (gate AND up for the up GEMM) and one of `k_splits` K chunks;
//    the chunks' fp32 partials meet in the workspace and the tile's last block sums them in
//    chunk order (deterministic). The access pattern of benchmarks/micro/gemv_locality.cu,
//    which read weights at ~3.05 TB/s on H100 where the cp.async/mma engine reached 2.26.
//  * kTma (any M; kernels/swiglu_tma.cu): the split form's two GEMMs as persistent
//    stream-K kernels (one block per SM) fed by the bulk tensor copy engine: one producer
//    thread streams 64 x 64 128B-swizzled weight boxes (4 per unit: 128 columns of w_gate
//    and of w_up, or 256 of w_down, x 64 K rows) plus the x / A2 box into a 2-stage Ring
//    (~80 KB; 3 stages when the up grid leaves a third of the SMs idle), 8 consumer warps
//    run mma.sync (ldmatrix.trans conflict-free); equal shares of the (work tile, K block)
//    units per block. A split tile is summed in block order
//    (deterministic) by the blocks whose ranges end in it, a share each, after a wait on
//    the tile's counter (the launcher keeps the grid resident). The up grid is tiles x k
//    blocks when its tiles fit (each block a whole tile or an exact 1/k), the down grid
//    one block per SM, or (M <= 64, D / 256 <= SMs / 5) clusters of 5-8 blocks per down
//    tile that sum their partials over DSMEM. The down kernel is launched programmatically (PDL) and pulls its
//    first units into L2 before its wait.
//    Session 20 (H100, benchmarks/probes/tma_kernel.cu per-block phase times): 5-6 stages
//    (~200 KB in flight per SM) queued the memory system ~9 us deep, so blocks with equal
//    shares ended up to 30 us apart and every tile-end round trip cost microseconds; and
//    the last block to arrive at a down tile summed ~9 partials alone. Llama-2-7B M = 64
//    went from 155 to ~115 us (plain jnp: ~125); see benchmarks/results/swiglu.md.
//  Tile order: kCol = a weight tile's row groups run next to each other (weights read
//  from HBM once, reused through L2/shared memory: small M); kRow = all weight tiles of a
//  row group, then the next group (x reuse: large M). For the fused kernel, kCol holds
//  as many rows per pass as shared memory allows, kRow one 16-row tile per pass.
//
// Engine: mma.sync m16n8k16 (fp32 accumulate) on tiles staged in shared memory by a
// multi-stage cp.async pipeline (16-byte copies, swizzled, many in flight); M is padded
// to 16-row tiles, so M = 1..16 is the bandwidth-bound "GEMV" regime at no extra HBM cost.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "jax_cluster/types.h"

namespace jax_cluster {

enum class SwigluVariant : int32_t { kSplit = 0, kFused = 1, kStream = 2, kGemv = 3, kTma = 4 };
enum class SwigluOrder : int32_t { kCol = 0, kRow = 1 };

inline constexpr int64_t kSwigluAlign = 64;      // D and F must be multiples of this
inline constexpr int64_t kSwigluFTile = 64;      // F columns of w_gate/w_up per tile
inline constexpr int64_t kSwigluDownTile = 128;  // output columns per cluster (split down)
inline constexpr int64_t kSwigluStageB = 64 * 128 * 2;  // bytes of one B stage [64][128]
inline constexpr int kSwigluMaxStages = 8;
inline constexpr int64_t kSwigluGemvMaxRows = 8;     // M of the gemv variant (CUDA cores)
inline constexpr int64_t kSwigluGemvMmaMaxRows = 16; // M of the gemv variant (tensor cores)
inline constexpr int64_t kSwigluGemvCols = 128;      // columns per gemv block (per matrix)
inline constexpr int64_t kSwigluGemvXBytes = 64 * 1024;  // x chunk in shared memory (unpadded)
// Shared-memory budgets: two blocks per SM, or one.
inline constexpr int64_t kSwigluSmemBudget2 = 112 * 1024;
inline constexpr int64_t kSwigluSmemBudget1 = 220 * 1024;

struct SwigluParams {
  DType dtype;
  SwigluVariant variant;
  SwigluOrder order;
  int64_t m, d, f;
  bool has_down, has_residual;
  int cluster_up;    // split: blocks per cluster of the up kernel; fused: of the fused kernel
  int cluster_down;  // split: blocks per cluster of the down kernel
  int row_tiles;     // 16-row mma tiles per block (1, 2 or 4)
  int f_group;       // fused: 64-column F tiles per DSMEM exchange
  int num_clusters;  // fused: clusters in the persistent grid; stream: blocks (clusters of 1)
  int k_splits_up;    // gemv: K chunks of the up GEMM (blocks per column tile)
  int k_splits_down;  // gemv: K chunks of the down GEMM
  bool pdl;           // tma, gemv: the down kernel launches programmatically (PDL)
  bool gemv_mma;      // gemv: tensor cores (mma.sync) instead of CUDA-core FMAs
  bool wgmma;         // tma: warpgroup MMA consumers (row_tiles 4) instead of mma.sync
  bool down_slots;    // tma: the down GEMM's stream-K grid with partials in global slots
                      // even where clusters reducing over DSMEM apply (probes; A/B)
  const void* x;
  const void* w_gate;
  const void* w_up;
  const void* w_down;
  const void* residual;
  void* out;        // [M, D] with w_down, else A2 [M, F]
  void* workspace;  // split: A2 [M, F]; fused: counters + partials; stream:
                    // SwigluStreamLayout; gemv: SwigluGemvLayout; tma: SwigluTmaLayout
};

inline int64_t swiglu_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t swiglu_rows_per_block(const SwigluParams& p) { return 16 * p.row_tiles; }

// Shared memory of one block: `fixed` (exchange buffers, accumulators) plus stages.
inline int64_t swiglu_stage_bytes(int64_t rows) { return kSwigluStageB + rows * 128; }

// Receive slots of the split kernels' reduce-scatter (fp32); their partial tile reuses
// the stage buffers once the main loop is over.
inline int64_t swiglu_tile_fixed_bytes(int64_t rows) { return rows * kSwigluDownTile * 4; }

// Largest output-column range (64-column chunks) a rank of the fused kernel owns.
inline int64_t swiglu_fused_cols_per_rank(const SwigluParams& p) {
  return swiglu_ceil_div(p.d / 64, p.cluster_up) * 64;
}

inline int64_t swiglu_fused_fixed_bytes(const SwigluParams& p) {
  const int64_t rows = swiglu_rows_per_block(p), group = 64 * p.f_group;
  return 2 * rows * 2 * group * 4           // partial + receive slots (gate and up), fp32
         + rows * group * 2                 // the group's A2 (all-gathered)
         + rows * swiglu_fused_cols_per_rank(p) * 4;  // output accumulator, fp32
}

struct SwigluSmemPlan {
  int stages;     // 0: does not fit
  int64_t bytes;  // dynamic shared memory per block
};

// Two blocks per SM when at least 3 stages fit in half the SM, else one block with up
// to kSwigluMaxStages stages (jax_cluster/ops/swiglu.py mirrors this).
inline SwigluSmemPlan swiglu_smem_plan(int64_t fixed, int64_t stage) {
  int64_t budget = kSwigluSmemBudget2;
  if ((budget - fixed) / stage < 3) budget = kSwigluSmemBudget1;
  const int64_t s = std::min<int64_t>(kSwigluMaxStages, (budget - fixed) / stage);
  if (s < 2) return {0, 0};
  return {static_cast<int>(s), fixed + s * stage};
}

inline SwigluSmemPlan swiglu_tile_smem(const SwigluParams& p) {
  const int64_t rows = swiglu_rows_per_block(p);
  return swiglu_smem_plan(swiglu_tile_fixed_bytes(rows), swiglu_stage_bytes(rows));
}

inline SwigluSmemPlan swiglu_fused_smem(const SwigluParams& p) {
  return swiglu_smem_plan(swiglu_fused_fixed_bytes(p), swiglu_stage_bytes(swiglu_rows_per_block(p)));
}

// Stream-K workspace: [A2 [M, F] (with w_down) | counters (one per work tile of either
// GEMM) | partial slots]. A GEMM of T work tiles split over G blocks has at most G + T - 1
// (block, tile) segments; segment (b, t) writes slot b + t (distinct for every non-empty
// segment), slot_rows x 128 fp32 each. Both GEMMs reuse the slots (they run in turn).
struct SwigluStreamLayout {
  int64_t tiles_up, tiles_down;  // work tiles: column tiles x row groups
  int64_t slot_rows;             // min(M, rows per block)
  int64_t counters;              // byte offsets
  int64_t slots;
  int64_t total;                 // bytes
};

inline int64_t swiglu_align16(int64_t v) { return (v + 15) / 16 * 16; }

inline SwigluStreamLayout swiglu_stream_layout(const SwigluParams& p) {
  const int64_t rows = swiglu_rows_per_block(p), groups = swiglu_ceil_div(p.m, rows);
  SwigluStreamLayout l;
  l.tiles_up = p.f / 64 * groups;
  l.tiles_down = p.has_down ? swiglu_ceil_div(p.d, kSwigluDownTile) * groups : 0;
  l.slot_rows = std::min(p.m, rows);
  l.counters = p.has_down ? swiglu_align16(p.m * p.f * dtype_size(p.dtype)) : 0;
  l.slots = l.counters + swiglu_align16(4 * (l.tiles_up + l.tiles_down));
  const int64_t segments = p.num_clusters + std::max(l.tiles_up, l.tiles_down) - 1;
  l.total = l.slots + segments * l.slot_rows * 128 * 4;
  return l;
}

// Tma: work tiles of 128 F columns (of w_gate AND of w_up) for the up GEMM and 256 D
// columns for the down GEMM: each weight row segment a block streams is 256 or 512
// contiguous bytes (narrower segments read at other times by other blocks cost DRAM
// bandwidth: 64-column tiles measured 2.3 TB/s effective on H100). Workspace: [A2 [M, F]
// (with w_down) | counters (one per work tile of either GEMM) | fp32 partial slots
// [segments][slot_rows][256]] (segment (b, t) of block b in work tile t: slot b + t).
inline constexpr int64_t kSwigluTmaUpCols = 128;
inline constexpr int64_t kSwigluTmaDownCols = 256;
inline constexpr int64_t kSwigluTmaSlotCols = 256;

struct SwigluTmaLayout {
  int64_t tiles_up, tiles_down;  // work tiles: column tiles x row groups
  int64_t slot_rows;             // min(M, rows per block)
  int64_t counters, slots, total;  // byte offsets, bytes
};

inline SwigluTmaLayout swiglu_tma_layout(const SwigluParams& p) {
  const int64_t rows = swiglu_rows_per_block(p), groups = swiglu_ceil_div(p.m, rows);
  SwigluTmaLayout l;
  l.tiles_up = swiglu_ceil_div(p.f, kSwigluTmaUpCols) * groups;
  l.tiles_down = p.has_down ? swiglu_ceil_div(p.d, kSwigluTmaDownCols) * groups : 0;
  l.slot_rows = std::min(p.m, rows);
  l.counters = p.has_down ? swiglu_align16(p.m * p.f * dtype_size(p.dtype)) : 0;
  l.slots = l.counters + swiglu_align16(4 * (l.tiles_up + l.tiles_down));
  const int64_t segments = p.num_clusters + std::max(l.tiles_up, l.tiles_down) - 1;
  l.total = l.slots + segments * l.slot_rows * kSwigluTmaSlotCols * 4;
  return l;
}

// Gemv: rows of x padded to the kernel's template rows: a power of two (CUDA cores), 8 or
// 16 (tensor cores: n8 tiles).
inline int64_t swiglu_gemv_max_rows(bool mma) { return mma ? kSwigluGemvMmaMaxRows : kSwigluGemvMaxRows; }
inline int64_t swiglu_gemv_rows(int64_t m, bool mma) {
  if (mma) return m <= 8 ? 8 : 16;
  return m <= 1 ? 1 : m <= 2 ? 2 : m <= 4 ? 4 : 8;
}
// Bytes of one K row of x in shared memory: fp32 per row (CUDA cores), 16-bit (tensor cores).
inline int64_t swiglu_gemv_x_row_bytes(int64_t m, bool mma) {
  return swiglu_gemv_rows(m, mma) * (mma ? 2 : 4);
}
// Tensor cores: x row stride (16-bit elements) in shared memory for a chunk of `rows` K rows
// (a multiple of 16): padded to an odd multiple of 32 bytes, so the 8 rows a warp reads per
// step hit distinct banks.
constexpr int swiglu_gemv_mma_x_stride(int rows) {
  return rows + ((rows / 16) % 2 ? 0 : 16);
}
// Dynamic shared memory of a gemv block: the x chunk, later overlaid by the row groups'
// fp32 partials [groups of both matrices][rows][128].
inline size_t swiglu_gemv_smem_bytes(int64_t chunk, int rows, bool mma) {
  const size_t x = mma ? static_cast<size_t>(rows) * swiglu_gemv_mma_x_stride(static_cast<int>(chunk)) * 2
                       : static_cast<size_t>(chunk) * rows * 4;
  const size_t red = static_cast<size_t>(mma ? 4 : 8) * rows * kSwigluGemvCols * 4;
  return std::max(x, red);
}

// Gemv workspace: [A2 [M, F] (with w_down) | counters (one per column tile of either
// GEMM) | fp32 partials [tile][k chunk][M][cols] (256 cols up: gate | up, 128 down)].
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

// K rows per chunk when K is split `splits` ways (a multiple of 16: whole row passes).
inline int64_t swiglu_gemv_chunk(int64_t k, int64_t splits) {
  return swiglu_ceil_div(swiglu_ceil_div(k, splits), 16) * 16;
}

// Fused workspace: 16 counters (one per rank, 64 bytes) then fp32 partials [C][M][D].
inline constexpr int64_t kSwigluCounterBytes = 64;

inline int64_t swiglu_workspace_bytes(const SwigluParams& p) {
  if (p.variant == SwigluVariant::kStream) return swiglu_stream_layout(p).total;
  if (p.variant == SwigluVariant::kTma) return swiglu_tma_layout(p).total;
  if (p.variant == SwigluVariant::kGemv) return swiglu_gemv_layout(p).total;
  if (p.variant == SwigluVariant::kSplit) {
    return p.has_down ? p.m * p.f * dtype_size(p.dtype) : 0;
  }
  if (!p.has_down) return 0;
  return kSwigluCounterBytes + (p.num_clusters > 1 ? p.num_clusters * p.m * p.d * 4 : 0);
}

}  // namespace jax_cluster
