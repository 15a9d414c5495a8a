#include "ops/cluster_collectives/cpu.h"
#include "ops/cluster_collectives/ffi.h"

namespace jax_cluster {
namespace {

template <bool kGather>
ffi::Error cluster_collective_cpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> workspace, int64_t op, int64_t impl,
                                  int64_t repeat, bool all_blocks) {
  auto p = decode_cluster_collective(kGather, x, out, workspace, op, impl, repeat, all_blocks);
  if (!p) return p.error();
  if (kGather) {
    cpu::cluster_gather(*p);
  } else {
    cpu::cluster_reduce(*p);
  }
  return ffi::Error::Success();
}

auto bind() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("op")
      .Attr<int64_t>("impl")
      .Attr<int64_t>("repeat")
      .Attr<bool>("all_blocks");
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_cluster_reduce_cpu,
                              jax_cluster::cluster_collective_cpu<false>, jax_cluster::bind());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_cluster_gather_cpu,
                              jax_cluster::cluster_collective_cpu<true>, jax_cluster::bind());
