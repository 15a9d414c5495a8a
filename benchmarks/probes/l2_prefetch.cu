// Probe: can weights be asked of L2 while a latency-bound stretch of kernels runs, and do
// they survive other traffic until they are read? Times (median of 10, L2 flushed first):
//   read A from HBM; read A from L2 (a second read);
//   A asked of L2 by a short kernel (bulk prefetches, or one prefetch per 128-byte line,
//   with or without the evict_last priority), then a 40 us wait or a 32 MB stream of
//   other bytes, then read A.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icpp -Icpp/include \
//     benchmarks/probes/l2_prefetch.cu -o /tmp/l2p && /tmp/l2p [A MB] [B MB]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

__global__ void read_kernel(const uint4* p, size_t n, uint4* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                                             : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                                             : "l"(p + i + j * stride));
#pragma unroll
    for (int j = 0; j < 8; ++j) acc.x ^= v[j].x, acc.y ^= v[j].y, acc.z ^= v[j].z, acc.w ^= v[j].w;
  }
  for (; i < n; i += stride) acc.x ^= p[i].x;
  if (acc.x == 0x12345678u) *sink = acc;
}

// mode 0: bulk prefetches of `chunk` bytes; 1: the same with evict_last; 2: one prefetch per
// 128-byte line; 3: per line with evict_last.
__global__ void prefetch_kernel(const char* p, size_t bytes, int mode, uint32_t chunk) {
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  if (mode < 2) {
    for (size_t off = tid * chunk; off < bytes; off += threads * chunk) {
      const uint32_t n = static_cast<uint32_t>((bytes - off < chunk ? bytes - off : chunk));
      if (mode == 0) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
      } else {
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p + off), "r"(n),
                     "l"(policy) : "memory");
      }
    }
  } else {
    for (size_t off = tid * 128; off < bytes; off += threads * 128) {
      if (mode == 2) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
      } else {
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p + off));
      }
    }
  }
}

__global__ void wait_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
}

int main(int argc, char** argv) {
  const size_t a_bytes = static_cast<size_t>((argc > 1 ? std::atof(argv[1]) : 34.6) * 1e6) / 16 * 16;
  const size_t b_bytes = static_cast<size_t>((argc > 2 ? std::atof(argv[2]) : 32.0) * 1e6) / 16 * 16;
  const size_t f_bytes = 512ull << 20;
  char *a, *b, *f;
  uint4* sink;
  CHECK(cudaMalloc(&a, a_bytes));
  CHECK(cudaMalloc(&b, b_bytes));
  CHECK(cudaMalloc(&f, f_bytes));
  CHECK(cudaMalloc(&sink, 16));
  CHECK(cudaMemset(a, 1, a_bytes));
  CHECK(cudaMemset(b, 2, b_bytes));
  CHECK(cudaMemset(f, 3, f_bytes));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto read = [&](const char* p, size_t bytes) {
    read_kernel<<<2 * sms, 256>>>(reinterpret_cast<const uint4*>(p), bytes / 16, sink);
  };
  cudaEvent_t e[4];
  for (auto& x : e) CHECK(cudaEventCreate(&x));
  auto elapsed = [&](int i, int j) {
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e[i], e[j]));
    return 1e3f * ms;
  };
  // scenario: flush, [prefetch], [between], then read A. Returns (prefetch us, between us, read us).
  auto scenario = [&](int mode, int between, uint32_t chunk) {
    std::vector<float> pre, mid, rd;
    for (int rep = 0; rep < 10; ++rep) {
      read(f, f_bytes);
      CHECK(cudaEventRecord(e[0]));
      if (mode == 9) read(a, a_bytes);                          // A read once before: L2
      else if (mode >= 0) prefetch_kernel<<<sms, 128>>>(a, a_bytes, mode, chunk);
      CHECK(cudaEventRecord(e[1]));
      if (between == 1) wait_kernel<<<1, 32>>>(40000);
      if (between == 2) read(b, b_bytes);
      CHECK(cudaEventRecord(e[2]));
      read(a, a_bytes);
      CHECK(cudaEventRecord(e[3]));
      CHECK(cudaEventSynchronize(e[3]));
      pre.push_back(elapsed(0, 1)), mid.push_back(elapsed(1, 2)), rd.push_back(elapsed(2, 3));
    }
    auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    return std::vector<float>{med(pre), med(mid), med(rd)};
  };
  const char* modes[] = {"bulk", "bulk evict_last", "per line", "per line evict_last"};
  const char* betweens[] = {"nothing", "40 us wait", "B stream"};
  std::printf("A %.1f MB, B %.1f MB, %d SMs\n", a_bytes / 1e6, b_bytes / 1e6, sms);
  for (int between = 0; between < 3; ++between) {
    auto r = scenario(-1, between, 0);
    std::printf("%-28s then %-10s: prefetch %6.2f us, between %6.2f us, read A %6.2f us (%.0f GB/s)\n", "no prefetch",
                betweens[between], r[0], r[1], r[2], a_bytes / (r[2] * 1e3));
    r = scenario(9, between, 0);
    std::printf("%-28s then %-10s: prefetch %6.2f us, between %6.2f us, read A %6.2f us (%.0f GB/s)\n",
                "A read before", betweens[between], r[0], r[1], r[2], a_bytes / (r[2] * 1e3));
    for (int mode = 0; mode < 4; ++mode) {
      for (uint32_t chunk : {4096u, 65536u}) {
        if (mode >= 2 && chunk != 4096u) continue;
        r = scenario(mode, between, chunk);
        char name[64];
        std::snprintf(name, sizeof name, "%s%s", modes[mode], mode < 2 ? (chunk == 4096 ? " 4K" : " 64K") : "");
        std::printf("%-28s then %-10s: prefetch %6.2f us, between %6.2f us, read A %6.2f us (%.0f GB/s)\n", name,
                    betweens[between], r[0], r[1], r[2], a_bytes / (r[2] * 1e3));
      }
    }
  }
  return 0;
}
