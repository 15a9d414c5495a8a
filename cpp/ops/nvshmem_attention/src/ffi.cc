// XLA FFI handlers of the one-sided backend (jax_cluster/parallel/nvshmem_backend.py builds the
// calls). No command-buffer trait: a put and its wait are paired on the host (runtime.h), so
// each must run as its own thunk, in program order.
#include <cuda_runtime.h>

#include <string>

#include "runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace rt = jax_cluster::nvshmem_rt;

namespace {

ffi::Error status(const std::string& e) {
  return e.empty() ? ffi::Error::Success() : ffi::Error(ffi::ErrorCode::kInternal, e);
}

ffi::Error put(cudaStream_t stream, ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> /*token*/, int64_t offset,
               int64_t nbytes, int64_t signal, int64_t signal_offset, ffi::Span<const int64_t> peers) {
  if (static_cast<int64_t>(src.size_bytes()) != nbytes)
    return ffi::Error::InvalidArgument("nvshmem put: source has " + std::to_string(src.size_bytes()) +
                                       " bytes, the arena region " + std::to_string(nbytes));
  if (static_cast<int64_t>(peers.size()) != rt::n_pes())
    return ffi::Error::InvalidArgument("nvshmem put: peers for " + std::to_string(peers.size()) +
                                       " PEs, NVSHMEM has " + std::to_string(rt::n_pes()));
  return status(rt::put_signal(stream, src.untyped_data(), offset, nbytes,
                               static_cast<int>(peers[rt::my_pe()]), signal_offset, signal));
}

ffi::Error wait(cudaStream_t stream, ffi::AnyBuffer /*token*/, ffi::AnyBuffer /*src, kept alive*/,
                ffi::Result<ffi::AnyBuffer> dst, int64_t offset, int64_t nbytes, int64_t signal,
                int64_t signal_offset) {
  if (static_cast<int64_t>(dst->size_bytes()) != nbytes)
    return ffi::Error::InvalidArgument("nvshmem wait: destination size differs from the region");
  return status(rt::wait_copy(stream, dst->untyped_data(), offset, nbytes, signal_offset, signal));
}

ffi::Error barrier(cudaStream_t stream, ffi::AnyBuffer /*x*/, ffi::Result<ffi::AnyBuffer> /*x aliased*/,
                   int64_t signal, int64_t signal_offset) {
  return status(rt::barrier(stream, signal_offset, signal));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_nvshmem_put, put,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("nbytes")
                                  .Attr<int64_t>("signal")
                                  .Attr<int64_t>("signal_offset")
                                  .Attr<ffi::Span<const int64_t>>("peers"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_nvshmem_wait, wait,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("nbytes")
                                  .Attr<int64_t>("signal")
                                  .Attr<int64_t>("signal_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_nvshmem_barrier, barrier,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("signal")
                                  .Attr<int64_t>("signal_offset"));
