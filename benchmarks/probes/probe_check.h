// CHECK(cuda call): the probes' error check (print where, exit 1); upload(host vector): a
// device copy of it; time_calls_us(launch): us per call of `calls` back-to-back launches.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                             \
  do {                                                                       \
    cudaError_t e_ = (x);                                                    \
    if (e_ != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

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
