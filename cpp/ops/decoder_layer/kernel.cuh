// The one-launch decoder layer (ClusterFusion++'s whole-layer dataflow, one persistent
// grid): every block is resident at once (cooperative launch; the grid is the occupancy
// limit), walks the phases of plan.h and meets the others at grid barriers between them.
//
//   up_front   x's row statistics (every block, for itself); QKV units (+ bias) -> qkv;
//              parallel residual: MLP up units on Norm'(x) too -> act
//   attention  decode_attention's split blocks in append mode (RoPE, new k, v, split-K
//              partials) over items (row, KV head, split); then, with several splits, merge
//              items (row, KV head): the new k, v into the caches, o / l -> attn (fp32)
//   o-proj     h = x + attn W_o + b_o and h's per-tile (mean, M2)   | parallel: y = x +
//   MLP up     Norm'(h) from the tiles' statistics; act = SwiGLU /  |   [attn | act]
//              GeLU of the up GEMV                                  |   [W_o ; W_out] + b
//   MLP down   y = h + act W_down (+ b_out), rounded once
// Barriers: one gpu-scope counter each (zeroed before the launch), arrive = fence + add,
// wait = acquire loads with nanosleep backoff; data produced in the launch is read through
// L2 (ld.cg), never through the read-only path. Before waiting, a block may pull the first
// rows of its next GEMV units into L2 (plan.prefetch_bytes; off by default: it lost).
// Blocks never wait on anything but a barrier all blocks reach: no deadlock while all are
// resident, which the cooperative launch guarantees (it fails otherwise).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "ops/decode_attention/kernel_mma.cuh"
#include "ops/decode_attention/kernel_split.cuh"
#include "ops/decoder_layer/gemv.cuh"
#include "ops/decoder_layer/plan.h"

namespace jax_cluster {

struct DecoderLayerArgs {
  DecoderLayerParams p;
  DecoderLayerPlan pl;
  DecodeAttentionParams dp;  // append mode over pl's workspace regions
  float* ws;
};

// The attention phase's forms: at two blocks per SM (128 registers) the CUDA-core (MHA)
// token loop keeps 4 token steps per warp in flight instead of 8 (twice the warps per SM)
// and the tensor-core one (GQA) runs its lean form.
inline constexpr bool kLayerLeanAttention = kLayerBlocksPerSm > 1;
inline constexpr int kLayerTokenSteps = kLayerLeanAttention ? 4 : kSplitTokenSteps;

// Dynamic shared memory of the kernel (floats): a GEMV unit's or an attention item's
// (q, the warps' states, the lean form's Q' fragments).
template <int DH>
__host__ __device__ constexpr int decoder_layer_attention_floats() {
  return (kDecodeAttentionMaxGroup + 2) * DH + kBlockWarps * kMaxH * (DH + 2);
}
static_assert(decoder_layer_attention_floats<80>() % 4 == 0, "the Q' fragments after it are 16-byte aligned");
template <int NB, int DH>
__host__ __device__ constexpr int decoder_layer_smem_floats() {
  const int gemv = layer_gemv_smem_floats<NB>();
  const int attn = decoder_layer_attention_floats<DH>() + (kLayerLeanAttention ? mma_split_lean_smem_floats<DH>() : 0);
  return gemv > attn ? gemv : attn;
}

__device__ __forceinline__ void layer_grid_barrier(unsigned int* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // the block's writes (ordered by the CTA barrier) before the arrival
    atomicAdd(counter, 1u);
    ptx::wait_counter_at_least(counter, gridDim.x);
  }
  __syncthreads();
}

__device__ __forceinline__ float layer_gelu(float v, bool tanh_form) {
  if (!tanh_form) return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
  return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}

// Row statistics (mean, 1 / sqrt(var + eps) or 1 / rms) of x's rows, one warp per row.
template <typename T, int NB>
__device__ void layer_x_stats(const DecoderLayerParams& p, float* mean, float* rstd) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp < p.batch && warp < NB) {
    const T* row = static_cast<const T*>(p.x) + warp * p.hidden;
    float s = 0.f;
    for (int64_t k = lane * 8; k < p.hidden; k += 256) {
      float v[8];
      unpack<T>(*reinterpret_cast<const uint4*>(row + k), v);
#pragma unroll
      for (int j = 0; j < 8; ++j) s += v[j];
    }
    for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    const float mu = p.norm == NormKind::kLayer ? s / p.hidden : 0.f;
    float q = 0.f;
    for (int64_t k = lane * 8; k < p.hidden; k += 256) {
      float v[8];
      unpack<T>(*reinterpret_cast<const uint4*>(row + k), v);
#pragma unroll
      for (int j = 0; j < 8; ++j) q += (v[j] - mu) * (v[j] - mu);
    }
    for (int off = 16; off; off >>= 1) q += __shfl_xor_sync(0xffffffffu, q, off);
    if (lane == 0) {
      mean[warp] = mu;
      rstd[warp] = rsqrtf(q / p.hidden + p.eps);
    }
  }
  __syncthreads();
}

// h's row statistics from the o-proj tiles' (mean, M2), combined in tile order (Chan).
template <int NB>
__device__ void layer_h_stats(const DecoderLayerParams& p, const DecoderLayerPlan& pl, const float* ws,
                              float* mean, float* rstd) {
  const int b = threadIdx.x;
  if (b < p.batch && b < NB) {
    const int64_t tiles = pl.gemv[kGemvO].tiles;
    double n = 0;
    float mu = 0.f, m2 = 0.f;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t tc = pl.gemv[kGemvO].tile_cols;
      const float nt = static_cast<float>(min(tc, p.hidden - t * tc));
      const float mt = __ldcg(ws + pl.h_stats + (t * p.batch + b) * 2);
      const float qt = __ldcg(ws + pl.h_stats + (t * p.batch + b) * 2 + 1);
      const float tot = static_cast<float>(n) + nt, delta = mt - mu;
      mu += delta * nt / tot;
      m2 += qt + delta * delta * static_cast<float>(n) * nt / tot;
      n += nt;
    }
    const float var = m2 / p.hidden;
    mean[b] = p.norm == NormKind::kLayer ? mu : 0.f;
    rstd[b] = rsqrtf((p.norm == NormKind::kLayer ? var : var + mu * mu) + p.eps);
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ float weight_at(const void* w, int64_t i) {
  return w == nullptr ? 0.f : to_float(static_cast<const T*>(w)[i]);
}

template <typename T, int NB, int DH>
__global__ void __launch_bounds__(kLayerThreads, kLayerBlocksPerSm) decoder_layer_kernel(const DecoderLayerArgs args) {
  extern __shared__ __align__(16) float layer_smem[];
  float* smem = layer_smem;
  __shared__ float x_mean[NB], x_rstd[NB], h_mean[NB], h_rstd[NB];
  const DecoderLayerParams& p = args.p;
  const DecoderLayerPlan& pl = args.pl;
  float* ws = args.ws;
  // Pointers recomputed from the kernel's parameters where used, not held across phases:
  // at 128 registers per thread every live register counts.
  unsigned int* barriers = reinterpret_cast<unsigned int*>(ws + pl.counters);
  auto tile_counters = [&](int gi) { return reinterpret_cast<unsigned int*>(args.ws + pl.counters) + pl.tile_counter_off[gi]; };
  auto partials = [&](int gi) { return args.ws + pl.partials + pl.partial_off[gi]; };
  // The per-phase timeline (plan.h): mark(i) stamps this block's i-th phase boundary.
  unsigned long long* timeline = reinterpret_cast<unsigned long long*>(ws + pl.timeline);
  auto mark = [&](int i) {
    if (threadIdx.x == 0 && blockIdx.x < kLayerTimelineMaxBlocks) {
      timeline[1 + blockIdx.x * kLayerTimelineMarks + i] = ptx::globaltimer();
      if (blockIdx.x == 0 && i == 0) timeline[0] = gridDim.x;
    }
  };
  mark(0);
  const int batch = static_cast<int>(p.batch);
  const int64_t d = p.hidden, f = p.inter, hqd = p.num_q_heads * DH;
  const int64_t cols = (p.num_q_heads + 2 * p.num_kv_heads) * DH;
  const bool layer_norm = p.norm == NormKind::kLayer, parallel = p.parallel_residual;
  const T* x = static_cast<const T*>(p.x);
  float* qkv = ws + pl.qkv;
  float* attn = ws + pl.attn;
  float* h = ws + pl.h;
  float* act = ws + pl.act;

  auto w_qkv = [&] { return LayerWeights<T>{static_cast<const T*>(p.w_qkv), nullptr, cols, d}; };
  auto w_up = [&] { return LayerWeights<T>{static_cast<const T*>(p.w1), static_cast<const T*>(p.w2), f, d}; };
  auto w_o = [&] { return LayerWeights<T>{static_cast<const T*>(p.w_o), static_cast<const T*>(p.w3), d, hqd}; };
  auto w_down = [&] { return LayerWeights<T>{static_cast<const T*>(p.w3), nullptr, d, f}; };

  // Walks GEMV gi's units (after `skip` units of the phase) in block-strided order.
  auto each_unit = [&](int gi, int64_t skip, auto&& fn) {
    const LayerGemv& g = pl.gemv[gi];
    const int64_t first = (blockIdx.x + gridDim.x - skip % gridDim.x) % gridDim.x;
    for (int64_t u = first; u < g.units(); u += gridDim.x) fn(u % g.tiles, u / g.tiles);
  };
  auto prefetch = [&](int gi, const LayerWeights<T>& w) {
    int64_t budget = pl.prefetch_bytes;
    each_unit(gi, 0, [&](int64_t tile, int64_t chunk) {
      if (budget <= 0) return;
      prefetch_layer_unit<T>(pl.gemv[gi], w, tile, chunk, budget);
      budget -= pl.gemv[gi].chunk_rows * pl.gemv[gi].tile_cols * static_cast<int64_t>(sizeof(T));
    });
  };
  auto norm_of_x = [&](const void* nw, const void* nb) {
    return [=](int b, int64_t k) {
      const float v = (to_float(x[b * d + k]) - x_mean[b]) * x_rstd[b] * weight_at<T>(nw, k);
      return layer_norm ? v + weight_at<T>(nb, k) : v;
    };
  };

  // ---- up front: QKV (and the parallel residual's MLP up)
  layer_x_stats<T, NB>(p, x_mean, x_rstd);
  auto finish_qkv = [&](int64_t tile, const float* vals, int nb) {
    const int tc = static_cast<int>(pl.gemv[kGemvQkv].tile_cols);
    for (int e = threadIdx.x; e < nb * tc; e += kLayerThreads) {
      const int b = e / tc;
      const int64_t c = tile * tc + e % tc;
      if (c < cols) __stcg(qkv + b * cols + c, vals[e] + weight_at<T>(p.qkv_bias, c));
    }
  };
  auto finish_up = [&](int64_t tile, const float* vals, int nb) {
    const int tc = static_cast<int>(pl.gemv[kGemvUp].tile_cols), half = tc / 2;
    if (pl.gemv[kGemvUp].paired) {  // act = silu(gate) * up
      for (int e = threadIdx.x; e < nb * half; e += kLayerThreads) {
        const int b = e / half, c = e % half;
        const int64_t col = tile * half + c;
        const float g = vals[b * tc + c], u = vals[b * tc + half + c];
        if (col < f) __stcg(act + b * f + col, g / (1.f + __expf(-g)) * u);
      }
    } else {
      for (int e = threadIdx.x; e < nb * tc; e += kLayerThreads) {
        const int b = e / tc;
        const int64_t col = tile * tc + e % tc;
        if (col < f) {
          __stcg(act + b * f + col, layer_gelu(vals[e] + weight_at<T>(p.b1, col), p.mlp == MlpKind::kGeluTanh));
        }
      }
    }
  };
  each_unit(kGemvQkv, 0, [&](int64_t tile, int64_t chunk) {
    layer_gemv_unit<T, NB>(pl.gemv[kGemvQkv], w_qkv(), tile, chunk, batch, smem, partials(kGemvQkv),
                           tile_counters(kGemvQkv), norm_of_x(p.norm_w, p.norm_b), finish_qkv);
  });
  if (parallel) {
    each_unit(kGemvUp, pl.gemv[kGemvQkv].units(), [&](int64_t tile, int64_t chunk) {
      layer_gemv_unit<T, NB>(pl.gemv[kGemvUp], w_up(), tile, chunk, batch, smem, partials(kGemvUp),
                             tile_counters(kGemvUp), norm_of_x(p.post_norm_w, p.post_norm_b), finish_up);
    });
  }
  mark(1);
  prefetch(kGemvO, w_o());
  layer_grid_barrier(barriers + 0);
  mark(2);

  // ---- attention
  {
    const DecodeAttentionParams& dp = args.dp;
    const int64_t items = p.batch * p.num_kv_heads * pl.splits;
    float* q = smem;
    float* warp_states = smem + (kDecodeAttentionMaxGroup + 2) * DH;
    for (int64_t i = blockIdx.x; i < items; i += gridDim.x) {
      const int64_t bg = i / pl.splits;
      const SplitItem item{static_cast<int>(i % pl.splits), static_cast<int>(bg % p.num_kv_heads),
                           static_cast<int>(bg / p.num_kv_heads)};
      if (decode_attention_uses_tensor_cores(dp)) {
        decode_attention_mma_split_block<T, DH, kLayerLeanAttention>(
            dp, item, q, warp_states, reinterpret_cast<uint4*>(smem + decoder_layer_attention_floats<DH>()));
      } else {
        decode_attention_split_block<T, DH, kLayerTokenSteps>(dp, item, q, warp_states);
      }
      __syncthreads();
    }
    mark(3);
    if (pl.splits > 1) {
      layer_grid_barrier(barriers + 1);
      for (int64_t bg = blockIdx.x; bg < p.batch * p.num_kv_heads; bg += gridDim.x) {
        write_new_kv<T, DH>(dp, bg, threadIdx.x, kLayerThreads);
        for (int e = threadIdx.x; e < dp.group * DH; e += kLayerThreads) {
          __stcg(attn + bg * dp.group * DH + e, merge_splits<DH>(dp, bg, e / DH, e % DH));
        }
      }
    }
  }
  mark(4);
  layer_grid_barrier(barriers + 2);
  mark(5);

  // ---- parallel residual: y = x + attn W_o + b_o + act W_out + b_out, done
  auto store_y = [&](int b, int64_t c, float v) { static_cast<T*>(p.y)[b * d + c] = from_float<T>(v); };
  auto attn_in = [=](int b, int64_t k) { return __ldcg(attn + b * hqd + k); };
  if (parallel) {
    auto in = [=](int b, int64_t k) { return k < hqd ? __ldcg(attn + b * hqd + k) : __ldcg(act + b * f + k - hqd); };
    each_unit(kGemvO, 0, [&](int64_t tile, int64_t chunk) {
      layer_gemv_unit<T, NB>(pl.gemv[kGemvO], w_o(), tile, chunk, batch, smem, partials(kGemvO), tile_counters(kGemvO),
                             in, [&](int64_t t, const float* vals, int nb) {
                               const int tc = static_cast<int>(pl.gemv[kGemvO].tile_cols);
                             for (int e = threadIdx.x; e < nb * tc; e += kLayerThreads) {
                                 const int b = e / tc;
                                 const int64_t c = t * tc + e % tc;
                                 if (c < d) {
                                   store_y(b, c, to_float(x[b * d + c]) + vals[e] + weight_at<T>(p.o_bias, c) +
                                                     weight_at<T>(p.b3, c));
                                 }
                               }
                             });
    });
    mark(6);
    return;
  }

  // ---- sequential: o-proj -> h (and its tile statistics)
  each_unit(kGemvO, 0, [&](int64_t tile, int64_t chunk) {
    layer_gemv_unit<T, NB>(pl.gemv[kGemvO], w_o(), tile, chunk, batch, smem, partials(kGemvO), tile_counters(kGemvO),
                           attn_in, [&](int64_t t, float* vals, int nb) {
                             const int tc = static_cast<int>(pl.gemv[kGemvO].tile_cols);
                             for (int e = threadIdx.x; e < nb * tc; e += kLayerThreads) {
                               const int b = e / tc;
                               const int64_t c = t * tc + e % tc;
                               if (c < d) {
                                 vals[e] += to_float(x[b * d + c]) + weight_at<T>(p.o_bias, c);
                                 __stcg(h + b * d + c, vals[e]);
                               }
                             }
                             __syncthreads();
                             if (threadIdx.x < nb) {  // the tile's (mean, M2) of row b
                               const int b = threadIdx.x;
                               const int n = static_cast<int>(min(static_cast<int64_t>(tc), d - t * tc));
                               float mu = 0.f, m2 = 0.f;
                               for (int c = 0; c < n; ++c) mu += vals[b * tc + c];
                               mu /= n;
                               for (int c = 0; c < n; ++c) {
                                 const float dv = vals[b * tc + c] - mu;
                                 m2 += dv * dv;
                               }
                               __stcg(ws + pl.h_stats + (t * p.batch + b) * 2, mu);
                               __stcg(ws + pl.h_stats + (t * p.batch + b) * 2 + 1, m2);
                             }
                           });
  });
  mark(6);
  prefetch(kGemvUp, w_up());
  layer_grid_barrier(barriers + 3);
  mark(7);

  // ---- MLP up on Norm'(h)
  layer_h_stats<NB>(p, pl, ws, h_mean, h_rstd);
  auto norm_of_h = [=](int b, int64_t k) {
    const float v = (__ldcg(h + b * d + k) - h_mean[b]) * h_rstd[b] * weight_at<T>(p.post_norm_w, k);
    return layer_norm ? v + weight_at<T>(p.post_norm_b, k) : v;
  };
  each_unit(kGemvUp, 0, [&](int64_t tile, int64_t chunk) {
    layer_gemv_unit<T, NB>(pl.gemv[kGemvUp], w_up(), tile, chunk, batch, smem, partials(kGemvUp),
                           tile_counters(kGemvUp), norm_of_h, finish_up);
  });
  mark(8);
  prefetch(kGemvDown, w_down());
  layer_grid_barrier(barriers + 4);
  mark(9);

  // ---- MLP down: y = h + act W_down (+ b_out)
  auto act_in = [=](int b, int64_t k) { return __ldcg(act + b * f + k); };
  each_unit(kGemvDown, 0, [&](int64_t tile, int64_t chunk) {
    layer_gemv_unit<T, NB>(pl.gemv[kGemvDown], w_down(), tile, chunk, batch, smem, partials(kGemvDown),
                           tile_counters(kGemvDown), act_in, [&](int64_t t, const float* vals, int nb) {
                             const int tc = static_cast<int>(pl.gemv[kGemvDown].tile_cols);
                             for (int e = threadIdx.x; e < nb * tc; e += kLayerThreads) {
                               const int b = e / tc;
                               const int64_t c = t * tc + e % tc;
                               if (c < d) store_y(b, c, __ldcg(h + b * d + c) + vals[e] + weight_at<T>(p.b3, c));
                             }
                           });
  });
  mark(10);
}

}  // namespace jax_cluster
