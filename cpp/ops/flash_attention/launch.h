#pragma once

#include <cuda_runtime.h>

#include "ops/flash_attention/params.h"

namespace jax_cluster {

inline bool flash_attention_cuda_supports(const FlashAttentionParams& p) {
  return flash_attention_cuda_supports(p.head_dim, p.dtype);
}

// One launch over every (query tile, head, batch); nothing launched when there are no
// query rows. No host synchronisation, no allocation: chunk pointers are kernel parameters.
// p.kernel picks the kernel (kAuto: the wgmma one where it serves the call).
cudaError_t launch_flash_attention(const FlashAttentionParams& p, cudaStream_t stream);

// The Hopper wgmma/TMA kernel (launch_wgmma.cu): head dims 64 / 128, fp16 / bf16,
// scale >= 0. cudaErrorNotSupported (nothing launched) where it does not serve the call.
bool flash_attention_sm90_serves(const FlashAttentionParams& p);
cudaError_t launch_flash_attention_sm90(const FlashAttentionParams& p, cudaStream_t stream);

}  // namespace jax_cluster
