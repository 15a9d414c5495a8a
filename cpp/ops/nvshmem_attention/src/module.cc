// jax_cluster._jax_cluster_nvshmem: the NVSHMEM runtime for jax_cluster/parallel/nvshmem.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>
#include <vector>

#include "runtime.h"
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_cluster_nvshmem_put);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_cluster_nvshmem_wait);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_cluster_nvshmem_barrier);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_cluster_nvshmem_read);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_cluster_nvshmem_flash_attention);

namespace nb = nanobind;
namespace rt = jax_cluster::nvshmem_rt;

NB_MODULE(_jax_cluster_nvshmem, m) {
  m.def("unique_id", []() {
    auto id = rt::unique_id();
    return nb::bytes(reinterpret_cast<const char*>(id.data()), id.size());
  });
  m.def("init", [](int rank, int world, nb::bytes uid, size_t arena_bytes, double timeout_s) {
    const auto* p = static_cast<const uint8_t*>(uid.data());
    rt::init(rank, world, std::vector<uint8_t>(p, p + uid.size()), arena_bytes, timeout_s);
  });
  m.def("resize_arena", &rt::resize_arena);
  m.def("finalize", &rt::finalize);
  m.def("initialized", &rt::initialized);
  m.def("arena_bytes", &rt::arena_bytes);
  m.def("last_fault", []() -> nb::object {
    std::string f = rt::describe_fault();
    if (f.empty()) return nb::none();
    return nb::str(f.c_str());
  });
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_cluster_nvshmem_put"] = nb::capsule(reinterpret_cast<void*>(jax_cluster_nvshmem_put));
    targets["jax_cluster_nvshmem_wait"] = nb::capsule(reinterpret_cast<void*>(jax_cluster_nvshmem_wait));
    targets["jax_cluster_nvshmem_barrier"] = nb::capsule(reinterpret_cast<void*>(jax_cluster_nvshmem_barrier));
    targets["jax_cluster_nvshmem_read"] = nb::capsule(reinterpret_cast<void*>(jax_cluster_nvshmem_read));
    targets["jax_cluster_nvshmem_flash_attention"] =
        nb::capsule(reinterpret_cast<void*>(jax_cluster_nvshmem_flash_attention));
    return targets;
  });
}
