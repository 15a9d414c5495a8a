// Activation functions shared by the MLP kernels (fp32 in registers).
#pragma once

namespace jax_cluster {

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

}  // namespace jax_cluster
