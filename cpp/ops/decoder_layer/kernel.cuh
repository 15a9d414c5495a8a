// The one-launch decoder layer (ClusterFusion++'s whole-layer dataflow, one persistent
// grid): every block is resident at once (cooperative launch; the grid is the occupancy
// limit) and walks the phases of plan.h in order:
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
// Dependencies, not grid barriers: an item waits for exactly what it reads. An attention
// item for the QKV tiles of its KV group, a merge item for its (row, KV head)'s splits, an
// o-proj unit for the merged heads of its K chunk, an MLP-up unit for the h tiles of its
// chunk, an MLP-down unit for the MLP-up tiles of its chunk. RMSNorm's MLP up starts on
// those h tiles before h's statistics exist: it multiplies h * w_norm and scales the sums
// by 1 / rms(h) in the epilogue, once every h tile is in (LayerNorm's needs the mean first).
// Producer: stores, block barrier, fence, counter add (thread 0). Consumer: acquire loads of
// the counter with nanosleep backoff (thread 0), block barrier, then reads through L2
// (ld.cg), never through the read-only path. Every wait is on an earlier phase, which every
// block finishes before it starts a later one: with all blocks resident (which the
// cooperative launch guarantees, it fails otherwise) no wait can starve its producer.
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

// Dynamic shared memory of the kernel (floats): a GEMV unit's or an attention item's (a
// split block's: q, the warps' states, the lean form's Q' fragments).
template <int NB, int DH>
__host__ __device__ constexpr int decoder_layer_smem_floats() {
  const int gemv = layer_gemv_smem_floats<NB>();
  const int attn = mma_split_smem_floats<DH, kLayerLeanAttention>();
  return gemv > attn ? gemv : attn;
}

// Thread 0 waits until *counter >= target (the rest of the block waits at the caller's
// block barrier).
__device__ __forceinline__ void layer_wait(const unsigned int* counter, unsigned int target) {
  if (threadIdx.x == 0) ptx::wait_counter_at_least(counter, target);
}
// Raises *counter once the block's stores so far are visible (all threads call it).
__device__ __forceinline__ void layer_signal(unsigned int* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // the block's stores (ordered by the block barrier) before the count
    atomicAdd(counter, 1u);
  }
}
// Thread 0 waits for the ready flags of the tiles holding columns [c0, c1) of a GEMV whose
// tiles are `width` output columns wide.
__device__ __forceinline__ void layer_wait_tiles(const unsigned int* ready, int64_t c0, int64_t c1, int64_t width) {
  if (threadIdx.x != 0 || c1 <= c0) return;
  for (int64_t t = c0 / width; t <= (c1 - 1) / width; ++t) ptx::wait_counter_at_least(ready + t, 1u);
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

// A tile's epilogue: thread j owns the tile's column col0 + j (< n) of every batch row.
// load(b, j, col) runs for every row before the first store(b, j, col, v): one round trip
// per tile instead of one per row (a load the compiler cannot move above a store that may
// alias it). Rows past nb load row nb - 1 (in bounds) and store nothing.
template <int NB, typename Load, typename Store>
__device__ __forceinline__ void layer_tile_epilogue(int64_t col0, int64_t n, int nb, Load load, Store store) {
  static_assert(kLayerTileCols == kLayerThreads, "a thread per tile column");
  const int j = threadIdx.x;
  const int64_t col = col0 + j;
  if (col >= n) return;
  float v[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) v[b] = load(min(b, nb - 1), j, col);
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if (b < nb) store(b, j, col, v[b]);
  }
}

// The (mean, M2) of each of the nb rows of a tile's n values vals[b * 256 + c] into
// out[2 b], out[2 b + 1]: warp b for row b, a fixed shuffle tree (reproducible). Every
// thread calls it (block barriers inside).
template <int NB>
__device__ __forceinline__ void layer_tile_stats(const float* vals, int n, int nb, float* out) {
  static_assert(NB <= kLayerThreads / 32, "a warp per row");
  constexpr int per_lane = kLayerTileCols / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (warp < nb) {
    float v[per_lane], s = 0.f;
#pragma unroll
    for (int i = 0; i < per_lane; ++i) {
      const int c = lane + 32 * i;
      v[i] = c < n ? vals[warp * kLayerTileCols + c] : 0.f;
      s += v[i];
    }
    for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    const float mu = s / n;
    float m2 = 0.f;
#pragma unroll
    for (int i = 0; i < per_lane; ++i) {
      const float dv = lane + 32 * i < n ? v[i] - mu : 0.f;
      m2 += dv * dv;
    }
    for (int off = 16; off; off >>= 1) m2 += __shfl_xor_sync(0xffffffffu, m2, off);
    if (lane == 0) {
      __stcg(out + 2 * warp, mu);
      __stcg(out + 2 * warp + 1, m2);
    }
  }
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
  auto words = [&] { return reinterpret_cast<unsigned int*>(args.ws + pl.counters); };
  auto tile_counters = [&](int gi) { return words() + pl.tile_counter_off[gi]; };
  auto ready = [&](int gi) { return words() + pl.tile_ready_off[gi]; };
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
  const int64_t d = p.hidden, f = p.inter, hqd = p.num_q_heads * DH, hkv = p.num_kv_heads;
  const int64_t cols = (p.num_q_heads + 2 * p.num_kv_heads) * DH;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
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
  // Output columns per tile of MLP up: act's (a paired tile holds gate and up halves).
  const int64_t up_width = pl.gemv[kGemvUp].paired ? kLayerTileCols / 2 : kLayerTileCols;
  // Thread 0: waits for the merged attention output of the heads in attn columns [c0, c1),
  // every row.
  auto wait_heads = [&](int64_t c0, int64_t c1) {
    if (threadIdx.x != 0 || c1 <= c0) return;
    for (int64_t g = c0 / DH / group; g <= (c1 - 1) / DH / group; ++g) {
      for (int b = 0; b < batch; ++b) ptx::wait_counter_at_least(words() + pl.merged_off + b * hkv + g, 1u);
    }
  };
  auto no_wait = [](int64_t, int64_t) {};
  auto norm_of_x = [&](const void* nw, const void* nb) {
    return [=](int b, int64_t k) {
      const float v = (to_float(x[b * d + k]) - x_mean[b]) * x_rstd[b] * weight_at<T>(nw, k);
      return layer_norm ? v + weight_at<T>(nb, k) : v;
    };
  };

  // ---- up front: QKV (and the parallel residual's MLP up)
  layer_x_stats<T, NB>(p, x_mean, x_rstd);
  auto qkv_bias = [&](int, int64_t c) { return weight_at<T>(p.qkv_bias, c); };
  auto finish_qkv = [&](int64_t tile, const float* vals, int nb) {
    layer_tile_epilogue<NB>(
        tile * kLayerTileCols, cols, nb, [&](int b, int j, int64_t) { return vals[b * kLayerTileCols + j]; },
        [&](int b, int, int64_t c, float v) { __stcg(qkv + b * cols + c, v); });
  };
  // scale[b]: RMSNorm's 1 / rms(h) when MLP up multiplied h * w_norm (else null).
  auto finish_up = [&](int64_t tile, const float* vals, int nb, const float* scale) {
    const int tc = static_cast<int>(pl.gemv[kGemvUp].tile_cols), half = tc / 2;
    if (pl.gemv[kGemvUp].paired) {  // act = silu(gate) * up
      for (int e = threadIdx.x; e < nb * half; e += kLayerThreads) {
        const int b = e / half, c = e % half;
        const int64_t col = tile * half + c;
        const float sc = scale != nullptr ? scale[b] : 1.f;
        const float g = vals[b * tc + c] * sc, u = vals[b * tc + half + c] * sc;
        if (col < f) __stcg(act + b * f + col, g / (1.f + __expf(-g)) * u);
      }
    } else {
      layer_tile_epilogue<NB>(
          tile * tc, f, nb,
          [&](int b, int j, int64_t col) {
            const float sc = scale != nullptr ? scale[b] : 1.f;
            return layer_gelu(vals[b * tc + j] * sc + weight_at<T>(p.b1, col), p.mlp == MlpKind::kGeluTanh);
          },
          [&](int b, int, int64_t col, float v) { __stcg(act + b * f + col, v); });
    }
  };
  each_unit(kGemvQkv, 0, [&](int64_t tile, int64_t chunk) {
    layer_gemv_unit<T, NB>(pl.gemv[kGemvQkv], w_qkv(), tile, chunk, batch, smem, partials(kGemvQkv),
                           tile_counters(kGemvQkv), ready(kGemvQkv), no_wait, norm_of_x(p.norm_w, p.norm_b),
                           qkv_bias, finish_qkv);
  });
  // The parallel residual's MLP up on Norm'(x), its units block-strided after `skip` units.
  auto parallel_up = [&](int64_t skip) {
    each_unit(kGemvUp, skip, [&](int64_t tile, int64_t chunk) {
      layer_gemv_unit<T, NB>(pl.gemv[kGemvUp], w_up(), tile, chunk, batch, smem, partials(kGemvUp),
                             tile_counters(kGemvUp), ready(kGemvUp), no_wait,
                             norm_of_x(p.post_norm_w, p.post_norm_b), LayerNoAddend{},
                             [&](int64_t t, const float* vals, int nb) { finish_up(t, vals, nb, nullptr); });
    });
  };
  if (parallel) parallel_up(pl.gemv[kGemvQkv].units());
  mark(1);

  // ---- attention: each item once the QKV tiles of its KV group are in
  {
    const DecodeAttentionParams& dp = args.dp;
    const int64_t items = p.batch * hkv * pl.splits;
    float* q = smem;
    float* warp_states = smem + split_q_floats<DH>();
    for (int64_t i = blockIdx.x; i < items; i += gridDim.x) {
      const int64_t bg = i / pl.splits;
      const SplitItem item{static_cast<int>(i % pl.splits), static_cast<int>(bg % hkv), static_cast<int>(bg / hkv)};
      const int64_t g = item.g;
      layer_wait_tiles(ready(kGemvQkv), g * group * DH, (g + 1) * group * DH, kLayerTileCols);  // q
      layer_wait_tiles(ready(kGemvQkv), hqd + g * DH, hqd + (g + 1) * DH, kLayerTileCols);      // k
      layer_wait_tiles(ready(kGemvQkv), hqd + (hkv + g) * DH, hqd + (hkv + g + 1) * DH, kLayerTileCols);  // v
      __syncthreads();
      if (decode_attention_uses_tensor_cores(dp)) {
        decode_attention_mma_split_block<T, DH, kLayerLeanAttention>(
            dp, item, q, warp_states, reinterpret_cast<uint4*>(smem + split_smem_floats<DH>()));
      } else {
        decode_attention_split_block<T, DH, kLayerTokenSteps>(dp, item, q, warp_states);
      }
      // One split: the item wrote its heads' output and the new k, v; else its partial.
      layer_signal(words() + (pl.splits > 1 ? pl.splits_done_off : pl.merged_off) + bg);
    }
    mark(2);
    if (pl.splits > 1) {
      for (int64_t bg = blockIdx.x; bg < p.batch * hkv; bg += gridDim.x) {
        layer_wait(words() + pl.splits_done_off + bg, static_cast<unsigned int>(pl.splits));
        __syncthreads();
        write_new_kv<T, DH>(dp, bg, threadIdx.x, kLayerThreads);
        for (int e = threadIdx.x; e < dp.group * DH; e += kLayerThreads) {
          __stcg(attn + bg * dp.group * DH + e, merge_splits<DH>(dp, bg, e / DH, e % DH));
        }
        layer_signal(words() + pl.merged_off + bg);
      }
    }
  }
  mark(3);

  // ---- parallel residual: y = x + attn W_o + b_o + act W_out + b_out, done
  auto store_y = [&](int b, int64_t c, float v) { static_cast<T*>(p.y)[b * d + c] = from_float<T>(v); };
  auto attn_in = [=](int b, int64_t k) { return __ldcg(attn + b * hqd + k); };
  if (parallel) {
    auto in = [=](int b, int64_t k) { return k < hqd ? __ldcg(attn + b * hqd + k) : __ldcg(act + b * f + k - hqd); };
    each_unit(kGemvO, 0, [&](int64_t tile, int64_t chunk) {
      auto wait = [&](int64_t kb, int64_t ke) {
        wait_heads(kb, min(ke, hqd));
        layer_wait_tiles(ready(kGemvUp), max(kb, hqd) - hqd, ke - hqd, up_width);
      };
      auto residual = [&](int b, int64_t c) {
        return to_float(x[b * d + c]) + weight_at<T>(p.o_bias, c) + weight_at<T>(p.b3, c);
      };
      layer_gemv_unit<T, NB>(pl.gemv[kGemvO], w_o(), tile, chunk, batch, smem, partials(kGemvO), tile_counters(kGemvO),
                             ready(kGemvO), wait, in, residual, [&](int64_t t, const float* vals, int nb) {
                               layer_tile_epilogue<NB>(
                                   t * kLayerTileCols, d, nb,
                                   [&](int b, int j, int64_t) { return vals[b * kLayerTileCols + j]; },
                                   [&](int b, int, int64_t c, float v) { store_y(b, c, v); });
                             });
    });
    mark(4);
    return;
  }

  // ---- sequential: o-proj -> h (and its tile statistics), each unit once its heads are merged
  auto x_and_bias = [&](int b, int64_t c) { return to_float(x[b * d + c]) + weight_at<T>(p.o_bias, c); };
  each_unit(kGemvO, 0, [&](int64_t tile, int64_t chunk) {
    layer_gemv_unit<T, NB>(pl.gemv[kGemvO], w_o(), tile, chunk, batch, smem, partials(kGemvO), tile_counters(kGemvO),
                           ready(kGemvO), wait_heads, attn_in, x_and_bias, [&](int64_t t, float* vals, int nb) {
                             const int tc = kLayerTileCols;
                             layer_tile_epilogue<NB>(
                                 t * tc, d, nb, [&](int b, int j, int64_t) { return vals[b * tc + j]; },
                                 [&](int b, int, int64_t c, float v) { __stcg(h + b * d + c, v); });
                             layer_tile_stats<NB>(vals, static_cast<int>(min(static_cast<int64_t>(tc), d - t * tc)), nb,
                                                  ws + pl.h_stats + t * p.batch * 2);
                           });
  });
  mark(4);

  // ---- MLP up on Norm'(h). h's statistics need every h tile: RMSNorm stages h * w_norm as
  // soon as the unit's own h tiles are in and scales by 1 / rms(h) in the epilogue;
  // LayerNorm (mean subtracted first) waits for all of h before staging.
  bool have_h_stats = false;
  auto ensure_h_stats = [&] {  // all threads; once per block
    if (have_h_stats) return;
    layer_wait_tiles(ready(kGemvO), 0, d, kLayerTileCols);
    __syncthreads();
    layer_h_stats<NB>(p, pl, ws, h_mean, h_rstd);
    have_h_stats = true;
  };
  each_unit(kGemvUp, 0, [&](int64_t tile, int64_t chunk) {
    auto wait = [&](int64_t kb, int64_t ke) {
      if (layer_norm) {
        ensure_h_stats();
      } else {
        layer_wait_tiles(ready(kGemvO), kb, ke, kLayerTileCols);
      }
    };
    auto in = [=](int b, int64_t k) {
      const float v = __ldcg(h + b * d + k);
      if (!layer_norm) return v * weight_at<T>(p.post_norm_w, k);
      return (v - h_mean[b]) * h_rstd[b] * weight_at<T>(p.post_norm_w, k) + weight_at<T>(p.post_norm_b, k);
    };
    layer_gemv_unit<T, NB>(pl.gemv[kGemvUp], w_up(), tile, chunk, batch, smem, partials(kGemvUp),
                           tile_counters(kGemvUp), ready(kGemvUp), wait, in, LayerNoAddend{},
                           [&](int64_t t, const float* vals, int nb) {
                             ensure_h_stats();
                             finish_up(t, vals, nb, layer_norm ? nullptr : h_rstd);
                           });
  });
  mark(5);

  // ---- MLP down: y = h + act W_down (+ b_out), each unit once the act tiles of its chunk are in
  auto act_in = [=](int b, int64_t k) { return __ldcg(act + b * f + k); };
  auto h_and_bias = [&](int b, int64_t c) { return __ldcg(h + b * d + c) + weight_at<T>(p.b3, c); };
  each_unit(kGemvDown, 0, [&](int64_t tile, int64_t chunk) {
    auto wait = [&](int64_t kb, int64_t ke) { layer_wait_tiles(ready(kGemvUp), kb, ke, up_width); };
    layer_gemv_unit<T, NB>(pl.gemv[kGemvDown], w_down(), tile, chunk, batch, smem, partials(kGemvDown),
                           tile_counters(kGemvDown), ready(kGemvDown), wait, act_in, h_and_bias,
                           [&](int64_t t, const float* vals, int nb) {
                             layer_tile_epilogue<NB>(
                                 t * kLayerTileCols, d, nb, [&](int b, int j, int64_t) { return vals[b * kLayerTileCols + j]; },
                                 [&](int b, int, int64_t c, float v) { store_y(b, c, v); });
                           });
  });
  mark(6);
}

}  // namespace jax_cluster
