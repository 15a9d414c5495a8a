// Activation functions shared by the MLP kernels (fp32 in registers).
#pragma once

namespace jax_cluster {

// __fdividef, not '/': the IEEE division's check and slow-path call are on the critical path
// at the end of swiglu's tma up tile, where every thread converts 32 values (docs/swiglu.md).
// Its 2-ulp error is far below the 16-bit output's; past g < -87 the denominator exceeds
// 2^126 and it returns 0, silu's limit.
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.f + __expf(-g)); }

}  // namespace jax_cluster
