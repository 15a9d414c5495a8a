// The threadfence reduction's arrival: the last block of a grid to finish a piece of work
// finds out, and then sees what every earlier block wrote (CUDA programming guide, "memory
// fence functions"). The counter lives in global memory and is zeroed before the launch.
#pragma once

namespace jax_cluster {

// Whether this block is the last of `total` to arrive at `counter`. Called by every thread
// of the block (barriers inside); each thread's earlier global writes are visible to the
// last block afterwards.
__device__ __forceinline__ bool last_block_to_arrive(unsigned int* counter, unsigned int total) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // the block's writes are visible before the count says so
    last = atomicAdd(counter, 1u) == total - 1;
    __threadfence();
  }
  __syncthreads();
  return last;
}

}  // namespace jax_cluster
