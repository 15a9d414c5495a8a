// CHECK(cuda call): the probes' error check (print where, exit 1); upload(host vector): a
// device copy of it; time_calls_us(launch): us per call of `calls` back-to-back launches;
// ProbeRandom: the probes' reproducible random inputs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu/numerics.h"

#define CHECK(x)                                                             \
  do {                                                                       \
    cudaError_t e_ = (x);                                                    \
    if (e_ != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

// A 32-bit linear congruential generator (Numerical Recipes' constants): the same inputs on
// every run of a probe, from its seed.
struct ProbeRandom {
  uint32_t state;
  explicit ProbeRandom(uint32_t seed) : state(seed) {}
  uint32_t next() { return state = state * 1664525u + 1013904223u; }
  float uniform() { return static_cast<float>(next() >> 8) / 8388608.f - 1.f; }  // in [-1, 1)
  // n bfloat16 values (their bits) offset + scale * uniform()
  std::vector<uint16_t> bf16s(int64_t n, float scale, float offset = 0.f) {
    std::vector<uint16_t> v(static_cast<size_t>(std::max<int64_t>(n, 0)));
    for (auto& e : v) e = jax_cluster::cpu::float_to_bf16(offset + scale * uniform());
    return v;
  }
};

template <typename T>
static T* upload(const std::vector<T>& h) {
  T* d;
  CHECK(cudaMalloc(&d, std::max<size_t>(1, h.size()) * sizeof(T)));
  CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// us per call of `calls` back-to-back calls of launch() (which returns a cudaError_t) on the
// default stream.
template <typename F>
static float time_calls_us(F&& launch, int calls = 50) {
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  CHECK(cudaEventRecord(t0));
  for (int i = 0; i < calls; ++i) CHECK(launch());
  CHECK(cudaEventRecord(t1));
  CHECK(cudaEventSynchronize(t1));
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  CHECK(cudaEventDestroy(t0));
  CHECK(cudaEventDestroy(t1));
  return ms * 1e3f / static_cast<float>(calls);
}
