// SwiGLU's GEMV regime (M <= 8) on CUDA cores: see SwigluVariant::kGemv in swiglu.h.
//
// Block = (128-column tile, K chunk), 256 threads. Lane l of warp w owns the 8 columns
// [8 (l % 16), +8) of the tile and walks the chunk's rows from row group
//   up:   (w % 4) * 2 + l / 16, step 8  (warps 0-3 read w_gate, 4-7 w_up: same columns)
//   down: w * 2 + l / 16, step 16
// loading 16-byte weight vectors (8 in flight per thread, 6 at 8 rows) straight into
// registers and FMA-ing them with x, which sits in shared memory as fp32 [row][MR]. Row groups are
// summed in a fixed order (a shuffle, then shared memory), K chunks through fp32 slots in
// the workspace, summed in chunk order by whichever block of the tile arrives last.
// Why tile-aligned K chunks, not equal flat chunks that would balance the SMs exactly: the
// blocks of one K chunk start together and read the same weight rows of neighbouring
// tiles at about the same time (DRAM pages shared); equal chunks starting at arbitrary rows
// measured 20-30% slower on H100 (benchmarks/results/logs/session9).
// The down kernel is launched programmatically (PDL, SwigluParams::pdl): its blocks start
// as up blocks retire and issue their first w_down loads before waiting for A2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/activation.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "kernels/launch.cuh"
#include "kernels/swiglu_launch.h"

namespace jax_cluster {
namespace {

constexpr int kThreads = 256;
constexpr int kCols = static_cast<int>(kSwigluGemvCols);
// 16-byte weight loads in flight per thread (fewer at 8 rows: registers, no spills).
template <int MR>
constexpr int kUnroll = MR >= 8 ? 6 : 8;
// Blocks per SM (more loads in flight) as far as registers allow without spills.
template <int MR>
constexpr int kMinBlocks = MR <= 2 ? 3 : 2;

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

template <typename T, int MR>
__global__ void __launch_bounds__(kThreads, kMinBlocks<MR>) swiglu_gemv_kernel(const GemvArgs a) {
  extern __shared__ __align__(16) float smem[];  // x chunk [rows][MR], later the reduction
  __shared__ int is_last;
  if (a.trigger) ptx::griddep_launch_dependents();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // kc-major order: blocks running together read the same rows of neighbouring tiles
  const int64_t tile = blockIdx.x % a.tiles, kc = blockIdx.x / a.tiles;
  const int64_t r0 = kc * a.chunk, r1 = min(a.k, r0 + a.chunk);
  const int rows = static_cast<int>(max(static_cast<int64_t>(0), r1 - r0));
  const int m = static_cast<int>(a.m);

  const int c8 = (lane & 15) * 8;
  const int64_t col = tile * kCols + c8;
  const bool active = col < a.n;
  const int step = a.up ? 8 : 16;
  const int rg = a.up ? (warp & 3) * 2 + (lane >> 4) : warp * 2 + (lane >> 4);
  const T* w = static_cast<const T*>(a.up && warp >= 4 ? a.w1 : a.w0) + r0 * a.n + col;
  auto load = [&](int r) {
    return active && r < rows ? ptx::ldg_stream(w + static_cast<int64_t>(r) * a.n)
                              : make_uint4(0, 0, 0, 0);
  };
  // The first weight loads fly while x is staged (and, for down, while A2 is finished).
  uint4 v[kUnroll<MR>];
#pragma unroll
  for (int u = 0; u < kUnroll<MR>; ++u) v[u] = load(rg + u * step);
  if (a.wait_prior) ptx::griddep_wait();

  // x chunk -> shared memory, fp32, [row][MR] (rows of x past m are zero)
  const T* x = static_cast<const T*>(a.x);
  for (int e = tid; e < MR * rows; e += kThreads) {
    const int mi = e / rows, r = e - mi * rows;
    smem[r * MR + mi] = mi < m ? to_float(x[mi * a.k + r0 + r]) : 0.f;
  }
  __syncthreads();

  float acc[MR][8];
#pragma unroll
  for (int i = 0; i < MR; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
  // Rotating buffer: each consumed vector's register is refilled with the load kUnroll
  // rows ahead at once, so about kUnroll loads stay in flight per thread throughout.
  for (int r = rg; r < rows; r += step * kUnroll<MR>) {
#pragma unroll
    for (int u = 0; u < kUnroll<MR>; ++u) {
      const int rr = r + u * step;
      float f[8];
      unpack<T>(v[u], f);
      v[u] = load(rr + step * kUnroll<MR>);
      if (rr >= rows) continue;
      const float* xr = smem + rr * MR;
#pragma unroll
      for (int i = 0; i < MR; ++i) {
        const float xv = xr[i];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(xv, f[j], acc[i][j]);
      }
    }
  }
  // Row groups of a warp's two half-warps (same columns): one shuffle.
#pragma unroll
  for (int i = 0; i < MR; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], 16);

  // Warps -> shared memory [warp][MR][128], then per output: sum over the warps that
  // share it, in warp order (up: 4 gate warps, 4 up warps; down: all 8).
  __syncthreads();  // the x chunk is dead
  if (lane < 16) {
#pragma unroll
    for (int i = 0; i < MR; ++i) {
      float4* dst = reinterpret_cast<float4*>(smem + (warp * MR + i) * kCols + c8);
      dst[0] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      dst[1] = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
    }
  }
  __syncthreads();
  const int width = tile_width(a);  // [gate | up] or [y]
  const int per_sum = a.up ? 4 : 8;
  // This block's partial: straight to the output when K is not split, else to its slot.
  float* slot = a.splits > 1 ? a.slots + ((tile * a.splits + kc) * a.m) * width : nullptr;
  for (int e = tid; e < m * kCols; e += kThreads) {
    const int row = e / kCols, c = e - row * kCols;
    float s0 = 0.f, s1 = 0.f;
    for (int q = 0; q < per_sum; ++q) s0 += smem[(q * MR + row) * kCols + c];
    if (a.up) {
      for (int q = 4; q < 8; ++q) s1 += smem[(q * MR + row) * kCols + c];
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
        cudaMemsetAsync(counters, 0, 4 * (l.tiles_up + l.tiles_down), stream));
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
    const size_t x_bytes = static_cast<size_t>(a.chunk) * MR * 4;
    const size_t red_bytes = static_cast<size_t>(8) * MR * kCols * 4;
    const size_t smem = x_bytes > red_bytes ? x_bytes : red_bytes;
    const unsigned blocks = static_cast<unsigned>(a.tiles) * static_cast<unsigned>(a.splits);
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(swiglu_gemv_kernel<T, MR>, dim3(blocks),
                                                         dim3(kThreads), smem, a.wait_prior,
                                                         stream, a));
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_typed(const SwigluParams& p, cudaStream_t stream) {
  switch (swiglu_gemv_rows(p.m)) {
    case 1: return launch_rows<T, 1>(p, stream);
    case 2: return launch_rows<T, 2>(p, stream);
    case 4: return launch_rows<T, 4>(p, stream);
    case 8: return launch_rows<T, 8>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_swiglu_gemv(const SwigluParams& p, cudaStream_t stream) {
  if (p.m > kSwigluGemvMaxRows) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kF16: return launch_typed<__half>(p, stream);
    case DType::kBF16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kF32: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_cluster
