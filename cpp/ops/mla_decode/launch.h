#pragma once

#include <cuda_runtime.h>

#include "ops/mla_decode/params.h"
#include "ops/mla_decode/projections.h"

namespace jax_cluster {

// The split kernel and, with several splits, the merge kernel on the stream. p must pass
// mla_decode_check and mla_decode_cuda_check (params.h).
cudaError_t launch_mla_decode(const MlaDecodeParams& p, cudaStream_t stream);

// The projection kernels (projections.h); p must pass mla_projections_check on the GPU.
// mla_project zeroes both kernels' counters first; mla_output expects them zero.
cudaError_t launch_mla_project(const MlaProjectParams& p, cudaStream_t stream);
cudaError_t launch_mla_output(const MlaOutputParams& p, cudaStream_t stream);

}  // namespace jax_cluster
