#include <cstring>

#include "ops/attention_block/cpu.h"
#include "ops/attention_block/ffi.h"

namespace jax_cluster {
namespace {

ffi::Error attention_decode_cpu(JAX_CLUSTER_ATTENTION_DECODE_ARGS) {
  auto p = JAX_CLUSTER_ATTENTION_DECODE_DECODE;
  if (!p) return p.error();
  // The caches are aliased in/out; copy only if XLA ever hands us two buffers.
  if (k_out->untyped_data() != k_cache.untyped_data()) {
    std::memcpy(k_out->untyped_data(), k_cache.untyped_data(), k_cache.size_bytes());
  }
  if (v_out->untyped_data() != v_cache.untyped_data()) {
    std::memcpy(v_out->untyped_data(), v_cache.untyped_data(), v_cache.size_bytes());
  }
  cpu::attention_decode(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_attention_decode_cpu, jax_cluster::attention_decode_cpu,
                              jax_cluster::bind_attention_decode(xla::ffi::Ffi::Bind()));
