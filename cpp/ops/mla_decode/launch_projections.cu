// Host launchers of mla_decode's projection kernels (projections.h): cluster launches,
// programmatic (PDL), shared memory sized from the shapes, rows rounded up to 1, 2, 4 or 8.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/launch.cuh"
#include "jax_cluster/zero_words.cuh"
#include "ops/mla_decode/launch.h"
#include "ops/mla_decode/projections.cuh"

namespace jax_cluster {
namespace {

int round4(int64_t floats) { return static_cast<int>((floats + 3) / 4 * 4); }
int gemv_red(int w) { return mla_gemv_groups(w) * w; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

MlaSmem project_smem(const MlaProjectParams& p, int nb) {
  // head tiles and latent tiles (the last may be narrower)
  const int hw = static_cast<int>(p.head_cols());
  const int lw = static_cast<int>(p.latent_cols() - (mla_project_latent_tiles(p) - 1) * p.head_cols());
  const int64_t items = ceil_div(p.rank, kMlaClusterBlocks) * (p.nope / 8);
  const int64_t k = std::max(p.hidden, p.q_src != nullptr ? p.q_in : p.hidden);
  MlaSmem s{};
  s.red = round4(nb * std::max<int64_t>({gemv_red(hw), gemv_red(lw), items}));
  s.sums = round4(nb * hw);
  s.full = std::max(s.sums, 32);  // also the rows' 1 / rms before the GEMV
  s.stage = round4(nb * ceil_div(k, kMlaClusterBlocks));
  return s;
}

MlaSmem output_smem(const MlaOutputParams& p, int nb) {
  const int dv = static_cast<int>(p.v_dim), slice = static_cast<int>(mla_output_slice_cols(p.hidden));
  MlaSmem s{};
  s.red = round4(nb * std::max(gemv_red(dv), gemv_red(slice)));
  s.sums = round4(nb * std::max(dv, slice));
  s.full = round4(nb * dv);
  s.stage = round4(nb * ceil_div(p.rank, kMlaClusterBlocks));
  return s;
}

template <typename F>
cudaError_t dispatch_rows(int64_t batch, F&& f) {
  if (batch <= 1) return f(IntTag<1>{});
  if (batch <= 2) return f(IntTag<2>{});
  if (batch <= 4) return f(IntTag<4>{});
  return f(IntTag<8>{});
}

}  // namespace

cudaError_t launch_mla_project(const MlaProjectParams& p, cudaStream_t stream) {
  // both kernels' counters (projections.h): mla_output's launch then needs no memset
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(zero_words(p.counters, kMlaCounterWords, stream));
  return dispatch_half(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return dispatch_rows(p.batch, [&](auto nb) {
      constexpr int NB = decltype(nb)::value;
      const MlaSmem sm = project_smem(p, NB);
      const dim3 grid(static_cast<unsigned>((p.num_heads + mla_project_latent_tiles(p)) * kMlaClusterBlocks));
      return launch_cluster_programmatic(mla_project_kernel<T, NB>, grid, dim3(kMlaProjectThreads),
                                         sm.total() * sizeof(float), kMlaClusterBlocks, stream, p, sm);
    });
  });
}

cudaError_t launch_mla_output(const MlaOutputParams& p, cudaStream_t stream) {
  return dispatch_half(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return dispatch_rows(p.batch, [&](auto nb) {
      constexpr int NB = decltype(nb)::value;
      const MlaSmem sm = output_smem(p, NB);
      const dim3 grid(static_cast<unsigned>(p.num_heads * kMlaClusterBlocks));
      return launch_cluster_programmatic(mla_output_kernel<T, NB>, grid, dim3(kMlaProjectThreads),
                                         sm.total() * sizeof(float), kMlaClusterBlocks, stream, p, sm);
    });
  });
}

}  // namespace jax_cluster
