// stream_read: reads a buffer once, as fast as the memory system allows, and returns a
// 32-bit XOR per contiguous chunk (so nothing can be optimised away, and results are
// checkable). It exists to measure the bandwidth a weight-streaming kernel can reach:
// the roofline of every memory-bound op here. No XLA includes here.
#pragma once

#include <cstdint>

namespace jax_cluster {

struct StreamReadParams {
  const void* x;
  int64_t bytes;   // a multiple of 16 * chunks
  int64_t chunks;  // out[c] = XOR of the 32-bit words of bytes [c, c + 1) * bytes / chunks
  uint32_t* out;
};

}  // namespace jax_cluster
