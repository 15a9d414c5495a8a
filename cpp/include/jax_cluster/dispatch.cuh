// Runtime values -> template arguments, in one place.
//
// Host launchers turn a params struct's dtype, head dim or tile count into template
// parameters of a kernel. Instead of a hand-written switch per launcher:
//
//   return dispatch_half(p.dtype, [&](auto t) {
//     using T = typename decltype(t)::type;                 // __half or __nv_bfloat16
//     return dispatch_int<64, 80, 96, 128>(p.head_dim, [&](auto dh) {
//       return launch<T, decltype(dh)::value>(p, stream);   // a compile-time int
//     });
//   });
//
// A value outside the listed set returns cudaErrorInvalidValue (the FFI handlers validate
// first, so reaching it is a bug that surfaces as an error, never as a wrong kernel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "jax_cluster/types.h"

namespace jax_cluster {

template <typename T>
struct TypeTag {
  using type = T;
};

template <int V>
using IntTag = std::integral_constant<int, V>;

// f(TypeTag<T>{}) with T the CUDA type of a 16-bit float dtype.
template <typename F>
cudaError_t dispatch_half(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF16: return f(TypeTag<__half>{});
    case DType::kBF16: return f(TypeTag<__nv_bfloat16>{});
    default: return cudaErrorInvalidValue;
  }
}

// f(TypeTag<T>{}) for float32 too.
template <typename F>
cudaError_t dispatch_float(DType dtype, F&& f) {
  if (dtype == DType::kF32) return f(TypeTag<float>{});
  return dispatch_half(dtype, static_cast<F&&>(f));
}

// f(IntTag<V>{}) for the V among Vs that equals value.
template <int... Vs, typename F>
cudaError_t dispatch_int(int64_t value, F&& f) {
  cudaError_t result = cudaErrorInvalidValue;
  (void)((value == Vs ? (result = f(IntTag<Vs>{}), true) : false) || ...);
  return result;
}

}  // namespace jax_cluster
