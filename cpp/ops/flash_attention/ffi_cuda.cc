#include "ffi/cuda_util.h"
#include "ops/flash_attention/ffi.h"
#include "ops/flash_attention/launch.h"

namespace jax_cluster {
namespace {

ffi::Error flash_attention_cuda(cudaStream_t stream, JAX_CLUSTER_FLASH_ATTENTION_ARGS) {
  auto p = JAX_CLUSTER_FLASH_ATTENTION_DECODE;
  if (!p) return p.error();
  if (!flash_attention_cuda_supports(*p)) {
    return ffi_util::invalid("flash_attention: no CUDA kernel for this head_dim/dtype "
                             "(the Python wrapper should have used the reference path)");
  }
  const bool wgmma_only =
      p->kernel == FlashKernel::kWgmma || p->kernel == FlashKernel::kWgmmaNoPingPong;
  if (wgmma_only && !flash_attention_sm90_serves(*p)) {
    return ffi_util::invalid("flash_attention: the wgmma kernel does not serve this call "
                             "(it needs scale >= 0); use cuda_kernel='auto' or 'mma'");
  }
  return ffi_util::from_cuda(launch_flash_attention(*p, stream), "flash_attention");
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_flash_attention_cuda, jax_cluster::flash_attention_cuda,
    jax_cluster::bind_flash_attention(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
