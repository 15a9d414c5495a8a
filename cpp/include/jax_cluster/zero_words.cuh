// Zeroing a kernel's arrival counters ahead of it: one small kernel, launched
// programmatically, instead of cudaMemsetAsync. In a CUDA graph (XLA's command buffers) a
// memset is a node of its own that the kernel behind it waits for as for a full
// dependency: the memset's latency, then a whole launch latency, against a fraction of
// that between two kernels (measured in docs/performance.md). The zero kernel waits
// for the previous kernel (the counters' memory may be what that kernel just released)
// but lets the kernel behind it launch at once: that kernel's griddep_wait() (every
// programmatically launched kernel calls it before touching counters or inputs) then
// covers both the zeroing and the kernel before it, and what it does before that wait
// (its first weight loads) overlaps the previous kernel's tail as it would without the
// counters.
#pragma once

#include <cuda_runtime.h>

#include "jax_cluster/launch.cuh"
#include "jax_cluster/ptx.cuh"

namespace jax_cluster {

template <typename Word>
__global__ void zero_words_kernel(Word* words, int count) {
  ptx::griddep_launch_dependents();
  ptx::griddep_wait();
  for (int i = threadIdx.x; i < count; i += blockDim.x) words[i] = 0;
}

// words[0, count) = 0 in stream order; count 0 launches nothing.
inline cudaError_t zero_words(unsigned int* words, int count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  return launch_programmatic(zero_words_kernel<unsigned int>, dim3(1), dim3(256), 0, true, stream,
                             words, count);
}

}  // namespace jax_cluster
