#pragma once

#include <cuda_runtime.h>

#include "ops/mla_decode/params.h"

namespace jax_cluster {

// The split kernel and, with several splits, the merge kernel on the stream. p must pass
// mla_decode_check and mla_decode_cuda_check (params.h).
cudaError_t launch_mla_decode(const MlaDecodeParams& p, cudaStream_t stream);

}  // namespace jax_cluster
