// Probe: how fast can 128 blocks (one per SM) read Llama-2-7B's W_qkv [4096, 12288] fp16
// in the access patterns of attention_block's fused kernels, with and without a rolling L2
// prefetch (cp.async.bulk.prefetch, issued by the bulk-copy engine) ahead of the loads?
// Each block reads up to three "streams" of equal segments (offset, segment bytes, stride,
// count) with 16-byte loads, THREADS x U per iteration. Prints GB/s per pattern and
// loop configuration. Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a segment_read.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

struct Stream {
  int64_t offset;
  int seg, count;
  int64_t stride;
};
struct BlockStreams {
  Stream s[3];
  int n;
};

__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// AHEAD > 0: the segments of the iteration AHEAD steps later are prefetched first.
template <int THREADS, int U, int AHEAD>
__global__ void __launch_bounds__(THREADS)
    read_kernel(const unsigned char* base, const BlockStreams* plan, uint32_t* sink) {
  const BlockStreams bs = plan[blockIdx.x];
  uint32_t acc = 0;
  for (int k = 0; k < bs.n; ++k) {
    const Stream st = bs.s[k];
    const int vps = st.seg / 16;
    const int total = vps * st.count;
    constexpr int kStep = THREADS * U;
    auto prefetch_segments = [&](int s0, int s1) {
      for (int g = s0 + threadIdx.x; g < min(s1, st.count); g += THREADS) {
        prefetch_l2(base + st.offset + g * st.stride, st.seg);
      }
    };
    if (AHEAD > 0) prefetch_segments(0, (AHEAD * kStep + vps - 1) / vps);
    for (int i0 = 0; i0 < total; i0 += kStep) {
      if (AHEAD > 0) {
        prefetch_segments((i0 + AHEAD * kStep + vps - 1) / vps,
                          (i0 + (AHEAD + 1) * kStep + vps - 1) / vps);
      }
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + threadIdx.x + u * THREADS;
        if (i < total) {
          const unsigned char* p = base + st.offset + static_cast<int64_t>(i / vps) * st.stride + (i % vps) * 16;
          asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                       : "l"(p));
        } else {
          v[u] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;
}

using Kernel = void (*)(const unsigned char*, const BlockStreams*, uint32_t*);
struct Config {
  const char* name;
  Kernel kernel;
  int threads;
};
const Config kConfigs[] = {
    {"256x16", read_kernel<256, 16, 0>, 256},  // the registers kernel's GEMV loop
    {"+L2 ahead 2", read_kernel<256, 16, 2>, 256},
    {"256x32", read_kernel<256, 32, 0>, 256},
    {"512x16", read_kernel<512, 16, 0>, 512},
    {"1024x16", read_kernel<1024, 16, 0>, 1024},
};

int main() {
  const int D = 4096, H = 32, DH = 128;
  const int64_t row = 3LL * H * DH * 2;  // 24576 B
  const int64_t bytes = D * row;
  unsigned char* w;
  uint32_t* sink;
  BlockStreams* dplan;
  cudaMalloc(&w, bytes);
  cudaMemset(w, 1, bytes);
  cudaMalloc(&sink, 4096);
  cudaMalloc(&dplan, sizeof(BlockStreams) * 512);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  auto run = [&](const char* name, const std::vector<BlockStreams>& plan) {
    int64_t total = 0;
    for (auto& p : plan)
      for (int k = 0; k < p.n; ++k) total += static_cast<int64_t>(p.s[k].seg) * p.s[k].count;
    cudaMemcpy(dplan, plan.data(), sizeof(BlockStreams) * plan.size(), cudaMemcpyHostToDevice);
    printf("%-40s %3zu blocks:", name, plan.size());
    for (const Config& c : kConfigs) {
      for (int i = 0; i < 3; ++i) c.kernel<<<plan.size(), c.threads>>>(w, dplan, sink);
      const int reps = 50;
      float best = 1e30f;
      for (int r = 0; r < 5; ++r) {
        cudaEventRecord(a);
        for (int i = 0; i < reps; ++i) c.kernel<<<plan.size(), c.threads>>>(w, dplan, sink);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        best = std::min(best, ms);
      }
      printf("  %s %.0f", c.name, total / (best * 1e3 / reps) / 1e3);
    }
    printf(" GB/s\n");
  };
  const int64_t kq = 0, kk = H * DH * 2, kv = 2 * H * DH * 2;  // byte offsets of Q, K, V columns
  for (int n : {4, 3}) {
    std::vector<BlockStreams> cols, rows, grouped_rows, contiguous;
    const int per = (D + n - 1) / n;
    for (int h = 0; h < H; ++h) {
      for (int r = 0; r < n; ++r) {
        // registers kernel: block r takes 8-column vectors [v0, v1) of the head's Q|K|V
        BlockStreams c{};
        const int vecs = 48, v0 = r * ((vecs + n - 1) / n), v1 = std::min(vecs, v0 + (vecs + n - 1) / n);
        for (int part = 0; part < 3; ++part) {
          const int lo = std::max(v0, part * 16), hi = std::min(v1, part * 16 + 16);
          if (lo >= hi) continue;
          const int64_t at = (part == 0 ? kq : part == 1 ? kk : kv) + h * DH * 2 + (lo - part * 16) * 16;
          c.s[c.n++] = {at, (hi - lo) * 16, D, row};
        }
        cols.push_back(c);
        // TMA kernel: block r takes rows [r0, r0 + cnt) of the three 256-B head segments
        BlockStreams t{};
        const int r0 = r * per, cnt = std::min(D, r0 + per) - r0;
        for (int64_t off : {kq, kk, kv}) t.s[t.n++] = {off + h * DH * 2 + r0 * row, DH * 2, cnt, row};
        rows.push_back(t);
        // grouped layout [H][D][3 Dh]: the cluster's weights contiguous, rows split
        BlockStreams g{};
        g.s[g.n++] = {static_cast<int64_t>(h) * D * 768 + r0 * 768LL, 768, cnt, 768};
        grouped_rows.push_back(g);
      }
    }
    for (int blk = 0; blk < H * n; ++blk) {
      BlockStreams c{};
      const int64_t chunk = bytes / (H * n) / 16384 * 16384;
      c.s[c.n++] = {blk * chunk, 16384, static_cast<int>(chunk / 16384), 16384};
      contiguous.push_back(c);
    }
    printf("cluster size %d\n", n);
    run("  contiguous chunk per block", contiguous);
    run("  W_qkv column split (registers kernel)", cols);
    run("  W_qkv row split, 256 B (TMA kernel)", rows);
    run("  grouped [H][D][3Dh], row split", grouped_rows);
  }
  if (cudaGetLastError() != cudaSuccess) printf("CUDA error\n");
  return 0;
}
