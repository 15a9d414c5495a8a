#include "ops/linear/cpu.h"
#include "ops/linear/ffi.h"

namespace jax_cluster {
namespace {

ffi::Error linear_cpu(JAX_CLUSTER_LINEAR_ARGS) {
  auto p = JAX_CLUSTER_LINEAR_DECODE;
  if (!p) return p.error();
  cpu::linear(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_linear_cpu, jax_cluster::linear_cpu,
                              jax_cluster::bind_linear(xla::ffi::Ffi::Bind()));
