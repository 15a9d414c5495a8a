#include "ops/stream_read/cpu.h"
#include "ops/stream_read/ffi.h"

namespace jax_cluster {
namespace {

ffi::Error stream_read_cpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                           int64_t chunks) {
  auto p = decode_stream_read(x, out, chunks);
  if (!p) return p.error();
  cpu::stream_read(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_stream_read_cpu, jax_cluster::stream_read_cpu,
                              jax_cluster::bind_stream_read(xla::ffi::Ffi::Bind()));
