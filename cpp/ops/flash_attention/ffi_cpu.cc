#include "ops/flash_attention/cpu.h"
#include "ops/flash_attention/ffi.h"

namespace jax_cluster {
namespace {

ffi::Error flash_attention_cpu(JAX_CLUSTER_FLASH_ATTENTION_ARGS) {
  auto p = JAX_CLUSTER_FLASH_ATTENTION_DECODE;
  if (!p) return p.error();
  cpu::flash_attention(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_flash_attention_cpu, jax_cluster::flash_attention_cpu,
                              jax_cluster::bind_flash_attention(xla::ffi::Ffi::Bind()));
