// The tensor-core GEMV step shared by swiglu's GEMV kernel, the one-launch decoder layer
// and moe_decode's expert GEMVs: weights stream from memory straight into registers and
// become mma.sync A fragments of the transposed weight, so a 16-row x 64-column step costs
// a warp 4 mma per 8 input rows whatever the batch is.
//
// Lane (g, c) = (lane / 4, lane % 4) of a warp owning 64 columns loads, for each 16-row
// step, K rows 4c..4c+3 of the step at columns [8g, 8g + 8): v[i] = row 4c + i. Byte
// permutes pair two K rows per register (the mma's k = 2c, 2c + 1 are rows 4c, 4c + 1 and
// k = 2c + 8, 2c + 9 are rows 4c + 2, 4c + 3: the K order inside a step is permuted), and
// A's rows g | g + 8 are columns 8g + 2q | 8g + 2q + 1 for mma q. The B operand is the
// input under the same permutation: b0 = (rows 4c, 4c + 1), b1 = (rows 4c + 2, 4c + 3) of
// input row g, as 16-bit pairs (one 8-byte load from a [row][K] 16-bit staging).
//
// acc[q] (fp32, m16n8 C fragment) = {(col, row), (col, row + 1), (col + 1, row),
// (col + 1, row + 1)} with col = 8g + 2q of the 64 and row = 2c of the 8 input rows.
#pragma once

#include <cstdint>

#include "jax_cluster/mma.cuh"

namespace jax_cluster {

__device__ __forceinline__ uint32_t uint4_word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <typename T>
__device__ __forceinline__ void gemv_mma_step(const uint4 (&v)[4], uint32_t b0, uint32_t b1, float (&acc)[4][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t w0 = uint4_word(v[0], q), w1 = uint4_word(v[1], q);
    const uint32_t w2 = uint4_word(v[2], q), w3 = uint4_word(v[3], q);
    const uint32_t frag[4] = {__byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632), __byte_perm(w2, w3, 0x5410),
                              __byte_perm(w2, w3, 0x7632)};
    mma16816<T>(acc[q], frag, b0, b1);
  }
}

// A warp's stream of 16-row steps s = rg, rg + groups, ... (< steps) through U register
// buffers, the caller having loaded buffer u with step rg + u groups: math(buffer, s) on
// each loaded step, then load(buffer, s + U groups) refills that buffer right after its
// math (fewer registers live than refilling ahead of it).
template <int U, typename Math, typename Load>
__device__ __forceinline__ void gemv_mma_stream(uint4 (&wv)[U][4], int rg, int groups, int steps, Math&& math,
                                                Load&& load) {
  for (int s = rg; s < steps; s += groups * U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ss = s + u * groups;
      if (ss < steps) math(wv[u], ss);
      load(wv[u], ss + groups * U);
    }
  }
}

// gemv_mma_stream in the same step order, but every warp of the block runs the same
// iterations (iteration i: steps [i groups U, (i + 1) groups U); load then also gets steps
// past the last, which it must leave unread), and before(i), called by all of them at the
// start of each, may hold a block barrier (decoder_layer stages its inputs there). A form
// of its own: the per-warp loop above keeps swiglu's and moe_decode's registers lower.
template <int U, typename Math, typename Load, typename Before>
__device__ __forceinline__ void gemv_mma_stream_uniform(uint4 (&wv)[U][4], int rg, int groups, int steps,
                                                        Math&& math, Load&& load, Before&& before) {
  for (int i = 0; i * groups * U < steps; ++i) {
    before(i);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ss = i * groups * U + rg + u * groups;
      if (ss < steps) math(wv[u], ss);
      load(wv[u], ss + groups * U);
    }
  }
}

}  // namespace jax_cluster
