// Probe: swiglu's tma kernels (kernels/swiglu_tma.cu, compiled in) timed alone, without
// JAX, with each block's phase times: quick kernel experiments on the GPU machine without
// building the package.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -Icpp -Icpp/include benchmarks/probes/tma_kernel.cu -o /tmp/tma_kernel
//   /tmp/tma_kernel M D F [row_tiles wgmma pdl blocks down_slots]
// Prints us per call (best of 5 x 20 back-to-back calls) and the weight read rate, for the
// whole call and for the up kernel alone; then, from one more call of each, when each
// kernel's blocks reached their phases (%globaltimer, us after the up kernel's first
// block): consumer start, past the PDL wait, last unit multiplied, final tile end reached,
// its output or partial written (stores issued), its partial stored (a split last tile),
// its tile counter complete, done (after its share of the tile sum); and the SM clock
// between phases. SWIGLU_PROBE_X=60 gives x nonzero values (swiglu_probe.h).
// -DTMA_SRC='"/path/variant.cu"' compiles a modified copy of the kernels instead.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

__device__ unsigned long long g_marks[2][1024][8];  // [down, up][block][phase]
__device__ long long g_clocks[2][1024][8];          // the SM clock at the same marks

#define SWIGLU_TMA_MARK(up, phase)                                                  \
  do {                                                                              \
    if (threadIdx.x == 0 && blockIdx.x < 1024) {                                    \
      unsigned long long t_;                                                        \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                       \
      g_marks[(up) ? 1 : 0][blockIdx.x][phase] = t_;                                \
      g_clocks[(up) ? 1 : 0][blockIdx.x][phase] = clock64();                        \
    }                                                                               \
  } while (0)

#ifndef TMA_SRC
#define TMA_SRC "kernels/swiglu_tma.cu"
#endif
#include TMA_SRC
#include "swiglu_probe.h"

namespace {

void* g_marks_ptr() {
  void* p = nullptr;
  cudaGetSymbolAddress(&p, g_marks);
  return p;
}

double pct(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

void print_phases(int blocks) {
  static unsigned long long marks[2][1024][8];
  cudaMemcpyFromSymbol(marks, g_marks, sizeof(marks));
  unsigned long long origin = ~0ull;  // the earliest up block start
  for (int b = 0; b < blocks; ++b) {  // blocks past a kernel's grid left no marks
    if (marks[1][b][0] != 0) origin = std::min(origin, marks[1][b][0]);
  }
  const char* names[8] = {"start", "waited", "streamed", "done", "stored", "counted", "tile end", "written"};
  for (int up = 1; up >= 0; --up) {
    printf("  %s kernel, us (min / median / p90 / max over %d blocks):\n", up ? "up" : "down",
           blocks);
    for (int ph : {0, 1, 2, 6, 7, 4, 5, 3}) {
      std::vector<double> v;
      for (int b = 0; b < blocks; ++b) {
        if (marks[up][b][ph] != 0) v.push_back((marks[up][b][ph] - origin) * 1e-3);
      }
      if (v.empty()) continue;
      printf("    %-9s %7.1f %7.1f %7.1f %7.1f  (%zu blocks)\n", names[ph], pct(v, 0), pct(v, 0.5),
             pct(v, 0.9), pct(v, 1), v.size());
    }
    {  // the SM clock between the phases: MHz = clock cycles / ns
      static long long clocks[2][1024][8];
      cudaMemcpyFromSymbol(clocks, g_clocks, sizeof(clocks));
      const int pairs[3][2] = {{1, 2}, {2, 6}, {6, 7}};
      printf("    SM clock, MHz (median over blocks):");
      for (auto& pr : pairs) {
        std::vector<double> f;
        for (int b = 0; b < blocks; ++b) {
          const double dt = static_cast<double>(marks[up][b][pr[1]]) - marks[up][b][pr[0]];
          if (marks[up][b][pr[0]] != 0 && marks[up][b][pr[1]] != 0 && dt > 0)
            f.push_back((clocks[up][b][pr[1]] - clocks[up][b][pr[0]]) / dt * 1e3);
        }
        if (!f.empty()) printf(" phase %d->%d %.0f;", pr[0], pr[1], pct(f, 0.5));
      }
      printf("\n");
    }
    // the blocks that ended last: their stream end and done
    std::vector<std::pair<double, int>> ends;
    for (int b = 0; b < blocks; ++b) {
      if (marks[up][b][3] != 0) ends.push_back({(marks[up][b][3] - origin) * 1e-3, b});
    }
    std::sort(ends.rbegin(), ends.rend());
    printf("    last to finish (block: streamed -> done):");
    for (int i = 0; i < 6 && i < static_cast<int>(ends.size()); ++i) {
      const int b = ends[i].second;
      printf(" %d: %.1f -> %.1f;", b, (marks[up][b][2] - origin) * 1e-3, ends[i].first);
    }
    printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace jax_cluster;
  if (argc < 4) {
    fprintf(stderr, "usage: %s M D F [row_tiles wgmma pdl blocks down_slots]\n", argv[0]);
    return 2;
  }
  const int64_t m = atoll(argv[1]), d = atoll(argv[2]), f = atoll(argv[3]);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  SwigluParams p{};
  p.dtype = DType::kF16;
  p.variant = SwigluVariant::kTma;
  p.m = m;
  p.d = d;
  p.f = f;
  p.row_tiles = argc > 4 ? atoi(argv[4]) : (m <= 16 ? 1 : m <= 32 ? 2 : 4);
  p.wgmma = argc > 5 && atoi(argv[5]) != 0;
  p.pdl = argc > 6 ? atoi(argv[6]) != 0 : true;
  p.num_clusters = argc > 7 ? atoi(argv[7]) : sms;
  p.down_slots = argc > 8 && atoi(argv[8]) != 0;
  p.has_residual = false;
  const size_t wbytes = swiglu_probe_buffers(p);
  void* ws;
  for (int up_only = 0; up_only < 2; ++up_only) {
    p.has_down = !up_only;
    cudaMalloc(&ws, swiglu_tma_layout(p).total);
    p.workspace = ws;
    const float us = swiglu_probe_us([&] { launch_swiglu_tma(p, 0); });
    const double bytes = (up_only ? 2.0 : 3.0) * wbytes;
    printf("M %lld D %lld F %lld rt %d wgmma %d pdl %d blocks %d %s: %.1f us, %.2f TB/s\n",
           static_cast<long long>(m), static_cast<long long>(d), static_cast<long long>(f),
           p.row_tiles, p.wgmma ? 1 : 0, p.pdl ? 1 : 0, p.num_clusters,
           up_only ? "up only " : "up+down ", us, bytes / us / 1e6);
    {
      cudaDeviceSynchronize();
      cudaMemset(g_marks_ptr(), 0, sizeof(g_marks));
      launch_swiglu_tma(p, 0);
      cudaDeviceSynchronize();
      print_phases(p.num_clusters);
    }
    cudaFree(ws);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) printf("CUDA error %s\n", cudaGetErrorString(e));
  return 0;
}
