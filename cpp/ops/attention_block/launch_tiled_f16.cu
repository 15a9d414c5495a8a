// The batch-tiled attention_decode kernel (attention_decode_tiled.cuh), __half instantiations.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "jax_cluster/cluster_collectives.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/thread_group.cuh"
#include "ops/attention_block/launch.h"
#include "jax_cluster/launch.cuh"

namespace jax_cluster {
namespace {

#include "ops/attention_block/kernel_common.cuh"     // NOLINT(build/include)
#include "ops/attention_block/kernel_registers.cuh"  // NOLINT(build/include): attend_cached
#include "ops/attention_block/kernel_tiled.cuh"      // NOLINT(build/include)

}  // namespace

cudaError_t launch_attention_decode_tiled_f16(const AttentionDecodeParams& p, cudaStream_t stream) {
  return launch_tiled_dh<__half>(p, stream);
}

}  // namespace jax_cluster
