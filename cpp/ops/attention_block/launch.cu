// Host launchers of attention_block: the main kernel of the configuration (SplitToken with
// the register or the TMA pipeline, or SplitHead), then the combine kernel. Both are
// launched programmatically (PDL): the main kernel may start while the previous kernel of
// the stream finishes (it waits in cluster_ctx before touching any input), and the combine
// kernel is scheduled while the main kernel runs and waits for its partials. The launch
// plan (grid, shared memory, ring stages) comes from plan.h, as Python's does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/launch.cuh"
#include "jax_cluster/tma_host.h"
#include "ops/attention_block/kernel_registers.cuh"
#include "ops/attention_block/kernel_split_head.cuh"
#include "ops/attention_block/kernel_tma.cuh"
#include "ops/attention_block/launch.h"
#include "ops/attention_block/plan.h"

namespace jax_cluster {
namespace {

// W_o rows per box: the largest multiple of 8 that divides the chunk's hpc*Dh rows and
// keeps a [rows, 64] box within a stage.
int out_box_rows(int rows) {
  for (int r = kMaxOutBoxRows; r >= 8; r -= 8) {
    if (rows % r == 0) return r;
  }
  return 8;
}

dim3 main_grid(const AttentionBlockParams& p, const AttentionBlockPlan& plan) {
  return dim3(static_cast<unsigned>(plan.clusters * p.cluster_size));
}

template <typename T, int DH, int MH>
cudaError_t launch_tma(const AttentionBlockParams& p, const AttentionBlockPlan& plan,
                       cudaStream_t stream) {
  if constexpr (!tma_qkv_box_fits_stage(DH)) {
    return cudaErrorInvalidConfiguration;  // attention_block_cuda_check says why
  } else {
    if (plan.stages < 2) return cudaErrorInvalidConfiguration;  // hidden too large for this kernel
    StreamArgs a{};
    a.out_box_rows = out_box_rows(static_cast<int>(plan.heads_per_cluster) * DH);
    a.stages = plan.stages;
    const int64_t qkv_cols = (p.num_q_heads + 2 * p.num_kv_heads) * DH;
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(encode_matrix_map(&a.qkv, p.dtype, p.w_qkv, p.hidden, qkv_cols,
                                                       kQkvBoxRows, DH));
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(encode_matrix_map(&a.out, p.dtype, p.w_o, p.num_q_heads * DH,
                                                       p.hidden, a.out_box_rows, kOutTileCols));
    return launch_cluster_programmatic(attention_block_tma_kernel<T, DH, MH>, main_grid(p, plan),
                                       dim3(plan.threads), static_cast<size_t>(plan.shared_bytes),
                                       p.cluster_size, stream, p, a);
  }
}

template <typename T, int DH, int MH>
cudaError_t launch_main(const AttentionBlockParams& p, const AttentionBlockPlan& plan,
                        cudaStream_t stream) {
  if (p.dataflow == AttnDataflow::kSplitHead) {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_cluster_programmatic(
        attention_block_split_head_kernel<T, DH, MH>, main_grid(p, plan), dim3(plan.threads),
        static_cast<size_t>(plan.shared_bytes), p.cluster_size, stream, p));
    return cudaGetLastError();
  }
  if (p.pipeline == AttnPipeline::kTma) return launch_tma<T, DH, MH>(p, plan, stream);
  return launch_cluster_programmatic(attention_block_kernel<T, DH, MH>, main_grid(p, plan),
                                     dim3(plan.threads), static_cast<size_t>(plan.shared_bytes),
                                     p.cluster_size, stream, p);
}

template <typename T>
cudaError_t launch_combine(const AttentionBlockParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.hidden + 255) / 256), static_cast<unsigned>(p.batch));
  return launch_programmatic(attention_block_combine_kernel<T>, grid, dim3(256), 0, true, stream, p);
}

}  // namespace

cudaError_t launch_attention_block(const AttentionBlockParams& p, cudaStream_t stream) {
  const AttentionBlockPlan plan = attention_block_plan(p);
  return dispatch_half(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return dispatch_int<64, 80, 96, 128, 256>(p.head_dim, [&](auto dh) {
      // MH: register arrays sized for the heads a cluster serves (1, 2, 4 or 8).
      return dispatch_int<1, 2, 4, 8>(plan.heads_bucket, [&](auto mh) {
        JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
            (launch_main<T, decltype(dh)::value, decltype(mh)::value>(p, plan, stream)));
        return launch_combine<T>(p, stream);
      });
    });
  });
}

}  // namespace jax_cluster
