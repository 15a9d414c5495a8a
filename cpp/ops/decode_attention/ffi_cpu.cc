#include <cstring>

#include "ops/decode_attention/cpu.h"
#include "ops/decode_attention/ffi.h"

namespace jax_cluster {
namespace {

ffi::Error decode_attention_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                ffi::AnyBuffer pos, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> workspace, int64_t splits) {
  auto p = decode_decode_attention(q, k_cache, v_cache, pos, out, workspace, splits);
  if (!p) return p.error();
  cpu::decode_attention(*p);
  return ffi::Error::Success();
}

ffi::Error decode_attention_append_cpu(JAX_CLUSTER_DECODE_ATTENTION_APPEND_ARGS) {
  auto p = JAX_CLUSTER_DECODE_ATTENTION_APPEND_DECODE;
  if (!p) return p.error();
  if (k_out->untyped_data() != k_cache.untyped_data()) {
    std::memcpy(k_out->untyped_data(), k_cache.untyped_data(), k_cache.size_bytes());
  }
  if (v_out->untyped_data() != v_cache.untyped_data()) {
    std::memcpy(v_out->untyped_data(), v_cache.untyped_data(), v_cache.size_bytes());
  }
  cpu::decode_attention(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_decode_attention_cpu, jax_cluster::decode_attention_cpu,
                              jax_cluster::bind_decode_attention(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_decode_attention_append_cpu,
                              jax_cluster::decode_attention_append_cpu,
                              jax_cluster::bind_decode_attention_append(xla::ffi::Ffi::Bind()));
