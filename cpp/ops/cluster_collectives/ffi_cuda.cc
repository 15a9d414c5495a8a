#include "ops/cluster_collectives/ffi.h"
#include "ffi/cuda_util.h"
#include "ops/cluster_collectives/launch.h"

namespace jax_cluster {
namespace {

template <bool kGather>
ffi::Error cluster_collective_cuda(cudaStream_t stream, ffi::AnyBuffer x,
                                   ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> workspace, int64_t op, int64_t impl,
                                   int64_t repeat, bool all_blocks) {
  auto p = decode_cluster_collective(kGather, x, out, workspace, op, impl, repeat, all_blocks);
  if (!p) return p.error();
  return ffi_util::from_cuda(kGather ? launch_cluster_gather(*p, stream)
                                     : launch_cluster_reduce(*p, stream),
                             kGather ? "cluster_gather" : "cluster_reduce");
}

auto bind() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_cluster_reduce_cuda,
                              jax_cluster::cluster_collective_cuda<false>, jax_cluster::bind(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_cluster_gather_cuda,
                              jax_cluster::cluster_collective_cuda<true>, jax_cluster::bind(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
