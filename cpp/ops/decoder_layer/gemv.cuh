// The one-launch layer's GEMV unit: B (<= 8) input rows times a 256-column tile of a
// row-major [K, N] weight over one K chunk, by 8 warps on the tensor cores:
//
//   wait     the first steps' weight loads are issued, then the unit waits for its inputs
//            (the items of earlier phases that produce them: `wait`), a segment of
//            kLayerStageSegmentRows K rows at a time, each just before the stream needs it:
//            the stream starts on the first segment while later ones are still produced
//   staging  the unit's input rows [B, chunk], built by the phase's functor (a norm of x or
//            h, the attention output, the MLP activation), as two 16-bit halves each
//            (hi = round(v), lo = round(v - hi)): the fp32 input to ~16 significant bits
//   stream   warp = (64-column quarter of the tile, one of 2 row groups); the warp walks
//            the chunk's 16-row steps of its group with the weights going straight from
//            memory into registers, kLayerStepsInFlight steps (4 16-byte loads per lane
//            each) in flight, a step's registers refilled right after its math
//   math     jax_cluster/gemv_mma.cuh: byte permutes turn the loads into mma A fragments
//            of W^T, the staged halves are the B fragments (hi and lo into the same fp32
//            accumulators): 8 mma per 16 x 64 step, whatever the batch
//   reduce   the two row groups' sums in group order (shared memory)
//   finish   one chunk: the tile's [B, 256] sums go to the phase's epilogue; several:
//            fp32 partials, and the unit that raises the tile's counter to `chunks` sums them
//            in chunk order and runs the epilogue (threadfence-reduction); then the tile's
//            ready flag is raised for the units and items that read it. The epilogue's
//            addend (residual, bias) is loaded when the stream ends: its round trip overlaps
//            the partials' store, count and sum instead of following them
// Every sum has a fixed order whoever arrives last: bitwise reproducible.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "jax_cluster/gemv_mma.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "ops/decoder_layer/plan.h"

namespace jax_cluster {

// Where a lane's 8 columns of weight row k are. Paired (SwiGLU's gate and up): virtual
// columns [0, 128) of a tile are w_gate's, [128, 256) w_up's, both at tile * 128 + (v % 128).
// Else two row segments may be stacked: rows k < split of `a`, the rest of `b` (the parallel
// residual's [W_o ; W_out]).
template <typename T>
struct LayerWeights {
  const T* a;
  const T* b;
  int64_t ld, split;  // row stride (elements); first row of b
};

#ifndef JAX_CLUSTER_LAYER_STEPS_IN_FLIGHT
#define JAX_CLUSTER_LAYER_STEPS_IN_FLIGHT (kLayerBlocksPerSm == 1 ? 3 : 2)
#endif
// 16-row steps in flight per warp, 4 loads of 16 bytes per lane each. One block per SM: 3
// (48 KB per SM) streamed faster than 4 or 8; two blocks: 2 steps (64 KB per SM) fit in 128
// registers (docs/decoder_layer.md). A probe build may set another.
inline constexpr int kLayerStepsInFlight = JAX_CLUSTER_LAYER_STEPS_IN_FLIGHT;
inline constexpr int kLayerRowGroups = 2;  // warps = 4 column quarters x 2 row groups
#ifndef JAX_CLUSTER_LAYER_STAGE_SEGMENT_ROWS
#define JAX_CLUSTER_LAYER_STAGE_SEGMENT_ROWS 256
#endif
// A unit waits for and stages its inputs in segments of this many K rows (aligned to
// multiples of it in K), each once the stream reaches it; 0: the whole chunk before the
// stream. A multiple of the producers' granularity keeps a segment's producers few.
inline constexpr int64_t kLayerStageSegmentRows = JAX_CLUSTER_LAYER_STAGE_SEGMENT_ROWS;
// Staged row stride (16-bit elements) for a chunk of `rows` (a multiple of 32): an odd number
// of 32-byte blocks, so the B fragments' 8-byte loads are conflict-free.
__host__ __device__ constexpr int layer_stage_stride(int rows) { return rows + 16; }

// Shared memory of one unit, in floats: the staged halves, the row groups' sums, the tile's
// values.
template <int NB>
__host__ __device__ constexpr int layer_gemv_smem_floats() {
  static_assert(NB <= 8, "the batch is one mma n8 fragment");
  return kLayerStageFloats + NB * 16 + kLayerRowGroups * NB * kLayerTileCols + NB * kLayerTileCols + 32;
}

// A GEMV whose epilogue adds nothing to its sums before finish (layer_gemv_unit's addend).
struct LayerNoAddend {};

// One unit (tile, chunk) of GEMV g. wait(k_begin, k_end): returns once the inputs of K rows
// [k_begin, k_end) exist (all threads call it; it may wait in thread 0 only: a block barrier
// follows); in(b, k): the fp32 input; addend(b, col): what the tile's sum of output column
// col < n gets added (LayerNoAddend: nothing; not for paired GEMVs), read only after the
// unit's waits; finish(tile, vals, batch): the epilogue of the tile's sums plus addends
// vals[b * 256 + v] (shared memory, all threads call it); then ready[tile] is raised.
template <typename T, int NB, typename Wait, typename In, typename Addend, typename Finish>
__device__ void layer_gemv_unit(const LayerGemv& g, const LayerWeights<T>& w, int64_t tile, int64_t chunk,
                                int batch, float* smem, float* partials, unsigned int* tile_counters,
                                unsigned int* ready, Wait wait, In in, Addend addend, Finish finish) {
  constexpr bool kAdds = !std::is_same_v<Addend, LayerNoAddend>;
  constexpr int tc = kLayerTileCols, half = tc / 2, U = kLayerStepsInFlight, groups = kLayerRowGroups;
  const int64_t k0 = chunk * g.chunk_rows, rows = min(g.chunk_rows, g.k - k0);
  const int cs = layer_stage_stride(static_cast<int>(g.chunk_rows));
  T* stage_hi = reinterpret_cast<T*>(smem);  // [NB][cs] each
  T* stage_lo = stage_hi + NB * cs;
  float* red = smem + kLayerStageFloats + NB * 16;  // [group][b][256]
  float* vals = red + groups * NB * tc;
  int* last = reinterpret_cast<int*>(vals + NB * tc);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gl = lane >> 2, cl = lane & 3;
  const int quarter = warp & 3, rg = warp >> 2;
  const int steps = static_cast<int>((rows + 15) / 16);

  // This lane's 8 columns [v, v + 8) of the tile and where they are in memory.
  const int v = quarter * 64 + 8 * gl;
  int64_t col;
  const T* base_a;
  const T* base_b;
  if (g.paired) {
    col = tile * half + v % half;
    base_a = base_b = (v < half ? w.a : w.b) + col;
  } else {
    col = tile * tc + v;
    base_a = w.a + col;
    base_b = w.b != nullptr ? w.b + col - w.split * w.ld : nullptr;
  }
  const bool live = col < g.n;  // n is a multiple of 8: a lane's 8 columns exist all or none
  // Step s's rows 16 s + 4 cl + i of the chunk (zeros past its rows or the matrix's columns).
  auto load = [&](uint4 (&r)[4], int s) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t kr = 16 * static_cast<int64_t>(s) + 4 * cl + i;
      const int64_t k = k0 + kr;
      r[i] = live && s < steps && kr < rows ? ptx::ldg_stream((k < w.split ? base_a : base_b) + k * w.ld)
                                            : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  uint4 wv[U][4];
#pragma unroll
  for (int u = 0; u < U; ++u) load(wv[u], rg + u * groups);

  // Stages the chunk's rows [staged, r) and the rest of the segment r falls in, once wait()
  // says they exist; the last segment also zeros the rows past the chunk's, up to its last
  // 16-row step (0 x garbage could be NaN). Rows the stream reads are never rewritten.
  const int64_t staged_rows = 16 * static_cast<int64_t>(steps);
  int64_t staged = 0;
  auto stage_to = [&](int64_t r) {
    int64_t end = staged_rows;
    if (kLayerStageSegmentRows > 0) {
      const int64_t seg_end = (k0 + r + kLayerStageSegmentRows - 1) / kLayerStageSegmentRows * kLayerStageSegmentRows - k0;
      if (seg_end < rows) end = seg_end;
    }
    wait(k0 + staged, k0 + min(end, rows));
    __syncthreads();
    // A thread's row of every batch row is loaded before any is stored: one round trip per
    // row instead of one per (row, batch row).
    for (int64_t kr = staged + tid; kr < end; kr += kLayerThreads) {
      float x[NB];
#pragma unroll
      for (int b = 0; b < NB; ++b) x[b] = b < batch && kr < rows ? in(b, k0 + kr) : 0.f;
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        const T hi = from_float<T>(x[b]);
        stage_hi[b * cs + kr] = hi;
        stage_lo[b * cs + kr] = from_float<T>(x[b] - to_float(hi));
      }
    }
    staged = end;
    __syncthreads();
  };
  float acc[4][4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[q][j] = 0.f;
  }
  // Each iteration of the stream (groups x U steps) first stages the rows it reads.
  gemv_mma_stream_uniform(wv, rg, groups, steps, [&](const uint4 (&w4)[4], int ss) {
    uint2 bh = make_uint2(0u, 0u), bl = make_uint2(0u, 0u);
    if (gl < NB) {  // B: input row gl at the step's rows 4 cl..4 cl + 3
      bh = *reinterpret_cast<const uint2*>(stage_hi + gl * cs + 16 * ss + 4 * cl);
      bl = *reinterpret_cast<const uint2*>(stage_lo + gl * cs + 16 * ss + 4 * cl);
    }
    gemv_mma_step<T>(w4, bh.x, bh.y, acc);
    gemv_mma_step<T>(w4, bl.x, bl.y, acc);
  }, load, [&](int i) {
    const int64_t need = min(staged_rows, 16 * static_cast<int64_t>(groups * U) * (i + 1));
    if (need > staged) stage_to(need);
  });
  // Thread tid sums (and finishes) tile column tid of every row: its addends, asked for now.
  // The loads here and in the chunk sums below go to clamped rows and columns (in bounds)
  // and are not predicated: a load and its use under one branch waited for the load before.
  float add[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) add[b] = 0.f;
  if constexpr (kAdds) {
    const int64_t c = tile * tc + tid, cc = min(c, g.n - 1);
#pragma unroll
    for (int b = 0; b < NB; ++b) add[b] = addend(min(b, batch - 1), cc);
#pragma unroll
    for (int b = 0; b < NB; ++b) add[b] = c < g.n ? add[b] : 0.f;
  }
  // acc[q] = {(col, row), (col, row + 1), (col + 1, row), (col + 1, row + 1)}, col = v + 2q,
  // row = 2 cl of the batch.
#pragma unroll
  for (int q = 0; q < 4; ++q) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int b = 2 * cl + (j & 1), c = v + 2 * q + (j >> 1);
      if (b < NB) red[(rg * NB + b) * tc + c] = acc[q][j];
    }
  }
  static_assert(tc == kLayerThreads, "a thread per tile column");
  __syncthreads();
  float sum[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    sum[b] = 0.f;
#pragma unroll
    for (int r = 0; r < groups; ++r) sum[b] += red[(r * NB + b) * tc + tid];
  }
  if (g.chunks > 1) {
    // Partials [chunk][b][tile][256]; the last unit of the tile sums them in chunk order.
    const int64_t stride = static_cast<int64_t>(batch) * g.tiles * tc;
    float* mine = partials + chunk * stride + tile * tc + tid;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      if (b < batch) __stcg(mine + b * g.tiles * tc, sum[b]);
    }
    __syncthreads();
    if (tid == 0) {
      __threadfence();  // the partials are visible before the count says so
      *last = atomicAdd(tile_counters + tile, 1u) == static_cast<unsigned>(g.chunks - 1);
      __threadfence();
    }
    __syncthreads();
    if (!*last) return;
    // The chunks in steps of 16 / NB, every row's loads of a step issued before any sum:
    // about 16 loads in flight whatever NB, and no remainder loop (a step past the last chunk
    // reloads it and skips the sum). Unrolled over rows outside instead, the code grew by a
    // quarter at NB = 8 and its GEMV phases slowed.
    constexpr int kStep = 16 / NB;
    const float* p = partials + tile * tc + tid;
#pragma unroll
    for (int b = 0; b < NB; ++b) sum[b] = 0.f;
    for (int64_t k0 = 0; k0 < g.chunks; k0 += kStep) {
      float v[kStep][NB];
#pragma unroll
      for (int u = 0; u < kStep; ++u) {
        const int64_t k = min(k0 + u, g.chunks - 1);
#pragma unroll
        for (int b = 0; b < NB; ++b) v[u][b] = __ldcg(p + k * stride + min(b, batch - 1) * g.tiles * tc);
      }
#pragma unroll
      for (int u = 0; u < kStep; ++u) {
        if (k0 + u < g.chunks) {
#pragma unroll
          for (int b = 0; b < NB; ++b) sum[b] += v[u][b];
        }
      }
    }
  }
#pragma unroll
  for (int b = 0; b < NB; ++b) vals[b * tc + tid] = sum[b] + add[b];
  __syncthreads();
  finish(tile, vals, batch);
  __syncthreads();
  if (tid == 0) {
    __threadfence();  // the epilogue's stores (ordered by the block barrier) before the flag
    atomicAdd(ready + tile, 1u);
  }
}

}  // namespace jax_cluster
