#include "ffi/cuda_util.h"
#include "ops/flash_attention/ffi.h"
#include "ops/flash_attention/launch.h"

namespace jax_cluster {
namespace {

ffi::Error run_flash_attention(const FlashAttentionParams& p, cudaStream_t stream) {
  if (!flash_attention_cuda_supports(p)) {
    return ffi_util::invalid("flash_attention: no CUDA kernel for this head_dim/dtype "
                             "(the Python wrapper should have used the xla path)");
  }
  if (p.kernel == FlashKernel::kWgmma && !flash_attention_sm90_serves(p)) {
    return ffi_util::invalid("flash_attention: the wgmma kernel does not serve this call "
                             "(it needs scale >= 0); use FlashAttentionConfig(kernel='mma') "
                             "or config=None");
  }
  return ffi_util::from_cuda(launch_flash_attention(p, stream), "flash_attention");
}

}  // namespace
}  // namespace jax_cluster

JAX_CLUSTER_FFI_CUDA_HANDLER(flash_attention, jax_cluster::decode_flash_attention,
                             jax_cluster::run_flash_attention);
