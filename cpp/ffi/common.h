// Helpers shared by every FFI handler: dtype mapping, argument errors, and the one pattern
// that binds an op's FFI signature.
//
// ---- The pattern (every cpp/ops/<op>/ffi.h follows it) ---------------------------------
//
// An op writes its FFI signature ONCE, as the parameter list of its decode function, and
// its attributes ONCE, as a struct decoded by XLA's struct-attribute decoding:
//
//   // cpp/ops/foo/ffi.h
//   namespace jax_cluster {
//   struct FooAttrs {            // every attribute Python passes, no more, no less (XLA
//     int64_t block;             // checks the count); member names are irrelevant to XLA,
//     float scale;               // the StructMember names below must be the Python kwargs
//     bool residual;             // (int -> int64_t, np.float32 -> float, bool -> bool)
//   };
//   }  // namespace jax_cluster
//   JAX_CLUSTER_FFI_ATTRS(jax_cluster::FooAttrs,             // at global scope; member order
//                         xla::ffi::StructMember<int64_t>("block"),  // = the struct's
//                         xla::ffi::StructMember<float>("scale"),
//                         xla::ffi::StructMember<bool>("residual"));
//   namespace jax_cluster {
//   // Buffers (ffi::AnyBuffer / ffi::Result<ffi::AnyBuffer> / ffi::RemainingArgs /
//   // ffi::RemainingRets) in call order, then the attribute struct: this parameter list IS
//   // the FFI binding. Validates everything and returns the op's params struct.
//   inline ffi::ErrorOr<FooParams> decode_foo(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
//                                             FooAttrs attrs);
//   }
//
//   // cpp/ops/foo/ffi_cpu.cc                     run: ffi::Error or void (const FooParams&)
//   JAX_CLUSTER_FFI_CPU_HANDLER(foo, jax_cluster::decode_foo, jax_cluster::run_foo_cpu);
//   // cpp/ops/foo/ffi_cuda.cc (ffi/cuda_util.h)  run: ffi::Error (const FooParams&, cudaStream_t)
//   JAX_CLUSTER_FFI_CUDA_HANDLER(foo, jax_cluster::decode_foo, jax_cluster::run_foo_cuda);
//   // or, where run would only launch: launch: cudaError_t (const FooParams&, cudaStream_t)
//   JAX_CLUSTER_FFI_CUDA_LAUNCH_HANDLER(foo, jax_cluster::decode_foo, jax_cluster::launch_foo);
//
// The handler macros define the symbols jax_cluster_foo_{cpu,cuda} listed in targets.inc;
// the binding (stream context, buffers, .Attrs<FooAttrs>()) is derived from decode_foo's
// parameters, and the CUDA handler always carries the command-buffer trait. Two targets
// of one op (a template flag) share one decode: pass `decode_foo<true>`.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

#include "jax_cluster/types.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cluster::ffi_util {

namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument(what); }

inline ffi::ErrorOr<DType> to_dtype(ffi::DataType t, const char* arg) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::F16: return DType::kF16;
    case ffi::DataType::BF16: return DType::kBF16;
    default:
      return ffi::Unexpected(invalid(std::string(arg) + ": dtype must be float32, float16 or bfloat16"));
  }
}

inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// ---- binding derived from a decode function's parameters --------------------------------

// (XLA's Binding can only be moved by its own members: every step takes it by reference
// and returns the next binding as a prvalue.)
template <typename P, typename B>
auto bind_one(B&& b) {
  if constexpr (std::is_same_v<P, ffi::RemainingArgs>) {
    return std::move(b).RemainingArgs();
  } else if constexpr (std::is_same_v<P, ffi::RemainingRets>) {
    return std::move(b).RemainingRets();
  } else if constexpr (!std::is_void_v<typename ffi::ArgBinding<P>::Arg>) {
    return std::move(b).template Arg<typename ffi::ArgBinding<P>::Arg>();
  } else if constexpr (!std::is_void_v<typename ffi::RetBinding<P>::Ret>) {
    return std::move(b).template Ret<typename ffi::RetBinding<P>::Ret>();
  } else if constexpr (!std::is_void_v<typename ffi::AttrsBinding<P>::Attrs>) {
    return std::move(b).template Attrs<P>();
  } else {
    static_assert(sizeof(P) == 0,
                  "decode parameter must be a buffer, a result, RemainingArgs/Rets or an "
                  "attribute struct registered with JAX_CLUSTER_FFI_ATTRS");
  }
}

template <typename P, typename... Ps>
struct BindAll {
  template <typename B>
  static auto to(B&& b) {
    if constexpr (sizeof...(Ps) == 0) {
      return bind_one<P>(std::forward<B>(b));
    } else {
      return BindAll<Ps...>::to(bind_one<P>(std::forward<B>(b)));
    }
  }
};

template <auto Decode>
struct Handler;

template <typename Params, typename... Args, ffi::ErrorOr<Params> (*Decode)(Args...)>
struct Handler<Decode> {
  using ParamsType = Params;

  template <typename B>
  static auto bind(B&& b) { return BindAll<Args...>::to(std::forward<B>(b)); }

  // run(const Params&) -> void or ffi::Error
  template <auto Run>
  static ffi::Error cpu(Args... args) {
    auto p = Decode(std::move(args)...);
    if (!p) return p.error();
    if constexpr (std::is_void_v<decltype(Run(*p))>) {
      Run(*p);
      return ffi::Error::Success();
    } else {
      return Run(*p);
    }
  }

  // run(const Params&, Stream) -> ffi::Error
  template <typename Stream, auto Run>
  static ffi::Error with_stream(Stream stream, Args... args) {
    auto p = Decode(std::move(args)...);
    if (!p) return p.error();
    return Run(*p, stream);
  }
};

}  // namespace jax_cluster::ffi_util

// XLA's struct-attribute decoding under the project's name (see the pattern above).
#define JAX_CLUSTER_FFI_ATTRS(T, ...) XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(T, __VA_ARGS__)

#define JAX_CLUSTER_FFI_CPU_HANDLER(op, decode, run)                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                          \
      jax_cluster_##op##_cpu, (&::jax_cluster::ffi_util::Handler<&decode>::cpu<&run>),    \
      ::jax_cluster::ffi_util::Handler<&decode>::bind(::xla::ffi::Ffi::Bind()))
