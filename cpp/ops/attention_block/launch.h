#pragma once

#include <cuda_runtime.h>

#include "ops/attention_block/params.h"

namespace jax_cluster {

// One decode step on the stream: the main kernel of p's configuration, then the combine
// kernel. p must pass attention_block_check and attention_block_cuda_check (plan.h).
cudaError_t launch_attention_block(const AttentionBlockParams& p, cudaStream_t stream);

}  // namespace jax_cluster
