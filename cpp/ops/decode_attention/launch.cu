// Host launchers of decode_attention: the split kernel (CUDA cores for MHA, tensor cores for
// GQA), then, with several splits, the merge kernel. Both are launched programmatically
// (PDL), like attention_block's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/launch.cuh"
#include "ops/decode_attention/kernel_mma.cuh"
#include "ops/decode_attention/kernel_split.cuh"
#include "ops/decode_attention/launch.h"

namespace jax_cluster {
namespace {

// The merge kernel, where there is something to merge (see finish_split).
template <typename T, int DH>
cudaError_t launch_merge(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.splits == 1) return cudaSuccess;
  return launch_programmatic(decode_attention_merge_kernel<T, DH>,
                             dim3(static_cast<unsigned>(p.batch * p.num_kv_heads)),
                             dim3(static_cast<unsigned>(merge_threads<DH>(static_cast<int>(p.group)))),
                             0, true, stream, p);
}

template <typename T, int DH>
cudaError_t launch_split(const DecodeAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(p.batch));
  if (decode_attention_uses_tensor_cores(p)) {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(
        decode_attention_mma_split_kernel<T, DH>, grid, dim3(MmaSplitTile<DH>::kThreads),
        mma_split_smem_floats<DH, kMmaSplitKernelLean<DH>>() * sizeof(float), true, stream, p));
  } else {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(decode_attention_split_kernel<T, DH>, grid,
                                                         dim3(kBlockThreads),
                                                         split_smem_floats<DH>() * sizeof(float),
                                                         true, stream, p));
  }
  return launch_merge<T, DH>(p, stream);
}

}  // namespace

cudaError_t launch_decode_attention(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (!decode_attention_check(p).empty() || !decode_attention_cuda_check(p).empty()) {
    return cudaErrorInvalidValue;  // the FFI handlers report why first
  }
  return dispatch_half(p.dtype, [&](auto t) {
    return dispatch_int<64, 80, 96, 128, 256>(p.head_dim, [&](auto dh) {
      return launch_split<typename decltype(t)::type, decltype(dh)::value>(p, stream);
    });
  });
}

}  // namespace jax_cluster
