// CUDA launcher of the SwiGLU MLP kernels (no XLA here).
#pragma once

#include <cuda_runtime.h>

#include "ops/swiglu/params.h"

namespace jax_cluster {

// Runs the variant p.variant (one or two kernel launches, plus a memset of the counters
// of the fused, stream, gemv and tma variants); every CUDA return code is checked.
cudaError_t launch_swiglu(const SwigluParams& p, cudaStream_t stream);

// The gemv variant (kernels/swiglu_gemv.cu); launch_swiglu dispatches to it.
cudaError_t launch_swiglu_gemv(const SwigluParams& p, cudaStream_t stream);

// The weight-streaming (bulk tensor copy) variant (kernels/swiglu_tma.cu).
cudaError_t launch_swiglu_tma(const SwigluParams& p, cudaStream_t stream);

}  // namespace jax_cluster
