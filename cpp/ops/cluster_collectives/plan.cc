// cluster_reduce / cluster_gather's launch plan for Python (jax_cluster._extension.plans()):
// a block's shared memory, the off-chip exchange's workspace and the limit, from params.h.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "ops/cluster_collectives/params.h"

namespace nb = nanobind;

namespace {

jax_cluster::DType dtype_of(const std::string& name) {
  jax_cluster::DType t;
  if (!jax_cluster::dtype_from_name(name, &t)) throw std::invalid_argument("unknown dtype " + name);
  return t;
}

jax_cluster::ClusterExchange exchange_of(const std::string& name) {
  if (name == "dsmem") return jax_cluster::ClusterExchange::kDsmem;
  if (name == "global") return jax_cluster::ClusterExchange::kGlobal;
  throw std::invalid_argument("unknown exchange " + name);
}

}  // namespace

void bind_cluster_collectives_plan(nb::module_& m) {
  using namespace jax_cluster;
  m.attr("CLUSTER_COLLECTIVE_SMEM_LIMIT") = kMaxDynamicSharedBytes;
  m.def(
      "cluster_collective_smem_bytes",
      [](bool gather, const std::string& dtype, int cluster_size, int64_t size,
         const std::string& exchange) {
        return cluster_collective_smem_bytes(gather, dtype_of(dtype), cluster_size, size,
                                             exchange_of(exchange));
      },
      nb::arg("gather"), nb::arg("dtype"), nb::arg("cluster_size"), nb::arg("size"),
      nb::arg("exchange"), "Dynamic shared memory one block of the collective's kernel needs.");
  m.def(
      "cluster_collective_workspace_bytes",
      [](const std::string& dtype, int64_t groups, int cluster_size, int64_t size,
         const std::string& exchange) {
        return cluster_collective_workspace_bytes(dtype_of(dtype), groups, cluster_size, size,
                                                  exchange_of(exchange));
      },
      nb::arg("dtype"), nb::arg("groups"), nb::arg("cluster_size"), nb::arg("size"),
      nb::arg("exchange"), "Bytes of the global-memory exchange area (0 for DSMEM).");
  m.def("cluster_size_valid", [](int64_t n) { return is_valid_cluster_size(n); }, nb::arg("n"),
        "Cluster sizes the kernels launch: 1..8 and 16.");
}
