// Host launcher of the one-launch decoder layer: the grid is every block the GPU holds at
// once (occupancy, queried once per device), launched cooperatively so that the driver
// refuses a grid that could not all be resident instead of letting its barriers hang.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/launch.cuh"
#include "jax_cluster/zero_words.cuh"
#include "ops/decoder_layer/kernel.cuh"
#include "ops/decoder_layer/launch.h"

namespace jax_cluster {
namespace {

DecodeAttentionParams attention_params(const DecoderLayerParams& p, const DecoderLayerPlan& pl, float* ws) {
  DecodeAttentionParams dp{};
  dp.dtype = p.dtype;
  dp.batch = p.batch;
  dp.num_kv_heads = p.num_kv_heads;
  dp.group = p.num_q_heads / p.num_kv_heads;
  dp.head_dim = p.head_dim;
  dp.max_seq = p.max_seq;
  dp.splits = pl.splits;
  dp.k_cache = p.k_cache;
  dp.v_cache = p.v_cache;
  dp.lengths = p.lengths;
  dp.out_f32 = ws + pl.attn;
  dp.partial = ws + pl.attn_partial;
  dp.qkv = ws + pl.qkv;
  dp.inv_freq = p.inv_freq;
  dp.rotary_dim = p.rotary_dim;
  dp.rope_layout = p.rope_layout;
  dp.scale = p.scale;
  dp.rolling = p.rolling;
  return dp;
}

template <typename T, int NB, int DH>
cudaError_t launch(const DecoderLayerParams& p, float* ws, cudaStream_t stream) {
  auto* kernel = decoder_layer_kernel<T, NB, DH>;
  const size_t smem = sizeof(float) * decoder_layer_smem_floats<NB, DH>();
  int grid = 0;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
      resident_blocks(reinterpret_cast<const void*>(kernel), kLayerThreads, smem, &grid));
  DecoderLayerArgs args{};
  args.p = p;
  args.pl = plan_decoder_layer(p, grid);
  args.dp = attention_params(p, args.pl, ws);
  args.ws = ws;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(zero_words(reinterpret_cast<unsigned int*>(ws + args.pl.counters),
                                              static_cast<int>(args.pl.counter_words), stream));
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  return launch_ex(kernel, dim3(grid), dim3(kLayerThreads), smem, stream, &attr, 1, args);
}

}  // namespace

cudaError_t launch_decoder_layer(const DecoderLayerParams& p, float* workspace, cudaStream_t stream) {
  if (!decoder_layer_check(p).empty() || !decoder_layer_cuda_check(p).empty()) return cudaErrorInvalidValue;
  return dispatch_half(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    const int64_t nb = layer_staged_rows(p.batch);
    return dispatch_int<1, 4, 8>(nb, [&](auto rows) {
      return dispatch_int<64, 80, 96, 128, 256>(p.head_dim, [&](auto dh) {
        return launch<T, decltype(rows)::value, decltype(dh)::value>(p, workspace, stream);
      });
    });
  });
}

}  // namespace jax_cluster
