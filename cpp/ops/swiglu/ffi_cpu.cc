#include "ops/swiglu/cpu.h"
#include "ops/swiglu/ffi.h"

namespace jax_cluster {
namespace {

ffi::Error swiglu_cpu(JAX_CLUSTER_SWIGLU_ARGS) {
  auto p = JAX_CLUSTER_SWIGLU_DECODE;
  if (!p) return p.error();
  cpu::swiglu(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_swiglu_cpu, jax_cluster::swiglu_cpu,
                              jax_cluster::bind_swiglu(xla::ffi::Ffi::Bind()));
