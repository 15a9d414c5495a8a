// A projection y = a @ w (+ residual) on the tma engine of swiglu's down GEMM
// (ops/swiglu/tma_gemm.h), for the decode step's other weight-bound matmuls.
// a [M, K], w [K, N], residual [M, N] fp16/bf16; fp32 accumulation; y [M, N] in the
// input dtype or fp32. No XLA includes here.
#pragma once

#include <cstdint>

#include "ops/swiglu/params.h"

namespace jax_cluster {

inline constexpr int64_t kLinearAlign = 64;  // K and N must be multiples of this

struct LinearParams {
  DType dtype;  // a, w, residual
  int64_t m, k, n;
  bool out_f32;       // y in fp32 (else in dtype)
  bool has_residual;
  bool pdl;           // launched programmatically: streams its first weights before it
                      // waits for the previous kernel of the stream
  int row_tiles;      // 16-row mma tiles per block: 1, 2 or 4 (linear_row_tiles)
  int max_blocks;     // at most this many blocks (the SM count)
  const void* a;
  const void* w;
  const void* residual;
  void* out;
  void* workspace;  // [tile counters | fp32 partial slots], as swiglu's tma down GEMM
};

// The row tiles of the launch: the fewest 16-row tiles holding M (at most 4: more rows are
// more row groups).
inline int linear_row_tiles(int64_t m) { return swiglu_default_row_tiles(m); }

// Work tiles of 256 output columns x row groups of 16 row_tiles rows.
inline int64_t linear_tiles(int64_t m, int64_t n) {
  return swiglu_ceil_div(n, kSwigluTmaDownCols) * swiglu_ceil_div(m, 16 * linear_row_tiles(m));
}

// Workspace: counters, then an fp32 slot for every (block, tile) segment of a stream-K grid
// of at most max_blocks blocks (SwigluTmaLayout without A2).
inline int64_t linear_slots_offset(int64_t m, int64_t n) { return swiglu_align16(4 * linear_tiles(m, n)); }

inline int64_t linear_workspace_bytes(int64_t m, int64_t n, int64_t max_blocks) {
  const int64_t slot_rows = std::min<int64_t>(m, 16 * linear_row_tiles(m));
  const int64_t segments = max_blocks + linear_tiles(m, n) - 1;
  return linear_slots_offset(m, n) + segments * slot_rows * kSwigluTmaSlotCols * 4;
}

}  // namespace jax_cluster
