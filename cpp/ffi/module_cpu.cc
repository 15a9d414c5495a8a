// Python module exporting the CPU FFI handlers, registrations() -> {target: capsule}, and
// the ops' launch plans: the C++ arithmetic (shared memory, workspace, grid) that the
// Python wrappers need for abstract eval and validation, computed in ONE place.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/api.h"

#define X(op) XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_cluster_##op##_cpu);
#include "ffi/targets.inc"
#undef X

namespace nb = nanobind;

// Each op with a plan defines bind_<op>_plan in cpp/ops/<op>/plan.cc (CPU module, no CUDA).
#define P(op) void bind_##op##_plan(nb::module_& m);
#include "ffi/plans.inc"
#undef P

NB_MODULE(_jax_cluster_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
#define X(op) \
  targets["jax_cluster_" #op] = nb::capsule(reinterpret_cast<void*>(jax_cluster_##op##_cpu));
#include "ffi/targets.inc"
#undef X
    return targets;
  });
  nb::module_ plans = m.def_submodule("plans", "Launch plans of the CUDA kernels (shared with C++)");
#define P(op) bind_##op##_plan(plans);
#include "ffi/plans.inc"
#undef P
}
