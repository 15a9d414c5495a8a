// A set of threads that computes together: the whole block, or the consumer warps of a
// warp-specialised block (one producer warp feeding the others through a Ring), which
// must synchronise without the producer: a named barrier (bar.sync id, count).
#pragma once

#include <cstdint>

namespace jax_cluster {

namespace ptx {

// bar.sync on barrier `id` (1..15; 0 is __syncthreads) by `threads` threads (a multiple
// of 32): a barrier among some warps of the block.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// bar.arrive: counts toward barrier `id` without waiting (a signal to the warps that
// bar.sync on it, e.g. "your turn" between two consumer warpgroups).
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
}  // namespace ptx

// Threads [0, threads) of the block, synchronised on barrier `barrier`.
struct ThreadGroup {
  uint32_t threads;
  uint32_t barrier;  // 0: the whole block (__syncthreads)
  __device__ static ThreadGroup block() { return {blockDim.x, 0}; }
  __device__ uint32_t rank() const { return threadIdx.x; }  // groups start at thread 0
  __device__ void sync() const {
    if (barrier == 0) {
      __syncthreads();
    } else {
      ptx::named_barrier_sync(barrier, threads);
    }
  }
};

}  // namespace jax_cluster
