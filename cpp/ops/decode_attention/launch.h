#pragma once

#include <cuda_runtime.h>

#include "ops/decode_attention/params.h"

namespace jax_cluster {

// The split kernel and, with several splits, the merge kernel on the stream. p must pass
// decode_attention_check and decode_attention_cuda_check (params.h).
cudaError_t launch_decode_attention(const DecodeAttentionParams& p, cudaStream_t stream);

}  // namespace jax_cluster
