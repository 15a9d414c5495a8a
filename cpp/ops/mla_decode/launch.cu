// Host launcher of mla_decode's latent attention: the split kernel, then with several
// splits the merge kernel, both launched programmatically (PDL).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/launch.cuh"
#include "ops/mla_decode/kernel.cuh"
#include "ops/mla_decode/launch.h"

namespace jax_cluster {
namespace {

template <typename T, int RT>
cudaError_t launch(const MlaDecodeParams& p, cudaStream_t stream) {
  using L = MlaTile<RT>;
  const unsigned head_tiles = static_cast<unsigned>((p.num_heads + L::kHeads - 1) / L::kHeads);
  const dim3 grid(static_cast<unsigned>(p.splits), head_tiles, static_cast<unsigned>(p.batch));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(mla_decode_split_kernel<T, RT>, grid, dim3(L::kThreads),
                                                       L::kSmemBytes, true, stream, p));
  if (p.splits == 1) return cudaSuccess;
  return launch_programmatic(mla_decode_merge_kernel<T>,
                             dim3(static_cast<unsigned>((p.rank + 127) / 128), static_cast<unsigned>(p.num_heads),
                                  static_cast<unsigned>(p.batch)),
                             dim3(128), 0, true, stream, p);
}

}  // namespace

cudaError_t launch_mla_decode(const MlaDecodeParams& p, cudaStream_t stream) {
  if (!mla_decode_check(p).empty() || !mla_decode_cuda_check(p).empty()) {
    return cudaErrorInvalidValue;  // the FFI handler reports why first
  }
  return dispatch_half(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return mla_decode_kernel_rank(p.rank) == 128 ? launch<T, 128>(p, stream) : launch<T, kMlaDecodeMaxRank>(p, stream);
  });
}

}  // namespace jax_cluster
