// A projection y = a @ w (+ residual) on swiglu's weight-streaming GEMM engine
// (kernels/swiglu_tma.cu: the down GEMM's stream-K / cluster kernel), for the decode
// step's other weight-bound matmuls (attention_decode's QKV and output projections).
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
  int row_tiles;      // 16-row mma tiles per block: 1, 2 or 4
  int max_blocks;     // at most this many blocks (the SM count)
  const void* a;
  const void* w;
  const void* residual;
  void* out;
  void* workspace;  // [tile counters | fp32 partial slots], as the tma variant's down GEMM
};

// Work tiles of 256 output columns x row groups of 16 row_tiles rows.
inline int64_t linear_tiles(const LinearParams& p) {
  return swiglu_ceil_div(p.n, kSwigluTmaDownCols) * swiglu_ceil_div(p.m, 16 * p.row_tiles);
}

// Counters, then slots for every (block, tile) segment (SwigluTmaLayout without A2).
inline int64_t linear_slots_offset(const LinearParams& p) {
  return swiglu_align16(4 * linear_tiles(p));
}

inline int64_t linear_workspace_bytes(const LinearParams& p) {
  const int64_t slot_rows = std::min<int64_t>(p.m, 16 * p.row_tiles);
  const int64_t segments = p.max_blocks + linear_tiles(p) - 1;
  return linear_slots_offset(p) + segments * slot_rows * kSwigluTmaSlotCols * 4;
}

// The row tiles the launcher's kernels are built for: the fewest 16-row tiles holding M
// (at most 4: more rows are more row groups).
inline int linear_row_tiles(int64_t m) { return m <= 16 ? 1 : m <= 32 ? 2 : 4; }

}  // namespace jax_cluster
