#pragma once

#include <cuda_runtime.h>

#include "ops/decode_attention/params.h"

namespace jax_cluster {

// Shapes with a CUDA kernel (the FFI handler rejects the others; Python checks first).
inline bool decode_attention_cuda_supports(const DecodeAttentionParams& p) {
  const bool dh = p.head_dim == 64 || p.head_dim == 80 || p.head_dim == 96 || p.head_dim == 128;
  return dh && p.dtype != DType::kF32 && p.group >= 1 && p.group <= kDecodeAttentionMaxGroup;
}

cudaError_t launch_decode_attention(const DecodeAttentionParams& p, cudaStream_t stream);

}  // namespace jax_cluster
