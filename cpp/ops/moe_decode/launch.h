// CUDA launchers of the MoE decode kernels (no XLA here).
#pragma once

#include <cuda_runtime.h>

#include "ops/moe_decode/params.h"
#include "ops/moe_decode/route.h"

namespace jax_cluster {

// The three kernels of params.h (gate/up GEMV, down GEMV, combine) on `stream`; the CUDA
// return code of every launch is checked. No allocation, no synchronisation, no memset.
cudaError_t launch_moe_decode(const MoeDecodeParams& p, cudaStream_t stream);

// The router's two kernels of route.h (partials, then select) on `stream`.
cudaError_t launch_moe_route(const MoeRouteParams& p, cudaStream_t stream);

}  // namespace jax_cluster
