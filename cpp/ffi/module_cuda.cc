// Python module exporting the CUDA FFI handlers: registrations() -> {target: capsule}.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/api.h"

#define X(op) XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_cluster_##op##_cuda);
#include "ffi/targets.inc"
#undef X

namespace nb = nanobind;

NB_MODULE(_jax_cluster_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
#define X(op) \
  targets["jax_cluster_" #op] = nb::capsule(reinterpret_cast<void*>(jax_cluster_##op##_cuda));
#include "ffi/targets.inc"
#undef X
    return targets;
  });
}
