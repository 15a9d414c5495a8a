// SwiGLU's GEMV regime (M <= 16): SwigluVariant::kGemv (params.h).
//
// Block = (128-column tile, K chunk), 256 threads. Weights stream from HBM straight into
// registers (16-byte loads, 8 in flight per thread); x sits in shared memory. A warp owns
// 64 columns (one half of the tile) and walks 16-row steps; lane (g, c) = (l / 4, l % 4)
// loads rows 4c..4c+3 of the step at columns [8g, +8), and byte permutes turn the loads
// into mma.sync m16n8k16 A fragments of the transposed weights (two K rows per register;
// the K order inside a step is permuted, and x's B fragment uses the same permutation);
// x (16-bit [row][K], padded rows) is the B operand, so a step costs 4 mma per 8 rows of x
// whatever M is.
//   up:   warps 0-3 w_gate, 4-7 w_up; in each, (half, one of 2 row groups)
//   down: (half, one of 4 row groups)
// Row groups are summed in a fixed order through shared memory, K chunks through fp32
// slots in the workspace, summed in chunk order by whichever block of the tile arrives
// last (deterministic).
// Why tile-aligned K chunks, not equal flat chunks that would balance the SMs exactly: the
// blocks of one K chunk start together and read the same weight rows of neighbouring
// tiles at about the same time (DRAM pages shared); equal chunks starting at arbitrary rows
// measured slower (docs/swiglu.md).
// The down kernel is launched programmatically (PDL, SwigluParams::pdl): its blocks start
// as up blocks retire and issue their first w_down loads before waiting for A2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/activation.cuh"
#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/gemv_mma.cuh"
#include "jax_cluster/launch.cuh"
#include "jax_cluster/mma.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "jax_cluster/zero_words.cuh"
#include "ops/swiglu/launch.h"

namespace jax_cluster {
namespace {

constexpr int kThreads = 256;
constexpr int kCols = static_cast<int>(kSwigluGemvCols);
// 16-row steps in flight per warp (4 loads per thread each). Two, not more: 8 loads per
// thread (64 KB per SM at 2 blocks) read faster than 12 or 16, and refilling a step's
// registers before its math (more in flight) was slower still (docs/swiglu.md).
constexpr int kMmaUnroll = 2;
// Blocks per SM (more loads in flight) as far as registers allow without spills.
constexpr int kMinBlocks = 2;

struct GemvArgs {
  const void* x;         // [m, k]: x (up) or A2 (down)
  const void* w0;        // w_gate (up) or w_down (down): [k, n]
  const void* w1;        // w_up (up) or null
  const void* residual;  // down only; may be null
  void* out;             // A2 [m, n] (up) or y [m, n] (down)
  unsigned int* counters;  // [tiles], zero before the launch
  float* slots;            // [tiles][splits][m][cols_per_tile]
  int64_t m, k, n;
  int64_t chunk;  // K rows per split (multiple of 16)
  int splits, tiles;
  bool up;
  bool wait_prior;  // PDL: wait for the previous kernel (A2) after the first weight loads
  bool trigger;     // PDL: let the next kernel's blocks launch
};

// Columns a block produces per row: gate | up (up) or y (down).
__device__ __forceinline__ int tile_width(const GemvArgs& a) { return a.up ? 2 * kCols : kCols; }

// Partial sums per matrix that a block adds up in shared memory (one per row group).
__device__ __forceinline__ int row_groups(bool up) { return up ? 2 : 4; }

// Output element (row, tile column c) from its K-summed value(s): A2 = SiLU(g) * u (up),
// or y = g (+ residual) (down).
template <typename T>
__device__ __forceinline__ void emit(const GemvArgs& a, int64_t tile, int row, int c, float g,
                                     float u) {
  const int64_t col = tile * kCols + c;
  if (col >= a.n) return;
  T* out = static_cast<T*>(a.out) + row * a.n + col;
  if (a.up) {
    *out = from_float<T>(silu(g) * u);
  } else {
    if (a.residual != nullptr) g += to_float(static_cast<const T*>(a.residual)[row * a.n + col]);
    *out = from_float<T>(g);
  }
}

// x chunk -> shared memory: 16-bit [MR][stride] with rows of x past m zero (16-byte
// copies: rows, r0 and k are multiples of 16).
template <typename T, int MR>
__device__ __forceinline__ void stage_x(const GemvArgs& a, int64_t r0, int rows, float* smem) {
  const T* x = static_cast<const T*>(a.x);
  const int m = static_cast<int>(a.m);
  T* xs = reinterpret_cast<T*>(smem);
  const int vecs = rows / 8, stride = swiglu_gemv_x_stride(rows);
  for (int e = threadIdx.x; e < MR * vecs; e += kThreads) {
    const int mi = e / vecs, q = e - mi * vecs;
    const uint4 val = mi < m ? *reinterpret_cast<const uint4*>(x + mi * a.k + r0 + 8 * q)
                             : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(xs + mi * stride + 8 * q) = val;
  }
}

// This warp's partial [MR][64] (its half of the tile, its row group) ->
// `red`. `w` points at the chunk's first row and the half's first column.
template <typename T, int MR, typename Stage>
__device__ __forceinline__ void mma_partial(const GemvArgs& a, const T* w, int cols, int rows,
                                            int rg, int groups, float* smem, float* red,
                                            Stage&& stage) {
  constexpr int kTiles = MR / 8;  // n8 tiles of x rows
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int steps = rows / 16, stride = swiglu_gemv_x_stride(rows);
  w += 4 * c * a.n + 8 * g;
  auto load = [&](uint4 (&v)[4], int s) {
    const bool ok = cols > 0 && s < steps;  // (a half's columns exist all or none)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = ok ? ptx::ldg_stream(w + static_cast<int64_t>(16 * s + i) * a.n)
                : make_uint4(0, 0, 0, 0);
    }
  };
  uint4 v[kMmaUnroll][4];
#pragma unroll
  for (int u = 0; u < kMmaUnroll; ++u) load(v[u], rg + u * groups);
  stage();
  __syncthreads();

  const T* xs = reinterpret_cast<const T*>(smem);
  float acc[kTiles][4][4];
  zero_acc(acc);
  gemv_mma_stream(v, rg, groups, steps, [&](const uint4 (&wv)[4], int ss) {
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      // B: x row 8t + g at K rows 4c..4c+3 (the mma's k = 2c, 2c+1 | 2c+8, 2c+9)
      const uint2 b = *reinterpret_cast<const uint2*>(xs + (8 * t + g) * stride + 16 * ss + 4 * c);
      gemv_mma_step<T>(wv, b.x, b.y, acc[t]);
    }
  }, load);
  __syncthreads();  // x is dead: `red` overlays it
  // C: acc[t][q] = {(row, col), (row + 1, col), (row, col + 1), (row + 1, col + 1)} with
  // row = 8t + 2c (of x), col = 8g + 2q (of the half)
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const int row = 8 * t + 2 * c;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float* dst = red + row * kCols + 8 * g + 2 * q;
      *reinterpret_cast<float2*>(dst) = make_float2(acc[t][q][0], acc[t][q][2]);
      *reinterpret_cast<float2*>(dst + kCols) = make_float2(acc[t][q][1], acc[t][q][3]);
    }
  }
}

template <typename T, int MR>
__global__ void __launch_bounds__(kThreads, kMinBlocks) swiglu_gemv_kernel(const GemvArgs a) {
  extern __shared__ __align__(16) float smem[];  // x chunk, later the row-group partials
  __shared__ int is_last;
  if (a.trigger) ptx::griddep_launch_dependents();
  const int tid = threadIdx.x, warp = tid >> 5;
  // kc-major order: blocks running together read the same rows of neighbouring tiles
  const int64_t tile = blockIdx.x % a.tiles, kc = blockIdx.x / a.tiles;
  const int64_t r0 = kc * a.chunk, r1 = min(a.k, r0 + a.chunk);
  const int rows = static_cast<int>(max(static_cast<int64_t>(0), r1 - r0));
  const int m = static_cast<int>(a.m);
  const int groups = row_groups(a.up);

  // Warp role: matrix (up: gate | up), half of the tile, row group.
  const int matrix = a.up ? warp >> 2 : 0;
  const int half = warp & 1;
  const int rg = a.up ? (warp >> 1) & 1 : warp >> 1;
  const int64_t col0 = tile * kCols + half * 64;
  // columns of the matrix from col0 on, up to the tile's (a half: all or none, n % 64 == 0)
  const int cols = static_cast<int>(max(static_cast<int64_t>(0), min(a.n - col0, static_cast<int64_t>(kCols))));
  const T* w = static_cast<const T*>(matrix ? a.w1 : a.w0) + r0 * a.n + col0;
  float* red = smem + (matrix * groups + rg) * MR * kCols + half * 64;
  // x is staged after the first weight loads are issued (for down, after A2 is done: PDL)
  auto stage = [&] {
    if (a.wait_prior) ptx::griddep_wait();
    stage_x<T, MR>(a, r0, rows, smem);
  };
  mma_partial<T, MR>(a, w, cols, rows, rg, groups, smem, red, stage);
  __syncthreads();

  // Per output: the row groups' partials summed in group order.
  const int width = tile_width(a);  // [gate | up] or [y]
  // This block's partial: straight to the output when K is not split, else to its slot.
  float* slot = a.splits > 1 ? a.slots + ((tile * a.splits + kc) * a.m) * width : nullptr;
  for (int e = tid; e < m * kCols; e += kThreads) {
    const int row = e / kCols, c = e - row * kCols;
    float s0 = 0.f, s1 = 0.f;
    for (int q = 0; q < groups; ++q) s0 += smem[(q * MR + row) * kCols + c];
    if (a.up) {
      for (int q = groups; q < 2 * groups; ++q) s1 += smem[(q * MR + row) * kCols + c];
    }
    if (slot == nullptr) {
      emit<T>(a, tile, row, c, s0, s1);
    } else {
      slot[row * width + c] = s0;
      if (a.up) slot[row * width + kCols + c] = s1;
    }
  }
  if (slot == nullptr) return;

  // K chunks: the tile's last block to arrive sums every chunk's slot in chunk order.
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    is_last = atomicAdd(a.counters + tile, 1u) == static_cast<unsigned int>(a.splits - 1);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const float* slots = a.slots + tile * a.splits * a.m * width;
  for (int e = tid; e < m * kCols; e += kThreads) {
    const int row = e / kCols, c = e - row * kCols;
    float s0 = 0.f, s1 = 0.f;
    for (int q = 0; q < a.splits; ++q) {
      const float* p = slots + (q * a.m + row) * width + c;
      s0 += __ldcg(p);
      if (a.up) s1 += __ldcg(p + kCols);
    }
    emit<T>(a, tile, row, c, s0, s1);
  }
}

template <typename T, int MR>
cudaError_t launch_rows(const SwigluParams& p, cudaStream_t stream) {
  const SwigluGemvLayout l = swiglu_gemv_layout(p);
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  unsigned int* counters = reinterpret_cast<unsigned int*>(ws + l.counters);
  if (p.k_splits_up > 1 || (p.has_down && p.k_splits_down > 1)) {  // before the up kernel
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
        zero_words(counters, static_cast<int>(l.tiles_up + l.tiles_down), stream));
  }
  for (int up = 1; up >= (p.has_down ? 0 : 1); --up) {
    GemvArgs a;
    a.up = up == 1;
    a.m = p.m;
    a.x = a.up ? p.x : ws;
    a.k = a.up ? p.d : p.f;
    a.n = a.up ? p.f : p.d;
    a.w0 = a.up ? p.w_gate : p.w_down;
    a.w1 = a.up ? p.w_up : nullptr;
    a.residual = !a.up && p.has_residual ? p.residual : nullptr;
    a.out = a.up && p.has_down ? static_cast<void*>(ws) : p.out;
    a.splits = a.up ? p.k_splits_up : p.k_splits_down;
    a.chunk = swiglu_gemv_chunk(a.k, a.splits);
    a.tiles = static_cast<int>(a.up ? l.tiles_up : l.tiles_down);
    a.counters = counters + (a.up ? 0 : l.tiles_up);
    a.slots = reinterpret_cast<float*>(ws + l.slots);
    a.wait_prior = !a.up && p.pdl;
    a.trigger = a.up && p.has_down && p.pdl;
    const size_t smem = swiglu_gemv_smem_bytes(a.chunk, MR);
    const unsigned blocks = static_cast<unsigned>(a.tiles) * static_cast<unsigned>(a.splits);
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(swiglu_gemv_kernel<T, MR>,
                                                         dim3(blocks), dim3(kThreads), smem,
                                                         a.wait_prior, stream, a));
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_swiglu_gemv(const SwigluParams& p, cudaStream_t stream) {
  if (p.m > kSwigluGemvMaxRows) return cudaErrorInvalidValue;
  return dispatch_half(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return dispatch_int<8, 16>(swiglu_gemv_rows(p.m), [&](auto rows) {
      return launch_rows<T, decltype(rows)::value>(p, stream);
    });
  });
}

}  // namespace jax_cluster
