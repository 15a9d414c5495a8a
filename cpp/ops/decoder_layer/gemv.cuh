// The one-launch layer's GEMV unit: B (<= 8) input rows times a 256-column tile of a
// row-major [K, N] weight over one K chunk, by 8 warps on the tensor cores:
//
//   staging  the unit's input rows [B, chunk] in fp32 shared memory, built by the phase's
//            functor (a norm of x or h, the attention output, the MLP activation)
//   stream   warp w owns the chunk's 16-row blocks w, w + 8, ...: each block's 16 rows x 512
//            bytes go through the warp's own ring of kLayerRingSlots slots (cp.async, lane l
//            copies 16-byte vector l of every row, XOR-swizzled so ldmatrix is
//            conflict-free); a warp only reads what it copied, so the loop has no block
//            barrier, only __syncwarp
//   math     out^T = W^T in^T: ldmatrix.trans turns a 16 x 16 block of W into an mma A
//            fragment (16 output columns), the staged inputs are the B fragment (8 rows of
//            the batch). An fp32 input is the sum of two 16-bit halves (hi = round(v),
//            lo = round(v - hi)), both multiplied into the same fp32 accumulators: the
//            weights are exact in 16 bits and the inputs keep ~16 bits more than a plain
//            rounding (fp32's contract within the tolerance). Per 16 x 256 block a warp
//            issues 16 ldmatrix and 32 mma, where the FMA form issued ~250 instructions.
//   reduce   the warps' sums in warp order (in the ring's memory, idle by then)
//   finish   one chunk: the tile's [B, 256] sums go to the phase's epilogue; several:
//            fp32 partials, and the unit that raises the tile's counter to `chunks` sums them
//            in chunk order and runs the epilogue (threadfence-reduction)
// Every sum has a fixed order whoever arrives last: bitwise reproducible.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/mma.cuh"
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

inline constexpr int kLayerWarps = kLayerThreads / 32;
inline constexpr int kLayerStepRows = 16;  // rows of a warp's ring slot (one mma K step)
inline constexpr int kLayerRingSlots = 2;  // per warp: one slot lands while the other is read
inline constexpr int kLayerSlotBytes = kLayerStepRows * kLayerTileCols * 2;
inline constexpr int kLayerRingFloats = kLayerWarps * kLayerRingSlots * kLayerSlotBytes / 4;
inline constexpr int kLayerStagePad = 8;  // floats between staged rows: the B fragments' loads hit 8 banks

// Shared memory of one unit, in floats: the weight ring (then the warps' sums), staged
// input, the tile's values.
template <int NB>
__host__ __device__ constexpr int layer_gemv_smem_floats() {
  static_assert(NB <= 8, "the batch is one mma n8 fragment");
  static_assert(kLayerWarps * NB * kLayerTileCols <= kLayerRingFloats, "the warps' sums reuse the ring");
  return kLayerRingFloats + kLayerStageFloats + NB * kLayerStagePad + NB * kLayerTileCols + 32;
}

// v = hi + lo in two 16-bit halves, packed as mma B fragment registers (k, k + 1).
template <typename T>
__device__ __forceinline__ void split_pair(float2 v, uint32_t& hi, uint32_t& lo) {
  hi = pack2<T>(v.x, v.y);
  const T* h = reinterpret_cast<const T*>(&hi);
  lo = pack2<T>(v.x - to_float(h[0]), v.y - to_float(h[1]));
}

// One unit (tile, chunk) of GEMV g. in(b, k): the fp32 input; finish(tile, vals, batch):
// the epilogue of the tile's sums vals[b * 256 + v] (shared memory, all threads call it).
template <typename T, int NB, typename In, typename Finish>
__device__ void layer_gemv_unit(const LayerGemv& g, const LayerWeights<T>& w, int64_t tile, int64_t chunk,
                                int batch, float* smem, float* partials, unsigned int* tile_counters, In in,
                                Finish finish) {
  constexpr int tc = kLayerTileCols, half = tc / 2;
  float* red = smem;  // [warp][b][column], after the loop
  float* stage = smem + kLayerRingFloats;
  float* vals = stage + kLayerStageFloats + NB * kLayerStagePad;
  int* last = reinterpret_cast<int*>(vals + NB * tc);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t k0 = chunk * g.chunk_rows, rows = min(g.chunk_rows, g.k - k0);
  const int cs = static_cast<int>(g.chunk_rows) + kLayerStagePad;  // staged row stride
  const int blocks = static_cast<int>((rows + kLayerStepRows - 1) / kLayerStepRows);
  const int steps = blocks > warp ? (blocks - warp + kLayerWarps - 1) / kLayerWarps : 0;

  // This lane's 16-byte vector of every row: column `col` of matrix a (or b past `split`).
  const int v = lane * 8;
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
  const uint32_t ring = ptx::smem_addr(smem) + warp * kLayerRingSlots * kLayerSlotBytes;
  // Row block `step` of this warp (chunk rows 16 (warp + 8 step) + r) into slot `slot`.
  auto issue = [&](int step, int slot) {
    if (step < steps) {
      const int64_t r0 = static_cast<int64_t>(kLayerStepRows) * (warp + kLayerWarps * step);
#pragma unroll
      for (int r = 0; r < kLayerStepRows; ++r) {
        const int64_t k = k0 + r0 + r;
        const bool on = live && r0 + r < rows;
        const T* src = on ? (k < w.split ? base_a : base_b) + k * w.ld : w.a;
        cp_async_16(ring + slot * kLayerSlotBytes + swz(r, lane, tc * 2), src, on ? 16 : 0);
      }
    }
    cp_async_commit();  // empty groups keep the count uniform
  };
#pragma unroll
  for (int s = 0; s < kLayerRingSlots - 1; ++s) issue(s, s);

  // Staged rows past the chunk's rows (up to its last 16-row block) are zeros: their weight
  // rows are zero-filled, and 0 x garbage could be NaN.
  const int64_t staged_rows = static_cast<int64_t>(blocks) * kLayerStepRows;
  for (int64_t e = tid; e < NB * staged_rows; e += kLayerThreads) {
    const int b = static_cast<int>(e / staged_rows);
    const int64_t r = e % staged_rows;
    stage[b * cs + r] = b < batch && r < rows ? in(b, k0 + r) : 0.f;
  }
  float acc[tc / 16][4];
#pragma unroll
  for (int m = 0; m < tc / 16; ++m) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[m][j] = 0.f;
  }
  __syncthreads();
  // ldmatrix: lanes 8i..8i+7 address matrix i's rows: rows (i / 2) * 8 + (lane % 8), column
  // chunk 2 m + i % 2 (A fragment order: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), ...).
  const int lm_row = ((lane >> 4) << 3) + (lane & 7), lm_chunk = (lane >> 3) & 1;
  // B fragment: batch row g = lane / 4 (zero past NB), input rows 2 (lane % 4) + {0, 1} (+ 8).
  const int gb = lane >> 2, kq = (lane & 3) * 2;
  for (int step = 0; step < steps; ++step) {
    const int slot = step % kLayerRingSlots;
    issue(step + kLayerRingSlots - 1, (step + kLayerRingSlots - 1) % kLayerRingSlots);
    cp_async_wait<kLayerRingSlots - 1>();  // this lane's copies of `step` landed
    __syncwarp();                          // ... and every lane's
    const int r0 = kLayerStepRows * (warp + kLayerWarps * step);
    uint32_t bhi[2] = {0u, 0u}, blo[2] = {0u, 0u};
    if (gb < NB) {
      const float* s = stage + gb * cs + r0 + kq;
      split_pair<T>(*reinterpret_cast<const float2*>(s), bhi[0], blo[0]);
      split_pair<T>(*reinterpret_cast<const float2*>(s + 8), bhi[1], blo[1]);
    }
    const uint32_t slot_addr = ring + slot * kLayerSlotBytes;
#pragma unroll
    for (int m = 0; m < tc / 16; ++m) {
      uint32_t a[4];
      ldsm_x4_trans(a, slot_addr + swz(lm_row, 2 * m + lm_chunk, tc * 2));
      mma16816<T>(acc[m], a, bhi[0], bhi[1]);
      mma16816<T>(acc[m], a, blo[0], blo[1]);
    }
    __syncwarp();  // every lane's ldmatrix of this slot is done before it is refilled
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the ring: it holds the warps' sums now
  // acc[m]: columns 16 m + lane / 4 (+ 8) of batch rows 2 (lane % 4) + {0, 1}.
#pragma unroll
  for (int m = 0; m < tc / 16; ++m) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int b = kq + (j & 1), c = 16 * m + gb + (j >> 1) * 8;
      if (b < NB) red[(warp * NB + b) * tc + c] = acc[m][j];
    }
  }
  __syncthreads();
  for (int e = tid; e < NB * tc; e += kLayerThreads) {
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < kLayerWarps; ++r) s += red[r * NB * tc + e];
    vals[e] = s;
  }
  if (g.chunks > 1) {
    // Partials [chunk][b][tile][256]; the last unit of the tile sums them in chunk order.
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
