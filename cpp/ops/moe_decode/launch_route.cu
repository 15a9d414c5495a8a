// The router kernel of moe_decode (route.h has the algorithm and its contract).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>

#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/launch.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "ops/moe_decode/launch.h"

namespace jax_cluster {
namespace {

constexpr int kThreads = kMoeRouteThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kRowGroup = 8;  // rows per pass over a chunk's router columns
static_assert(kMoeRouteMaxRows <= kWarps, "the selection keeps row n's scores in warp n's row of shared memory");
// Loads a thread issues before it uses the first: the router and partial reads are a few KB
// per block, so their time is L2/DRAM round trips, not bytes.
constexpr int kLoads = 16;

// Shared memory, in floats: a partials block's staged x chunk [N][kc] and K-slice partials
// [subs][kRowGroup][cols]; the select block's per-warp scores [E] and group bests [E], then
// where several threads sum a score's chunks, their slice sums [slices][N * E] (at most
// kThreads). Either at most 40 KB: under the 48 KB a launch may take without opting in.
inline int64_t partials_smem_floats(int64_t n, int64_t kc) { return n * kc + kRowGroup * kThreads; }
// scores and group bests [2 kWarps][E], the chunk sums [kThreads], noaux_tc's score_bias [E]
inline int64_t select_smem_floats(int64_t e) { return 2 * kWarps * e + kThreads + e; }

// (value, index) of the larger score, the lower index on ties; NaN never wins.
__device__ __forceinline__ void better(float v, int i, float* bv, int* bi) {
  if (v > *bv || (v == *bv && i < *bi)) {
    *bv = v;
    *bi = i;
  }
}

// Block c: the partial logits of K chunk c, [N][E] fp32, to the workspace.
template <typename T, typename R>
__global__ void __launch_bounds__(kThreads) moe_route_partials_kernel(const MoeRouteParams p, int kc) {
  extern __shared__ __align__(16) float smem[];
  const int tid = threadIdx.x;
  const int N = static_cast<int>(p.n), E = static_cast<int>(p.e), H = static_cast<int>(p.h);
  const int c = blockIdx.x, k0 = c * kc, rows = min(kc, H - k0);
  const R* router = static_cast<const R*>(p.router);
  float* partial = static_cast<float*>(p.workspace);
  ptx::griddep_wait();  // x is the previous kernel's

  // This chunk's partial logits: x[:, chunk] staged in fp32; column e's K rows split over
  // `subs` thread slices, the slices summed in order.
  float* sx = smem;
  float* red = smem + N * kc;
  const T* x = static_cast<const T*>(p.x);
  for (int i = tid; i < N * rows; i += kThreads) {
    const int n = i / rows, kk = i - n * rows;
    sx[n * kc + kk] = to_float(x[static_cast<int64_t>(n) * H + k0 + kk]);
  }
  __syncthreads();
  const int cols = min(E, kThreads), subs = kThreads / cols;
  const int s = tid / cols, el = tid - s * cols;
  for (int e0 = 0; e0 < E; e0 += cols) {
    const int e = e0 + el;
    const bool active = s < subs && e < E;
    for (int n0 = 0; n0 < N; n0 += kRowGroup) {
      float acc[kRowGroup];
#pragma unroll
      for (int j = 0; j < kRowGroup; ++j) acc[j] = 0.f;
      if (active) {
        for (int kb = s; kb < rows; kb += subs * kLoads) {
          float w[kLoads];
#pragma unroll
          for (int u = 0; u < kLoads; ++u) {
            const int kk = kb + u * subs;
            w[u] = kk < rows ? to_float(router[static_cast<int64_t>(k0 + kk) * E + e]) : 0.f;
          }
#pragma unroll
          for (int u = 0; u < kLoads; ++u) {
            const int kk = kb + u * subs;
            if (kk >= rows) break;
#pragma unroll
            for (int j = 0; j < kRowGroup; ++j) {
              if (n0 + j < N) acc[j] = fmaf(sx[(n0 + j) * kc + kk], w[u], acc[j]);
            }
          }
        }
      }
      if (s < subs) {
#pragma unroll
        for (int j = 0; j < kRowGroup; ++j) red[(s * kRowGroup + j) * cols + el] = acc[j];
      }
      __syncthreads();
      for (int i = tid; i < kRowGroup * cols; i += kThreads) {
        const int j = i / cols, l = i - j * cols;
        if (n0 + j >= N || e0 + l >= E) continue;
        float v = 0.f;
        for (int t = 0; t < subs; ++t) v += red[(t * kRowGroup + j) * cols + l];
        __stcg(partial + (static_cast<int64_t>(c) * N + n0 + j) * E + e0 + l, v);
      }
      __syncthreads();
    }
  }
  ptx::griddep_launch_dependents();  // the select kernel may launch; it waits for every chunk
}

// Row n's top_k of the warp's choices ch[E] ((value, index) argmax rounds, a chosen entry
// becomes NaN): ids and the scores sc[id] to row n's outputs; returns the scores' sum (the same
// on every lane, in rank order).
__device__ float choose_top_k(const MoeRouteParams& p, int n, const float* sc, float* ch, int lane) {
  const int E = static_cast<int>(p.e), K = static_cast<int>(p.k);
  float sum = 0.f;
  for (int r = 0; r < K; ++r) {
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int e = lane; e < E; e += 32) better(ch[e], e, &bv, &bi);
    for (int off = 16; off; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      better(ov, oi, &bv, &bi);
    }
    const bool mine = bi != INT_MAX && lane == (bi & 31);
    float w = mine ? sc[bi] : 0.f;
    __syncwarp();
    if (mine) ch[bi] = NAN;
    w = __shfl_sync(0xffffffffu, w, bi & 31);
    if (lane == 0) {
      p.ids[static_cast<int64_t>(n) * K + r] = bi == INT_MAX ? -1 : bi;
      p.weights[static_cast<int64_t>(n) * K + r] = w;
    }
    sum += w;
    __syncwarp();
  }
  return sum;
}

// Row n's weights, written raw by choose_top_k, rescaled by the lanes that own them: V2
// renormalises (norm_topk_prob, top_k > 1) or scales; V3 renormalises (norm_topk_prob), then scales.
__device__ void finish_row(const MoeRouteParams& p, int n, float sum, int lane) {
  const int K = static_cast<int>(p.k);
  const bool norm = p.norm_topk_prob && (p.noaux_tc || K > 1);
  const float scale = p.noaux_tc || !norm ? p.scaling : 1.f;
  __syncwarp();  // lane 0's raw weights are visible
  for (int r = lane; r < K; r += 32) {
    float* w = p.weights + static_cast<int64_t>(n) * K + r;
    *w = (norm ? *w / (sum + 1e-20f) : *w) * scale;
  }
  __syncwarp();
}

// DeepSeek-V3's noaux_tc for row n: sc [E] holds the logits on entry, the sigmoid scores after;
// ch [E] gets the choice (scores + bias, -inf outside the kept groups). bias: score_bias,
// staged in shared memory (read in loops, from global memory each read was a round trip).
__device__ void noaux_tc_choice(const MoeRouteParams& p, float* sc, float* ch, const float* bias, int lane) {
  const int E = static_cast<int>(p.e), groups = static_cast<int>(p.n_group), G = E / groups;
  for (int e = lane; e < E; e += 32) sc[e] = 1.f / (1.f + expf(-sc[e]));
  __syncwarp();
  for (int g = lane; g < groups; g += 32) {  // a group's score: its two best choices' sum
    float b1 = -INFINITY, b2 = -INFINITY;
    for (int e = g * G; e < (g + 1) * G; ++e) {
      const float c = sc[e] + bias[e];
      if (c > b1) {
        b2 = b1;
        b1 = c;
      } else if (c > b2) {
        b2 = c;
      }
    }
    ch[g] = b1 + b2;
  }
  __syncwarp();
  uint32_t kept = 0;  // bit j: expert lane + 32 j lies in a kept group (E <= 512: j < 16)
  for (int j = 0, e = lane; e < E; ++j, e += 32) {
    const int g = e / G;
    int above = 0;
    for (int h = 0; h < groups; ++h) above += ch[h] > ch[g] || (ch[h] == ch[g] && h < g);
    kept |= static_cast<uint32_t>(above < p.topk_group) << j;
  }
  __syncwarp();
  for (int j = 0, e = lane; e < E; ++j, e += 32) ch[e] = (kept >> j) & 1u ? sc[e] + bias[e] : -INFINITY;
  __syncwarp();
}

// One block: the logits (the chunks' partials summed) and the selection, a warp per row.
__global__ void __launch_bounds__(kThreads) moe_route_select_kernel(const MoeRouteParams p, int chunks) {
  extern __shared__ __align__(16) float smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int N = static_cast<int>(p.n), E = static_cast<int>(p.e);
  const float* partial = static_cast<const float*>(p.workspace);
  // score_bias is an input: staged before the wait (the partials kernel triggers this launch
  // only after its own wait, so every earlier kernel is done); read after the barrier below.
  float* bias = smem + 2 * kWarps * E + kThreads;
  if (p.noaux_tc) {
    for (int e = tid; e < E; e += kThreads) bias[e] = p.score_bias[e];
  }
  ptx::griddep_wait();  // every chunk's partials are written
  // The logits: each (row, expert) pair's chunk partials summed by `slices` threads (chunks
  // slice, slice + slices, ... in order), the slice sums then added in slice order. One
  // slice sums straight into row n's scores (warp n's, as N <= kWarps).
  const int pairs = N * E, slices = max(1, min(chunks, kThreads / pairs));
  float* sums = slices > 1 ? smem + 2 * kWarps * E : smem;  // [slices][pairs]
  for (int i = tid; i < pairs * slices; i += kThreads) {
    const int sl = i / pairs, pr = i - sl * pairs;
    float v = 0.f;
    for (int cb = sl; cb < chunks; cb += slices * kLoads) {
      float t[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int cc = cb + u * slices;
        t[u] = cc < chunks ? __ldcg(partial + static_cast<int64_t>(cc) * pairs + pr) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) v += t[u];
    }
    sums[sl * pairs + pr] = v;
  }
  __syncthreads();
  float* sc = smem + warp * E;               // this warp's row: scores
  float* gb = smem + (kWarps + warp) * E;    // group bests (noaux_tc: then the choice)
  const int G = p.group_limited ? E / static_cast<int>(p.n_group) : E;
  for (int n = warp; n < N; n += kWarps) {
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) {
      float v = sums[n * E + e];
      for (int sl = 1; sl < slices; ++sl) v += sums[sl * pairs + n * E + e];
      sc[e] = v;
      m = fmaxf(m, v);
    }
    if (p.noaux_tc) {
      __syncwarp();
      noaux_tc_choice(p, sc, gb, bias, lane);
      finish_row(p, n, choose_top_k(p, n, sc, gb, lane), lane);
      continue;
    }
    for (int off = 16; off; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float z = 0.f;
    for (int e = lane; e < E; e += 32) {
      const float ex = expf(sc[e] - m);
      sc[e] = ex;
      z += ex;
    }
    for (int off = 16; off; off >>= 1) z += __shfl_xor_sync(0xffffffffu, z, off);
    for (int e = lane; e < E; e += 32) sc[e] = sc[e] / z;
    __syncwarp();
    if (p.group_limited) {
      const int groups = static_cast<int>(p.n_group);
      for (int g = lane; g < groups; g += 32) {
        float b = -INFINITY;
        for (int e = g * G; e < (g + 1) * G; ++e) b = fmaxf(b, sc[e]);
        gb[g] = b;
      }
      __syncwarp();
      // group g is kept when fewer than topk_group groups rank above it
      for (int e = lane; e < E; e += 32) {
        const int g = e / G;
        int above = 0;
        for (int h = 0; h < groups; ++h) above += gb[h] > gb[g] || (gb[h] == gb[g] && h < g);
        if (above >= p.topk_group) sc[e] = 0.f;
      }
      __syncwarp();
    }
    finish_row(p, n, choose_top_k(p, n, sc, sc, lane), lane);
  }
}

template <typename T, typename R>
cudaError_t launch_typed(const MoeRouteParams& p, cudaStream_t stream) {
  const int kc = static_cast<int>(moe_route_chunk_rows(p.n, p.h, p.e, p.router_dtype));
  const int chunks = static_cast<int>(moe_route_chunks(p.n, p.h, p.e, p.router_dtype));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(moe_route_partials_kernel<T, R>,
                                                       dim3(static_cast<unsigned>(chunks)), dim3(kThreads),
                                                       partials_smem_floats(p.n, kc) * sizeof(float), true, stream,
                                                       p, kc));
  return launch_programmatic(moe_route_select_kernel, dim3(1), dim3(kThreads),
                             select_smem_floats(p.e) * sizeof(float), true, stream, p, chunks);
}

}  // namespace

cudaError_t launch_moe_route(const MoeRouteParams& p, cudaStream_t stream) {
  if (!moe_route_check(p).empty() || !moe_route_cuda_check(p).empty()) return cudaErrorInvalidValue;
  return dispatch_half(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return dispatch_float(p.router_dtype, [&](auto r) {
      using R = typename decltype(r)::type;
      return launch_typed<T, R>(p, stream);
    });
  });
}

}  // namespace jax_cluster
