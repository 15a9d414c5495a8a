// linear's launch plan for Python (jax_cluster._extension.plans().linear_workspace_bytes):
// the workspace the launcher's grid needs, computed here once.
#include <nanobind/nanobind.h>

#include "ops/linear/params.h"

namespace nb = nanobind;

void bind_linear_plan(nb::module_& m) {
  using namespace jax_cluster;
  m.attr("LINEAR_ALIGN") = kLinearAlign;
  m.def("linear_workspace_bytes", &linear_workspace_bytes, nb::arg("m"), nb::arg("n"),
        nb::arg("max_blocks"),
        "Bytes of linear's workspace for y [M, N] on a grid of at most max_blocks blocks.");
}
