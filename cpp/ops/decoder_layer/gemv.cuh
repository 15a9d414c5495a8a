// The one-launch layer's GEMV unit: B (<= 8) input rows times a tile of tile_cols (256 to
// 2048) columns of a row-major [K, N] weight over one K chunk, by 256 threads: tile_cols / 8
// lanes read a row's tile_cols contiguous weights at once (narrow tiles, whose rows are a
// weight row apart in DRAM, streamed at half the bandwidth).
//
//   staging  the unit's input rows [B, chunk] in fp32 shared memory, built by the phase's
//            functor (a norm of x or h, the attention output, the MLP activation)
//   stream   thread = (row group, 8 columns): each thread streams the 16-byte weight
//            vectors of its rows rg, rg + groups, ... through its own shared-memory ring
//            (cp.async, kLayerRingSteps steps of kLayerStepRows rows, all but one in flight): the
//            bytes in flight do not cost registers; a thread only reads what it copied
//            (no block barrier in the loop) into B x 8 fp32 accumulators
//   reduce   the row groups' sums in group order (in the ring's memory, idle by then)
//   finish   one chunk: the tile's [B, tile_cols] sums go to the phase's epilogue; several:
//            fp32 partials, and the unit that raises the tile's counter to `chunks` sums them
//            in chunk order and runs the epilogue (threadfence-reduction)
// Every sum has a fixed order whoever arrives last: bitwise reproducible.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/mma.cuh"  // cp.async
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "ops/decoder_layer/plan.h"

namespace jax_cluster {

// Where a lane's 8 columns of weight row k are. Paired (SwiGLU's gate and up): virtual
// columns [0, half) of a tile are w_gate's, [half, 2 half) w_up's, both at tile * half +
// (v % half), half = tile_cols / 2. Else two row segments may be stacked: rows k < split of
// `a`, the rest of `b` (the parallel residual's [W_o ; W_out]).
template <typename T>
struct LayerWeights {
  const T* a;
  const T* b;
  int64_t ld, split;  // row stride (elements); first row of b
};

inline constexpr int kLayerRingSteps = 6;  // steps per thread's ring; kLayerRingSteps - 1 in flight
inline constexpr int kLayerStepRows = 4;   // rows (16 bytes each) a thread copies per step

inline constexpr int kLayerRingFloats = kLayerRingSteps * kLayerStepRows * kLayerThreads * 4;

// Shared memory of one unit, in floats: the weight ring (then the row groups' sums), staged
// input, the tile's values.
template <int NB>
__host__ __device__ constexpr int layer_gemv_smem_floats() {
  // the row groups' sums: groups x NB x tile_cols = NB x 8 x 256 floats for every width
  static_assert(NB * 8 * kLayerThreads <= kLayerRingFloats, "the row groups' sums reuse the ring");
  return kLayerRingFloats + kLayerStageFloats + NB * kLayerMaxTileCols + 32;
}

// One unit (tile, chunk) of GEMV g. in(b, k): the fp32 input; finish(tile, vals, batch):
// the epilogue of the tile's sums vals[b * tile_cols + v] (shared memory, all threads call it).
template <typename T, int NB, typename In, typename Finish>
__device__ void layer_gemv_unit(const LayerGemv& g, const LayerWeights<T>& w, int64_t tile, int64_t chunk,
                                int batch, float* smem, float* partials, unsigned int* tile_counters, In in,
                                Finish finish) {
  uint4* ring = reinterpret_cast<uint4*>(smem);  // [step][row of step][thread]
  float* red = smem;                              // [row group][b][column], after the loop
  float* stage = smem + kLayerRingFloats;
  float* vals = stage + kLayerStageFloats;
  int* last = reinterpret_cast<int*>(vals + NB * kLayerMaxTileCols);
  const int tid = threadIdx.x;
  const int tc = static_cast<int>(g.tile_cols), lanes = tc / 8, groups = kLayerThreads / lanes;
  const int rg = tid / lanes, half = tc / 2;
  const int64_t k0 = chunk * g.chunk_rows, rows = min(g.chunk_rows, g.k - k0);
  const int64_t cr = g.chunk_rows;

  // This thread's 8 columns: pointers to their row 0 in each matrix (live: inside the tile's N).
  const int v = (tid % lanes) * 8;
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
  const bool live = col < g.n;
  // Thread rows rg + groups i, i < mine; step s holds i in [s * kLayerStepRows, + kLayerStepRows).
  const int mine = live && rg < rows ? static_cast<int>((rows - rg + groups - 1) / groups) : 0;
  const int steps = (mine + kLayerStepRows - 1) / kLayerStepRows;
  // Step `step` into ring slot `ring_slot` (a running index: no modulo in the loop).
  auto issue = [&](int step, int ring_slot) {
    if (step < steps) {
      uint4* slot = ring + ring_slot * kLayerStepRows * kLayerThreads + tid;
#pragma unroll
      for (int u = 0; u < kLayerStepRows; ++u) {
        const int i = step * kLayerStepRows + u;
        if (i < mine) {
          const int64_t k = k0 + rg + static_cast<int64_t>(groups) * i;
          const T* row = k < w.split ? base_a : base_b;
          cp_async_16(ptx::smem_addr(slot + u * kLayerThreads), row + k * w.ld, 16);
        }
      }
    }
    cp_async_commit();  // empty groups keep the count uniform
  };
#pragma unroll
  for (int s0 = 0; s0 < kLayerRingSteps - 1; ++s0) issue(s0, s0);

  for (int64_t e = tid; e < NB * rows; e += kLayerThreads) {
    const int b = static_cast<int>(e / rows);
    const int64_t r = e % rows;
    stage[b * cr + r] = b < batch ? in(b, k0 + r) : 0.f;
  }
  float acc[NB][8];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[b][j] = 0.f;
  }
  __syncthreads();
  int read_slot = 0;  // step's ring slot; step + kLayerRingSteps - 1 refills the one before it
  for (int step = 0; step < steps; ++step) {
    issue(step + kLayerRingSteps - 1, read_slot == 0 ? kLayerRingSteps - 1 : read_slot - 1);
    cp_async_wait<kLayerRingSteps - 1>();  // this thread's copies of `step` landed
    const uint4* slot = ring + read_slot * kLayerStepRows * kLayerThreads + tid;
    read_slot = read_slot + 1 == kLayerRingSteps ? 0 : read_slot + 1;
    // The step's weight vectors and inputs first, then the FMAs. lds128: one 16-byte load per
    // vector (unpack on a shared-memory reference compiled to eight 2-byte loads). Rows past
    // `mine` multiply zeros.
    const int i0 = step * kLayerStepRows;
    uint4 raw[kLayerStepRows];
    float xin[kLayerStepRows][NB];
#pragma unroll
    for (int u = 0; u < kLayerStepRows; ++u) {
      const bool on = i0 + u < mine;
      const int64_t r = rg + static_cast<int64_t>(groups) * (i0 + u);
      raw[u] = on ? ptx::lds128(slot + u * kLayerThreads) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int b = 0; b < NB; ++b) xin[u][b] = on ? stage[b * cr + r] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kLayerStepRows; ++u) {
      float wf[8];
      unpack<T>(raw[u], wf);
#pragma unroll
      for (int b = 0; b < NB; ++b) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[b][j] = fmaf(xin[u][b], wf[j], acc[b][j]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every thread is done with the ring: it holds the warps' sums now
#pragma unroll
  for (int b = 0; b < NB; ++b) {
#pragma unroll
    for (int j = 0; j < 8; ++j) red[(rg * NB + b) * tc + v + j] = acc[b][j];
  }
  __syncthreads();
  for (int e = tid; e < NB * tc; e += kLayerThreads) {
    float s = 0.f;
    for (int r = 0; r < groups; ++r) s += red[r * NB * tc + e];
    vals[e] = s;
  }
  if (g.chunks > 1) {
    // Partials [chunk][b][tile][tile_cols]; the last unit of the tile sums them in chunk order.
    const int64_t stride = static_cast<int64_t>(batch) * g.tiles * tc;
    for (int e = tid; e < batch * tc; e += kLayerThreads) {
      const int b = e / tc, c = e % tc;
      __stcg(partials + chunk * stride + (b * g.tiles + tile) * tc + c, vals[e]);
    }
    __syncthreads();
    if (tid == 0) {
      __threadfence();  // the partials are visible before the count says so
      *last = atomicAdd(tile_counters + tile, 1u) == static_cast<unsigned>(g.chunks - 1);
      __threadfence();
    }
    __syncthreads();
    if (!*last) return;
    for (int e = tid; e < batch * tc; e += kLayerThreads) {
      const int b = e / tc, c = e % tc;
      const float* p = partials + (b * g.tiles + tile) * tc + c;
      float s = 0.f;
      for (int64_t k = 0; k < g.chunks; ++k) s += __ldcg(p + k * stride);
      vals[e] = s;
    }
  }
  __syncthreads();
  finish(tile, vals, batch);
  __syncthreads();
}

// Pulls the first `budget` bytes of a unit's weight rows into L2 (one prefetch per row
// segment): issued before a grid barrier, so the next phase's first loads hit.
template <typename T>
__device__ void prefetch_layer_unit(const LayerGemv& g, const LayerWeights<T>& w, int64_t tile, int64_t chunk,
                                    int64_t budget) {
  const int64_t k0 = chunk * g.chunk_rows, rows = min(g.chunk_rows, g.k - k0);
  const int segments = g.paired ? 2 : 1;
  const int seg_bytes = static_cast<int>(g.tile_cols * sizeof(T)) / segments;
  const int64_t n = min(rows * segments, budget / seg_bytes);
  for (int64_t e = threadIdx.x; e < n; e += kLayerThreads) {
    const int64_t k = k0 + e / segments;
    const int s = static_cast<int>(e % segments);
    int64_t col = g.paired ? tile * (g.tile_cols / 2) : tile * g.tile_cols;
    if (col >= g.n) return;
    const T* m = g.paired ? (s ? w.b : w.a) : (k < w.split ? w.a : w.b - w.split * w.ld);
    const int64_t cols = min(static_cast<int64_t>(seg_bytes / sizeof(T)), static_cast<int64_t>(g.n - col));
    ptx::prefetch_l2(m + k * w.ld + col, static_cast<uint32_t>((cols * sizeof(T) + 15) / 16 * 16));
  }
}

}  // namespace jax_cluster
