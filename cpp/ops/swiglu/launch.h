// CUDA launchers of the SwiGLU MLP kernels (no XLA here).
#pragma once

#include <cuda_runtime.h>

#include "ops/swiglu/params.h"

namespace jax_cluster {

// Runs the variant p.variant (one or two kernel launches, plus a kernel zeroing the counters
// where the kernels sum partials through them); every CUDA return code is checked.
cudaError_t launch_swiglu(const SwigluParams& p, cudaStream_t stream);

// The variants' launchers (launch_gemv.cu, launch_tma.cu); launch_swiglu dispatches to them.
cudaError_t launch_swiglu_gemv(const SwigluParams& p, cudaStream_t stream);
cudaError_t launch_swiglu_tma(const SwigluParams& p, cudaStream_t stream);

}  // namespace jax_cluster
