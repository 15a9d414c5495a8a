// CUDA launcher of the linear projection (no XLA here).
#pragma once

#include <cuda_runtime.h>

#include "ops/linear/params.h"

namespace jax_cluster {

// y = a @ w (+ residual) on the tma GEMM engine (ops/swiglu/tma_gemm.h): one kernel
// launch, plus a memset of the tile counters when the grid sums split tiles through
// global slots (not for clusters summing over DSMEM); every CUDA return code is checked.
cudaError_t launch_linear(const LinearParams& p, cudaStream_t stream);

}  // namespace jax_cluster
