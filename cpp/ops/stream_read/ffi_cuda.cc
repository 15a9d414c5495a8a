#include "ffi/cuda_util.h"
#include "ops/stream_read/ffi.h"
#include "ops/stream_read/launch.h"

namespace jax_cluster {
namespace {

ffi::Error stream_read_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                           int64_t chunks) {
  auto p = decode_stream_read(x, out, chunks);
  if (!p) return p.error();
  return ffi_util::from_cuda(launch_stream_read(*p, stream), "stream_read");
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_stream_read_cuda, jax_cluster::stream_read_cuda,
    jax_cluster::bind_stream_read(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
