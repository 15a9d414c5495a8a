// Probe: swiglu's gemv kernels (cpp/ops/swiglu/launch_gemv.cu, compiled in) timed alone,
// without JAX: us per call and weight read rate, for kernel experiments without building
// the package (GEMV_SRC="file.cu": a modified copy of launch_gemv.cu instead).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -Icpp -Icpp/include benchmarks/probes/gemv_kernel.cu -o /tmp/gemv_kernel
//   /tmp/gemv_kernel M D F [ku kd pdl]   (ku, kd 0: one wave of 2 blocks per SM)
// Prints us per call (best of 5 x 20 back-to-back calls) and the weight read rate, for the
// whole call and for the up stage alone.
#include <cstdio>
#include <cstdlib>

#ifndef GEMV_SRC
#define GEMV_SRC "ops/swiglu/launch_gemv.cu"
#endif
#include GEMV_SRC
#include "swiglu_probe.h"

int main(int argc, char** argv) {
  using namespace jax_cluster;
  if (argc < 4) {
    fprintf(stderr, "usage: %s M D F [ku kd pdl]\n", argv[0]);
    return 2;
  }
  const int64_t m = atoll(argv[1]), d = atoll(argv[2]), f = atoll(argv[3]);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  SwigluParams p{};
  p.dtype = DType::kF16;
  p.variant = SwigluVariant::kGemv;
  p.m = m;
  p.d = d;
  p.f = f;
  p.has_down = true;
  // K chunks, 0 or left out: one wave of 2 blocks per SM (a simpler form of the default of
  // cpp/ops/swiglu/plan.cc)
  const int ku = argc > 4 ? atoi(argv[4]) : 0, kd = argc > 5 ? atoi(argv[5]) : 0;
  p.k_splits_up = ku > 0 ? ku : std::max<int64_t>(1, 2 * sms / swiglu_ceil_div(f, 128));
  p.k_splits_down = kd > 0 ? kd : std::max<int64_t>(1, 2 * sms / swiglu_ceil_div(d, 128));
  p.pdl = argc > 6 ? atoi(argv[6]) : 1;
  const size_t wbytes = swiglu_probe_buffers(p);
  void* ws;
  for (int up_only = 0; up_only < 2; ++up_only) {
    p.has_down = !up_only;
    cudaMalloc(&ws, swiglu_gemv_layout(p).total);
    p.workspace = ws;
    const double us = swiglu_probe_us([&] { launch_swiglu_gemv(p, 0); });
    const double bytes = (up_only ? 2.0 : 3.0) * wbytes;
    printf("M %lld D %lld F %lld ku %d kd %d pdl %d %s: %.1f us, %.2f TB/s\n",
           static_cast<long long>(m), static_cast<long long>(d), static_cast<long long>(f),
           p.k_splits_up, p.k_splits_down, p.pdl ? 1 : 0, up_only ? "up only " : "up+down ", us,
           bytes / us / 1e6);
    cudaFree(ws);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) printf("CUDA error %s\n", cudaGetErrorString(e));
  return 0;
}
