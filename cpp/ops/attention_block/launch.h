#pragma once

#include <cuda_runtime.h>

#include "ops/attention_block/params.h"

namespace jax_cluster {

// Head dims with a CUDA kernel; others use the reference path.
inline bool attention_decode_cuda_supports(const AttentionDecodeParams& p) {
  const bool dh = p.head_dim == 64 || p.head_dim == 80 || p.head_dim == 96 || p.head_dim == 128;
  return dh && p.hidden % 64 == 0 && p.dtype != DType::kF32;
}

cudaError_t launch_attention_decode(const AttentionDecodeParams& p, cudaStream_t stream);
// The batch-tiled register kernel (p.rows_per_cluster > 1; attention_decode_tiled.cuh) and
// the combine kernel, per dtype; launch_attention_decode calls them for such params.
cudaError_t launch_attention_decode_tiled_f16(const AttentionDecodeParams& p, cudaStream_t stream);
cudaError_t launch_attention_decode_tiled_bf16(const AttentionDecodeParams& p, cudaStream_t stream);

}  // namespace jax_cluster
