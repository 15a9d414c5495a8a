// The one-launch layer's GEMV unit: B (<= 8) input rows times a tile of tile_cols (256 to
// 2048) columns of a row-major [K, N] weight over one K chunk, by 256 threads: tile_cols / 8
// lanes read a row's tile_cols contiguous weights at once (narrow tiles, whose rows are a
// weight row apart in DRAM, streamed at half the bandwidth).
//
//   staging  the unit's input rows [B, chunk] in fp32 shared memory, built by the phase's
//            functor (a norm of x or h, the attention output, the MLP activation)
//   stream   the tile's rows through a ring of 32 KB stages in shared memory: thread 0
//            issues one bulk copy per row segment (the copy engine; kLayerRingStages - 1
//            stages in flight, no registers held), every thread = (row group, 8 columns)
//            reads its 16-byte vectors of each stage into B x 8 fp32 accumulators and
//            arrives on the stage's empty barrier
//   reduce   the row groups' sums in group order (in the ring's memory, idle by then)
//   finish   one chunk: the tile's [B, tile_cols] sums go to the phase's epilogue; several: fp32
//            partials, and the unit that raises the tile's counter to `chunks` sums them
//            in chunk order and runs the epilogue (threadfence-reduction)
// Every sum has a fixed order whoever arrives last: bitwise reproducible.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/ptx.cuh"
#include "jax_cluster/tma.cuh"  // bulk_load, mbarrier_arrive
#include "jax_cluster/vec.cuh"
#include "ops/decoder_layer/plan.h"

namespace jax_cluster {

// Where a lane's 8 columns of weight row k are. Paired (SwiGLU's gate and up): virtual
// columns [0, half) of a tile are w_gate's, [half, 2 half) w_up's, both at tile * half +
// (v % half), half = tile_cols / 2. Else two
// row segments may be stacked: rows k < split of `a`, the rest of `b` (the parallel
// residual's [W_o ; W_out]).
template <typename T>
struct LayerWeights {
  const T* a;
  const T* b;
  int64_t ld, split;  // row stride (elements); first row of b
};

inline constexpr int kLayerRingStages = 4;           // weight stages; kLayerRingStages - 1 in flight
inline constexpr int kLayerStageBytes = 32 << 10;    // a stage: whole tile rows, 32 KB
inline constexpr int kLayerRingFloats = kLayerRingStages * kLayerStageBytes / 4;

// The weight ring's barriers (static shared memory: the ring's bytes share the dynamic
// buffer with the attention phase). full: a stage's bytes landed; empty: every thread read it.
struct LayerRing {
  uint64_t full[kLayerRingStages];
  uint64_t empty[kLayerRingStages];
  __device__ void init() {
    for (int s = 0; s < kLayerRingStages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], kLayerThreads);
    }
    ptx::fence_mbarrier_init_cluster();
  }
};

// Shared memory of one unit, in floats: the weight ring (then the row groups' sums), the
// staged input, the tile's values.
template <int NB>
__host__ __device__ constexpr int layer_gemv_smem_floats() {
  // the row groups' sums: groups x NB x tile_cols = NB x 8 x 256 floats for every width
  static_assert(NB * 8 * kLayerThreads <= kLayerRingFloats, "the row groups' sums reuse the ring");
  return kLayerRingFloats + kLayerStageFloats + NB * kLayerMaxTileCols + 32;
}

// One unit (tile, chunk) of GEMV g. in(b, k): the fp32 input; finish(tile, vals, batch):
// the epilogue of the tile's sums vals[b * tile_cols + v] (shared memory, all threads call
// it). ring_pos: stages this block's ring has served so far (every thread keeps the count).
template <typename T, int NB, typename In, typename Finish>
__device__ void layer_gemv_unit(const LayerGemv& g, const LayerWeights<T>& w, int64_t tile, int64_t chunk,
                                int batch, float* smem, LayerRing& ring, uint32_t& ring_pos, float* partials,
                                unsigned int* tile_counters, In in, Finish finish) {
  unsigned char* stages = reinterpret_cast<unsigned char*>(smem);
  float* red = smem;  // [row group][b][column], after the loop
  float* stage = smem + kLayerRingFloats;
  float* vals = stage + kLayerStageFloats;
  int* last = reinterpret_cast<int*>(vals + NB * kLayerMaxTileCols);
  const int tid = threadIdx.x;
  const int tc = static_cast<int>(g.tile_cols), lanes = tc / 8, groups = kLayerThreads / lanes;
  const int rg = tid / lanes, half = tc / 2;
  const int64_t k0 = chunk * g.chunk_rows, rows = min(g.chunk_rows, g.k - k0);
  const int64_t cr = g.chunk_rows;
  const int row_bytes = tc * static_cast<int>(sizeof(T));
  const int stage_rows = kLayerStageBytes / row_bytes;
  const int64_t steps = (rows + stage_rows - 1) / stage_rows;

  // This thread's 8 (virtual) columns of the tile.
  const int v = (tid % lanes) * 8;
  const int64_t col = g.paired ? tile * half + v % half : tile * tc + v;
  const bool live = col < g.n;

  // Stage n of the unit: rows [n * stage_rows, ...) of the chunk, each row's tile columns
  // (paired: the gate half, then the up half) by the bulk-copy engine, issued by thread 0.
  const uint64_t policy = ptx::l2_evict_first();
  auto issue = [&](int64_t n) {
    if (n >= steps) return;
    const uint32_t at = ring_pos + static_cast<uint32_t>(n), slot = at % kLayerRingStages;
    const uint32_t use = at / kLayerRingStages;
    ptx::mbarrier_wait(&ring.empty[slot], (use & 1) ^ 1);  // the previous use was read
    const int64_t r0 = n * stage_rows, r1 = min(rows, r0 + stage_rows);
    const int64_t seg_cols = g.paired ? min(static_cast<int64_t>(half), g.n - tile * half)
                                      : min(static_cast<int64_t>(tc), g.n - tile * tc);
    const uint32_t seg = static_cast<uint32_t>(seg_cols * sizeof(T));
    ptx::mbarrier_arrive_expect_tx(&ring.full[slot], static_cast<uint32_t>(r1 - r0) * seg * (g.paired ? 2 : 1));
    unsigned char* dst = stages + slot * kLayerStageBytes;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t k = k0 + r;
      unsigned char* row = dst + (r - r0) * row_bytes;
      if (g.paired) {
        ptx::bulk_load(row, w.a + k * w.ld + tile * half, seg, &ring.full[slot], policy);
        ptx::bulk_load(row + half * sizeof(T), w.b + k * w.ld + tile * half, seg, &ring.full[slot], policy);
      } else {
        const T* src = k < w.split ? w.a + k * w.ld : w.b + (k - w.split) * w.ld;
        ptx::bulk_load(row, src + tile * tc, seg, &ring.full[slot], policy);
      }
    }
  };
  // The previous unit's (or the attention's) ordinary writes to these bytes come before the
  // copy engine's.
  ptx::fence_proxy_async_shared();
  __syncthreads();
  if (tid == 0) {
    for (int n = 0; n < kLayerRingStages - 1; ++n) issue(n);
  }
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
  for (int64_t n = 0; n < steps; ++n) {
    if (tid == 0) issue(n + kLayerRingStages - 1);
    const uint32_t at = ring_pos + static_cast<uint32_t>(n), slot = at % kLayerRingStages;
    ptx::mbarrier_wait(&ring.full[slot], (at / kLayerRingStages) & 1);
    const unsigned char* src = stages + slot * kLayerStageBytes + v * sizeof(T);
    const int64_t r0 = n * stage_rows, nr = min(static_cast<int64_t>(stage_rows), rows - r0);
    if (live) {
      for (int j = rg; j < nr; j += groups) {
        float wf[8];
        unpack<T>(ptx::lds128(src + j * row_bytes), wf);
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          const float xin = stage[b * cr + r0 + j];
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[b][q] = fmaf(xin, wf[q], acc[b][q]);
        }
      }
    }
    ptx::mbarrier_arrive(&ring.empty[slot]);
  }
  ring_pos += static_cast<uint32_t>(steps);
  __syncthreads();  // every thread is done with the ring: it holds the row groups' sums now
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
