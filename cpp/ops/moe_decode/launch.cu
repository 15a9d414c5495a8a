// Launches the MoE decode kernels: the gate/up and down GEMVs (experts.cuh), then the
// combine (combine.cuh); down and combine programmatically (PDL).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/launch.cuh"
#include "ops/moe_decode/combine.cuh"
#include "ops/moe_decode/experts.cuh"
#include "ops/moe_decode/launch.h"

namespace jax_cluster {
namespace {

template <typename T, int MR>
cudaError_t launch_typed(const MoeDecodeParams& p, cudaStream_t stream) {
  const MoeDecodeLayout l = moe_decode_layout(p.n, p.k, p.h, p.i, p.i_s, p.dtype);
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  float* y = reinterpret_cast<float*>(ws + l.y_offset);
  // One grid row per expert some pair may choose (at most min(E, N k) are), then one per
  // shared chunk.
  const int64_t chunks = moe_decode_shared_chunks(p.i_s, p.i);
  const int routed_rows = static_cast<int>(std::min(p.e, p.n * p.k));
  const unsigned grid_rows = static_cast<unsigned>(routed_rows + chunks);

  moe::GemvArgs up{};
  up.a = p.x;
  up.w0 = p.w_gate;
  up.w1 = p.w_up;
  up.ids = p.ids;
  up.out = ws;
  up.pairs = p.n * p.k;
  up.experts = static_cast<int>(p.e);
  up.routed_rows = routed_rows;
  up.rows = p.n;
  up.inter = p.i;
  up.shared_width = p.i_s;
  up.s0 = p.s_gate;
  up.s1 = p.s_up;
  up.row_div = p.k;
  up.k = p.h;
  up.n = p.i;
  up.cols = p.cols_up;
  up.wait_prior = false;  // a plain launch: its blocks read ids (the router's) before any wait
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(
      moe::gemv_kernel<T, MR, true>(p.cols_up),
      dim3(static_cast<unsigned>(moe_decode_ceil_div(p.i, p.cols_up)), grid_rows), dim3(kMoeDecodeThreads),
      moe_decode_smem_bytes(MR, p.cols_up, p.h, 2, p.e), false, stream, up));

  moe::GemvArgs down = up;
  down.a = ws;
  down.w0 = p.w_down;
  down.w1 = nullptr;
  down.s0 = p.s_down;
  down.s1 = nullptr;
  down.out = y;
  down.row_div = 1;
  down.k = p.i;
  down.n = p.h;
  down.cols = p.cols_down;
  down.wait_prior = p.pdl;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(
      moe::gemv_kernel<T, MR, false>(p.cols_down),
      dim3(static_cast<unsigned>(moe_decode_ceil_div(p.h, p.cols_down)), grid_rows), dim3(kMoeDecodeThreads),
      moe_decode_smem_bytes(MR, p.cols_down, p.i, 1, p.e), p.pdl, stream, down));

  moe::CombineArgs c{};
  c.y = y;
  c.weights = p.weights;
  c.ids = p.ids;
  c.residual = p.has_residual ? p.residual : nullptr;
  c.out = p.out;
  c.n = p.n;
  c.h = p.h;
  c.k = p.k;
  c.e = p.e;
  c.shared_chunks = chunks;
  const int64_t blocks = std::min<int64_t>(moe_decode_ceil_div(p.n * p.h / 4, kMoeDecodeThreads), int64_t{1} << 20);
  return launch_programmatic(moe::moe_combine_kernel<T>, dim3(static_cast<unsigned>(blocks)),
                             dim3(kMoeDecodeThreads), 0, p.pdl, stream, c);
}

}  // namespace

cudaError_t launch_moe_decode(const MoeDecodeParams& p, cudaStream_t stream) {
  if (!moe_decode_check(p).empty() || !moe_decode_cuda_check(p).empty()) return cudaErrorInvalidValue;
  return dispatch_half(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return dispatch_int<1, 2, 4, kMoeDecodeMaxPassRows>(moe_decode_pass_rows(p.n), [&](auto mr) {
      return launch_typed<T, decltype(mr)::value>(p, stream);
    });
  });
}

}  // namespace jax_cluster
