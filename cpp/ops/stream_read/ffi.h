// Decodes and validates stream_read's FFI arguments (shared by the CPU and CUDA handlers).
#pragma once

#include <utility>

#include "ffi/common.h"
#include "ops/stream_read/params.h"

namespace jax_cluster {

namespace ffi = xla::ffi;

inline ffi::ErrorOr<StreamReadParams> decode_stream_read(ffi::AnyBuffer x,
                                                         ffi::Result<ffi::AnyBuffer> out,
                                                         int64_t chunks) {
  using ffi_util::invalid;
  StreamReadParams p;
  p.x = x.untyped_data();
  p.bytes = static_cast<int64_t>(x.size_bytes());
  p.chunks = static_cast<int64_t>(out->element_count());
  p.out = static_cast<uint32_t*>(out->untyped_data());
  if (out->element_type() != ffi::DataType::U32 || chunks != p.chunks) {
    return ffi::Unexpected(invalid("stream_read: out must be uint32 [chunks]"));
  }
  if (p.chunks < 1 || p.bytes % (16 * p.chunks) != 0) {
    return ffi::Unexpected(invalid("stream_read: x's bytes (" + std::to_string(p.bytes) +
                                   ") must be a multiple of 16 * chunks (" +
                                   std::to_string(p.chunks) + ")"));
  }
  return p;
}

template <typename Binding>
auto bind_stream_read(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>().template Attr<int64_t>(
      "chunks");
}

}  // namespace jax_cluster
