#pragma once

#include <cuda_runtime.h>

#include "kernels/flash_attention.h"

namespace jax_cluster {

// Shapes with a CUDA kernel; others use the reference path (the Python wrapper decides).
inline bool flash_attention_cuda_supports(const FlashAttentionParams& p) {
  return (p.head_dim == 64 || p.head_dim == 128) && p.dtype != DType::kF32;
}

// One launch over every (query tile, head, batch); nothing launched when there are no
// query rows. No host synchronisation, no allocation: chunk pointers are kernel parameters.
cudaError_t launch_flash_attention(const FlashAttentionParams& p, cudaStream_t stream);

}  // namespace jax_cluster
