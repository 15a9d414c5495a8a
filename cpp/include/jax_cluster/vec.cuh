// 16-byte vectors of fp32 / fp16 / bf16 viewed as float lanes: the unit every
// memory-bound kernel here moves (one LDG.128 / STS.128 per thread).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace jax_cluster {

template <typename T>
struct Vec16 {
  static constexpr int kLanes = 16 / sizeof(T);
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
__device__ __forceinline__ void unpack(const uint4& v, float (&out)[Vec16<T>::kLanes]) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < Vec16<T>::kLanes; ++i) out[i] = to_float(e[i]);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float (&in)[Vec16<T>::kLanes]) {
  uint4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < Vec16<T>::kLanes; ++i) e[i] = from_float<T>(in[i]);
  return v;
}

}  // namespace jax_cluster
