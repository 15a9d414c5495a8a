// What the swiglu kernel probe (gemv_kernel.cu) uses: fp16 buffers for one call and the
// timing of back-to-back calls. Include after the kernel source.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdlib>

#include "ops/swiglu/params.h"

namespace jax_cluster {

// x, w_gate, w_up, w_down and out of p's M, D, F (fp16). Weights are memset to nonzero
// bytes (all-zero pages could be compressed); x is zero unless SWIGLU_PROBE_X is set. Returns the bytes of one matrix.
inline size_t swiglu_probe_buffers(SwigluParams& p) {
  const size_t wbytes = static_cast<size_t>(p.d) * p.f * 2;
  const size_t act = static_cast<size_t>(p.m) * std::max(p.d, p.f) * 2;
  void *x, *wg, *wu, *wd, *out;
  cudaMalloc(&x, act);
  cudaMalloc(&wg, wbytes);
  cudaMalloc(&wu, wbytes);
  cudaMalloc(&wd, wbytes);
  cudaMalloc(&out, act);
  // SWIGLU_PROBE_X=60 fills x with 0x3c bytes (fp16 1.06): nonzero activations, as in a
  // model (all-zero gates once took the slow path of SiLU's IEEE division: docs/swiglu.md).
  const char* x_byte = std::getenv("SWIGLU_PROBE_X");
  cudaMemset(x, x_byte ? std::atoi(x_byte) : 0, act);
  for (void* w : {wg, wu, wd}) cudaMemset(w, 1, wbytes);
  p.x = x;
  p.w_gate = wg;
  p.w_up = wu;
  p.w_down = wd;
  p.out = out;
  return wbytes;
}

// Microseconds per call of launch(): best of 5 timed runs of 20 back-to-back calls (after
// one warm-up run).
template <typename Launch>
float swiglu_probe_us(Launch&& launch) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  float best = 1e30f;
  for (int r = 0; r < 6; ++r) {
    cudaEventRecord(a);
    for (int i = 0; i < 20; ++i) launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    if (r > 0) best = std::min(best, ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best * 1e3f / 20;
}

}  // namespace jax_cluster
