// Probe: how fast can blocks read SwiGLU's weights in the GEMV's tile pattern, and does the
// way work is handed out (one static wave, many hardware-scheduled waves, persistent blocks
// taking items from an atomic counter) decide it? Every block reads items = (column tile of
// TW columns of nm matrices [K, N] fp16, a chunk of R rows) with 16-byte loads, U in flight
// per thread, and XORs them into a sink. Occupancy is capped with dynamic shared memory.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a gemv_read.cu -o gemv_read
// (GEMV_ONLY=1: only the gemv lane patterns). Findings: docs/swiglu.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../../cpp/include/jax_cluster/ptx.cuh"  // ldg_stream: the kernels' weight loads

using jax_cluster::ptx::ldg_stream;

struct Plan {
  const unsigned char* w[2];
  int nm;              // matrices read per item (gate + up: 2)
  int64_t k, n;        // [K, N] fp16
  int tw, rows;        // item: tw columns x rows
  int tiles, chunks;   // items = tiles * chunks, kc-major
  unsigned* counter;   // persistent mode: next item
  int persistent;
};


template <int THREADS, int U>
__device__ __forceinline__ uint32_t read_item(const Plan& p, int item) {
  uint32_t acc = 0;
  uint4 v[U];
  if (p.tw == 0) {  // contiguous: item = 16 whole rows of matrix 0
    const uint4* src = reinterpret_cast<const uint4*>(p.w[0] + item * 16 * p.n * 2);
    const int total = static_cast<int>(min(16 * p.n / 8, (p.k - item * 16) * p.n / 8));
    for (int i0 = 0; i0 < total; i0 += THREADS * U) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + threadIdx.x + u * THREADS;
        v[u] = i < total ? ldg_stream(src + i) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    return acc;
  }
  const int tile = item % p.tiles, kc = item / p.tiles;
  const int64_t r0 = static_cast<int64_t>(kc) * p.rows;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.rows), p.k - r0));
  const int vshift = __ffs(p.tw / 8) - 1;   // 16-byte vectors per row per matrix: power of 2
  const int mshift = p.nm - 1;
  const int total = (rows << mshift) << vshift;  // (row, matrix, vector), vector fastest
  const unsigned char* w0 = p.w[0] + r0 * p.n * 2 + static_cast<int64_t>(tile) * p.tw * 2;
  const int64_t mat_off = p.w[1] - p.w[0];
  for (int i0 = 0; i0 < total; i0 += THREADS * U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + threadIdx.x + u * THREADS;
      if (i < total) {
        const int vec = i & ((1 << vshift) - 1), rm = i >> vshift;
        const int mat = rm & mshift, r = rm >> mshift;
        v[u] = ldg_stream(w0 + mat * mat_off + r * p.n * 2 + vec * 16);
      } else {
        v[u] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  return acc;
}

template <int THREADS, int U>
__global__ void __launch_bounds__(THREADS) tile_read(const Plan p, uint32_t* sink) {
  extern __shared__ uint32_t pad[];  // occupancy cap only
  __shared__ int next;
  uint32_t acc = 0;
  const int items = p.tiles * p.chunks;
  if (!p.persistent) {
    acc = read_item<THREADS, U>(p, blockIdx.x);
  } else {
    for (;;) {
      if (threadIdx.x == 0) next = static_cast<int>(atomicAdd(p.counter, 1u));
      __syncthreads();
      const int item = next;
      __syncthreads();
      if (item >= items) break;
      acc ^= read_item<THREADS, U>(p, item);
    }
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = acc + pad[0];
}

// The gemv kernel's tensor-core access pattern (cpp/ops/swiglu/launch_gemv.cu, up stage, 128-column
// tiles): warp w reads matrix w / 4, half w % 2 (64 columns), row group (w / 2) % 2 of
// 16-row steps; lane (g, c) loads rows 4c..4c+3 of a step at columns [8g, +8): each load
// instruction touches 4 rows x 128 B. WIDE = 1: the same work with each instruction
// covering 2 rows x 256 B (a warp owns both halves, 4 row groups). WIDE = 2: the gemv's
// lanes, but a warp owns both halves and reads a row's two halves back to back.
template <int WIDE>
__global__ void __launch_bounds__(256) gemv_pattern(const Plan p, uint32_t* sink) {
  extern __shared__ uint32_t pad[];
  constexpr int kU = 3;  // half-steps of 4 loads in flight (the kernel once ran 3; it keeps 2 now)
  const int item = blockIdx.x, tile = item % p.tiles, kc = item / p.tiles;
  const int64_t r0 = static_cast<int64_t>(kc) * p.rows;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.rows), p.k - r0));
  const int steps = rows / 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int matrix = warp >> 2;
  const int groups = WIDE ? 4 : 2;
  const int rg = WIDE ? warp & 3 : (warp >> 1) & 1;
  const int half = WIDE ? 0 : warp & 1;  // WIDE 2: both halves, the gemv's lanes
  const int64_t n2 = p.n * 2;
  const unsigned char* w = p.w[0] + (matrix ? p.w[1] - p.w[0] : 0) + r0 * n2 +
                           static_cast<int64_t>(tile) * p.tw * 2 + half * 128;
  if (WIDE == 1) {
    w += (lane >> 4) * n2 + (lane & 15) * 16;
  } else {
    w += 4 * (lane & 3) * n2 + (lane >> 2) * 16;
  }
  // WIDE covers a 16-row step with 8 loads per thread: two half-steps of 4 loads
  uint4 v[kU][4];
  const int per = WIDE ? 2 : 1;  // half-steps per step
  auto load_h = [&](uint4 (&vv)[4], int hs) {
    const int st = hs / per;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = WIDE == 1 ? 16 * st + 8 * (hs % per) + 2 * i
                          : WIDE == 2 ? 16 * st + 2 * (hs % per) + (i >> 1) : 16 * st + i;
      const int col = WIDE == 2 ? (i & 1) * 128 : 0;  // halves of a row back to back
      vv[i] = st < steps ? ldg_stream(w + row * n2 + col) : make_uint4(0, 0, 0, 0);
    }
  };
  const int hsteps = steps * per;
  uint32_t acc = 0;
  // half-step hs belongs to this warp when (hs / per) % groups == rg
  auto nth = [&](int j) { return ((j / per) * groups + rg) * per + j % per; };
#pragma unroll
  for (int u = 0; u < kU; ++u) load_h(v[u], nth(u));
  for (int j = 0; nth(j) < hsteps; j += kU) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc ^= v[u][i].x ^ v[u][i].y ^ v[u][i].z ^ v[u][i].w;
      load_h(v[u], nth(j + u + kU));
    }
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = acc + pad[0];
}

using Kernel = void (*)(const Plan, uint32_t*);

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int64_t kMaxBytes = 2LL * 4096 * 14336 * 2;
  unsigned char* base;
  uint32_t* sink;
  unsigned* counter;
  cudaMalloc(&base, kMaxBytes);
  cudaMemset(base, 1, kMaxBytes);
  cudaMalloc(&sink, 1 << 20);
  cudaMalloc(&counter, 4);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (Kernel k : {tile_read<256, 8>, tile_read<256, 16>, tile_read<512, 8>, gemv_pattern<0>,
                   gemv_pattern<1>, gemv_pattern<2>}) {
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  }
  // returns GB/s (best of 5 x 20 launches)
  auto time = [&](Kernel kern, int threads, Plan p, int per_sm) -> double {
    const int items = p.tiles * p.chunks;
    // dynamic smem so that at most per_sm blocks fit an SM (228 KB per SM)
    const size_t smem = per_sm >= 8 ? 0 : (220 * 1024) / per_sm - 1024;
    const int grid = p.persistent ? sms * per_sm : items;
    p.counter = counter;
    float best = 1e30f;
    for (int r = 0; r < 6; ++r) {
      cudaEventRecord(a);
      for (int i = 0; i < 20; ++i) {
        if (p.persistent) cudaMemsetAsync(counter, 0, 4);
        kern<<<grid, threads, smem>>>(p, sink);
      }
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float ms;
      cudaEventElapsedTime(&ms, a, b);
      if (r > 0) best = std::min(best, ms);
    }
    const double bytes = static_cast<double>(p.nm) * p.k * p.n * 2;
    return bytes / (best * 1e-3 / 20) / 1e9;
  };
  struct Shape { const char* name; int nm; int64_t k, n; };
  const Shape shapes[] = {{"llama2 up (2x[4096,11008])", 2, 4096, 11008},
                          {"llama2 down ([11008,4096])", 1, 11008, 4096},
                          {"llama3 up (2x[4096,14336])", 2, 4096, 14336}};
  for (const Shape& s : shapes) {
    Plan p{};
    p.w[0] = base;
    p.w[1] = base + s.k * s.n * 2;
    p.nm = s.nm;
    p.k = s.k;
    p.n = s.n;
    // contiguous baseline: the same bytes as 1-column "tiles" of whole rows
    {
      Plan c = p;
      c.tw = 0;
      c.nm = 1;
      c.tiles = 1;
      c.rows = 16;
      c.chunks = static_cast<int>((s.k + 15) / 16);  // matrix 0 only: rate is what counts
      printf("%s contiguous 16-row items: static %.0f | persistent(4/SM) ", s.name,
             time(tile_read<256, 8>, 256, c, 8));
      c.persistent = 1;
      printf("%.0f GB/s\n", time(tile_read<256, 8>, 256, c, 4));
    }
    if (s.nm == 2) {  // the gemv kernel's own partition: tw 128, one wave of 2 per SM
      Plan q = p;
      q.tw = 128;
      q.tiles = static_cast<int>(s.n / 128);
      for (int per_sm : {2}) {
        for (int chunks : {std::max(1, (sms * per_sm) / q.tiles), 8, 16}) {
          q.rows = static_cast<int>((s.k + chunks - 1) / chunks + 15) / 16 * 16;
          q.chunks = static_cast<int>((s.k + q.rows - 1) / q.rows);
          printf("%s GEMV PATTERN %d/SM rows %5d (%5d items, %5.2f waves): probe 256x8 %.0f | "
                 "gemv 4x128B %.0f | gemv 2x256B %.0f | gemv 4x128B halves paired %.0f GB/s\n",
                 s.name, per_sm, q.rows, q.tiles * q.chunks,
                 static_cast<double>(q.tiles * q.chunks) / (sms * per_sm),
                 time(tile_read<256, 8>, 256, q, per_sm), time(gemv_pattern<0>, 256, q, per_sm),
                 time(gemv_pattern<1>, 256, q, per_sm), time(gemv_pattern<2>, 256, q, per_sm));
        }
      }
    }
    if (getenv("GEMV_ONLY")) continue;
    for (int tw : {64, 128, 256}) {
      p.tw = tw;
      p.tiles = static_cast<int>(s.n / tw);
      for (int per_sm : {2, 4}) {
        // one static wave: chunks so that tiles * chunks ~ sms * per_sm
        const int wave_chunks = std::max(1, (sms * per_sm) / p.tiles);
        for (int rows : {0, 1024, 512, 256, 128}) {
          Plan q = p;
          q.rows = rows == 0 ? static_cast<int>((s.k + wave_chunks - 1) / wave_chunks + 15) / 16 * 16 : rows;
          q.chunks = static_cast<int>((s.k + q.rows - 1) / q.rows);
          const double st8 = time(tile_read<256, 8>, 256, q, per_sm);
          const double st16 = time(tile_read<256, 16>, 256, q, per_sm);
          const double st512 = time(tile_read<512, 8>, 512, q, per_sm);
          q.persistent = 1;
          const double pe8 = time(tile_read<256, 8>, 256, q, per_sm);
          const double pe16 = time(tile_read<256, 16>, 256, q, per_sm);
          printf("%s tw %3d  %d/SM  rows %5d (%5d items, %5.2f waves): static 256x8 %.0f 256x16 %.0f "
                 "512x8 %.0f | persistent 256x8 %.0f 256x16 %.0f GB/s\n",
                 s.name, tw, per_sm, q.rows, q.tiles * q.chunks,
                 static_cast<double>(q.tiles * q.chunks) / (sms * per_sm), st8, st16, st512, pe8,
                 pe16);
        }
      }
    }
  }
  if (cudaGetLastError() != cudaSuccess) printf("CUDA error %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
