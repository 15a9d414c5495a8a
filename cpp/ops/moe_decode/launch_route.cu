// The router kernels of moe_decode (route.h has the algorithm and its contract).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/launch.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "ops/moe_decode/launch.h"

namespace jax_cluster {
namespace {

constexpr int kThreads = kMoeRouteThreads;
constexpr int kWarps = kThreads / 32;
static_assert(kMoeRouteMaxRows <= kWarps, "the selection keeps row n's scores in warp n's row of shared memory");
// Partial logits the select kernel's threads load before they use the first: a few KB, so
// their time is L2 round trips, not bytes (the router's loads: RouterRead).
constexpr int kLoads = 16;

// How a partials block reads the router: V experts of one K row per load (a 16-byte vector
// where every K row of E elements starts 16-byte aligned, else V = 1), kLoads loads per
// batch, kRowGroup rows of h per pass over its chunk (the accumulators: kRowGroup x V).
template <int V>
struct RouterRead {
  static constexpr int kRowGroup = V == 1 ? 8 : 4;
  static constexpr int kLoads = V == 1 ? 16 : 8;
};

// Shared memory, in floats: a partials block's staged h chunk [N][kc], K-slice partials
// [subs][kRowGroup][cols x V] (subs x cols <= kThreads) and the norm weight's chunk [kc];
// the select block's per-warp scores [E] and group bests [E], then where several threads sum a score's chunks, their
// slice sums [slices][N * E] (at most kThreads), noaux_tc's score_bias [E] and the rows' raw
// weights [kWarps][E] (k <= E): at E = 512, 52 KB (launch_ex opts every kernel in to the
// device's maximum).
template <int V>
int64_t partials_smem_floats(int64_t n, int64_t kc) { return n * kc + RouterRead<V>::kRowGroup * V * kThreads + kc; }
inline int64_t select_smem_floats(int64_t e) { return 2 * kWarps * e + kThreads + e + kWarps * e; }

// (value, index) of the larger score, the lower index on ties; NaN never wins.
__device__ __forceinline__ void better(float v, int i, float* bv, int* bi) {
  if (v > *bv || (v == *bv && i < *bi)) {
    *bv = v;
    *bi = i;
  }
}

// With a norm: h[:, chunk] = RMSNorm(x)[:, chunk] staged in sx [N][kc] and written to
// p.normed. Every block reads the rows whole (16-byte vectors, all rows' loads in flight) for
// the sums of squares, and the same loads deliver its chunk, so x is read once. Sums: per
// thread in vector order, a shuffle tree per warp, warps in order; sg holds the norm weight's
// chunk (staged before the wait), red is scratch.
template <typename T>
__device__ void stage_normed_chunk(const MoeRouteParams& p, int k0, int rows, int kc, float* sx, const float* sg,
                                   float* red) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int N = static_cast<int>(p.n), H = static_cast<int>(p.h), V = H / 8;
  const T* x = static_cast<const T*>(p.x);
  float ss[kMoeRouteMaxRows];
#pragma unroll
  for (int n = 0; n < kMoeRouteMaxRows; ++n) ss[n] = 0.f;
  for (int v = tid; v < V; v += kThreads) {
    uint4 raw[kMoeRouteMaxRows];
#pragma unroll
    for (int n = 0; n < kMoeRouteMaxRows; ++n) {
      if (n < N) raw[n] = __ldcg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(n) * H) + v);
    }
#pragma unroll
    for (int n = 0; n < kMoeRouteMaxRows; ++n) {
      if (n >= N) break;
      float f[8];
      unpack<T>(raw[n], f);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        ss[n] = fmaf(f[j], f[j], ss[n]);
        const int kk = 8 * v + j - k0;
        if (kk >= 0 && kk < rows) sx[n * kc + kk] = f[j];
      }
    }
  }
#pragma unroll
  for (int n = 0; n < kMoeRouteMaxRows; ++n) {
    if (n >= N) break;
    for (int off = 16; off; off >>= 1) ss[n] += __shfl_xor_sync(0xffffffffu, ss[n], off);
    if (lane == 0) red[warp * kMoeRouteMaxRows + n] = ss[n];
  }
  __syncthreads();
  float* rstd = red + kWarps * kMoeRouteMaxRows;
  if (tid < N) {
    float t = 0.f;
    for (int w = 0; w < kWarps; ++w) t += red[w * kMoeRouteMaxRows + tid];
    rstd[tid] = rsqrtf(t / static_cast<float>(H) + p.norm_eps);
  }
  __syncthreads();
  T* out = static_cast<T*>(p.normed);
  for (int i = tid; i < N * rows; i += kThreads) {
    const int n = i / rows, kk = i - n * rows;
    const T v = from_float<T>(sg[kk] * to_float(from_float<T>(sx[n * kc + kk] * rstd[n])));
    sx[n * kc + kk] = to_float(v);
    out[static_cast<int64_t>(n) * H + k0 + kk] = v;
  }
}

// The first batch of a thread's router loads for its chunk (experts [e, e + V), K slice s),
// issued before the kernel's griddep_wait: the router depends on no earlier kernel.
template <typename R, int V>
struct RouterBatch {
  using Raw = std::conditional_t<V == 1, R, uint4>;
  static constexpr int kLoads = RouterRead<V>::kLoads;
  Raw w[kLoads];
  __device__ void load(const R* router, int E, int k0, int rows, int e, int kb, int subs) {
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int kk = kb + u * subs;
      if (kk < rows) {  // chunk_logits reads no more
        const R* at = router + static_cast<int64_t>(k0 + kk) * E + e;
        if constexpr (V == 1) {
          w[u] = *at;
        } else {
          w[u] = __ldg(reinterpret_cast<const uint4*>(at));
        }
      }
    }
  }
  __device__ void floats(int u, float (&f)[V]) const {
    if constexpr (V == 1) {
      f[0] = to_float(w[u]);
    } else {
      unpack<R>(w[u], f);
    }
  }
};

// How a block's threads split its chunk: `cols` vectors of V experts per pass (thread el),
// the K rows over `subs` slices (thread s).
template <int V>
struct ChunkSplit {
  int cols, subs, s, el;
  __device__ explicit ChunkSplit(int E) {
    cols = min(E / V, kThreads);  // V > 1 only where V divides E
    subs = kThreads / cols;
    s = threadIdx.x / cols;
    el = threadIdx.x - s * cols;
  }
  __device__ bool active(int e, int E) const { return s < subs && e < E; }
};

// Before the wait: the chunk's first router batch into registers, the rest of its rows
// (contiguous) asked of L2, the norm weight's chunk staged in sg.
template <typename T, typename R, int V>
__device__ void chunk_prologue(const MoeRouteParams& p, int k0, int rows, const ChunkSplit<V>& sp,
                               RouterBatch<R, V>* first, float* sg) {
  const int E = static_cast<int>(p.e);
  const R* router = static_cast<const R*>(p.router);
  if (sp.active(sp.el * V, E)) first->load(router, E, k0, rows, sp.el * V, sp.s, sp.subs);
  const int64_t chunk_bytes = static_cast<int64_t>(rows) * E * sizeof(R);
  const R* chunk_w = router + static_cast<int64_t>(k0) * E;
  if (threadIdx.x == 0 && chunk_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(chunk_w) % 16 == 0) {
    ptx::prefetch_l2(chunk_w, static_cast<uint32_t>(chunk_bytes));
  }
  const T* norm = static_cast<const T*>(p.norm);
  if (norm != nullptr) {
    for (int kk = threadIdx.x; kk < rows; kk += kThreads) sg[kk] = to_float(norm[k0 + kk]);
  }
}

// After the wait: h[:, chunk] in fp32 to sx [N][kc] (x's, or RMSNorm(x)'s written to p.normed too).
template <typename T>
__device__ void stage_chunk(const MoeRouteParams& p, int k0, int rows, int kc, float* sx, const float* sg,
                            float* red) {
  if (p.norm != nullptr) {
    stage_normed_chunk<T>(p, k0, rows, kc, sx, sg, red);
  } else {
    const int N = static_cast<int>(p.n), H = static_cast<int>(p.h);
    const T* x = static_cast<const T*>(p.x);
    for (int i = threadIdx.x; i < N * rows; i += kThreads) {
      const int n = i / rows, kk = i - n * rows;
      sx[n * kc + kk] = to_float(x[static_cast<int64_t>(n) * H + k0 + kk]);
    }
  }
  __syncthreads();
}

// The chunk's partial logits out[n * E + e] (fp32): column e's K rows split over the thread
// slices, the slices summed in order; the first batch from chunk_prologue. Ends with a
// barrier.
template <typename R, int V>
__device__ void chunk_logits(const MoeRouteParams& p, int k0, int rows, int kc, const ChunkSplit<V>& sp,
                             const RouterBatch<R, V>& first, const float* sx, float* red, float* out) {
  constexpr int RG = RouterRead<V>::kRowGroup, L = RouterRead<V>::kLoads;
  const int tid = threadIdx.x;
  const int N = static_cast<int>(p.n), E = static_cast<int>(p.e);
  const R* router = static_cast<const R*>(p.router);
  const int cols = sp.cols, subs = sp.subs, s = sp.s, el = sp.el, width = cols * V;
  for (int e0 = 0; e0 < E; e0 += width) {
    const int e = e0 + el * V;
    for (int n0 = 0; n0 < N; n0 += RG) {
      float acc[RG][V];
#pragma unroll
      for (int j = 0; j < RG; ++j)
#pragma unroll
        for (int v = 0; v < V; ++v) acc[j][v] = 0.f;
      if (sp.active(e, E)) {
        for (int kb = s; kb < rows; kb += subs * L) {
          RouterBatch<R, V> b;
          if (e0 == 0 && n0 == 0 && kb == s) {
            b = first;
          } else {
            b.load(router, E, k0, rows, e, kb, subs);
          }
#pragma unroll
          for (int u = 0; u < L; ++u) {
            const int kk = kb + u * subs;
            if (kk >= rows) break;
            float w[V];
            b.floats(u, w);
#pragma unroll
            for (int j = 0; j < RG; ++j) {
              if (n0 + j >= N) break;
              const float xv = sx[(n0 + j) * kc + kk];
#pragma unroll
              for (int v = 0; v < V; ++v) acc[j][v] = fmaf(xv, w[v], acc[j][v]);
            }
          }
        }
      }
      if (s < subs) {
#pragma unroll
        for (int j = 0; j < RG; ++j)
#pragma unroll
          for (int v = 0; v < V; ++v) red[(s * RG + j) * width + el * V + v] = acc[j][v];
      }
      __syncthreads();
      for (int i = tid; i < RG * width; i += kThreads) {
        const int j = i / width, l = i - j * width;
        if (n0 + j >= N || e0 + l >= E) continue;
        float v = 0.f;
        for (int t = 0; t < subs; ++t) v += red[(t * RG + j) * width + l];
        out[(n0 + j) * E + e0 + l] = v;
      }
      __syncthreads();
    }
  }
}

// Block c: the partial logits of K chunk c, [N][E] fp32, to the workspace. At most 64
// blocks: no occupancy to keep, so the registers are not capped (the 16-byte form's
// accumulators and batch spilled at 128).
template <typename T, typename R, int V>
__global__ void __launch_bounds__(kThreads, 1) moe_route_partials_kernel(const MoeRouteParams p, int kc) {
  extern __shared__ __align__(16) float smem[];
  const int N = static_cast<int>(p.n), E = static_cast<int>(p.e), H = static_cast<int>(p.h);
  const int c = blockIdx.x, k0 = c * kc, rows = min(kc, H - k0);
  float* sx = smem;
  float* red = smem + N * kc;
  float* sg = red + RouterRead<V>::kRowGroup * V * kThreads;
  const ChunkSplit<V> sp(E);
  RouterBatch<R, V> first;
  chunk_prologue<T, R, V>(p, k0, rows, sp, &first, sg);
  ptx::griddep_wait();  // x is the previous kernel's
  stage_chunk<T>(p, k0, rows, kc, sx, sg, red);
  chunk_logits<R, V>(p, k0, rows, kc, sp, first, sx, red, static_cast<float*>(p.workspace) + static_cast<int64_t>(c) * N * E);
  ptx::griddep_launch_dependents();  // the select kernel may launch; it waits for every chunk
}

// Row n's top_k of the warp's choices ch[E] ((value, index) argmax rounds, a chosen entry
// becomes NaN): ids to row n's output, the scores sc[id] to raw[k] (the warp's shared memory);
// returns the scores' sum (the same on every lane, in rank order).
__device__ float choose_top_k(const MoeRouteParams& p, int n, const float* sc, float* ch, float* raw, int lane) {
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
      raw[r] = w;
    }
    sum += w;
    __syncwarp();
  }
  return sum;
}

// Row n's weights from choose_top_k's raw ones (shared memory: no global round trip on the
// router's path), rescaled by the lanes that own them: V2 renormalises (norm_topk_prob,
// top_k > 1) or scales; V3 renormalises (norm_topk_prob), then scales.
__device__ void finish_row(const MoeRouteParams& p, int n, float sum, const float* raw, int lane) {
  const int K = static_cast<int>(p.k);
  const bool norm = p.norm_topk_prob && (p.noaux_tc || K > 1);
  const float scale = p.noaux_tc || !norm ? p.scaling : 1.f;
  __syncwarp();  // lane 0's raw weights are visible
  for (int r = lane; r < K; r += 32) {
    p.weights[static_cast<int64_t>(n) * K + r] = (norm ? raw[r] / (sum + 1e-20f) : raw[r]) * scale;
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

// The selection, a warp per row, from the logits: sums [slices][N * E] (a pair's logit is its
// slices' sum in slice order; with one slice, sums may be smem itself: row n is then warp
// n's scores already). smem: the select layout (select_smem_floats), noaux_tc's score_bias
// staged at its place. Every thread of the block calls it.
__device__ void select_rows(const MoeRouteParams& p, float* smem, const float* sums, int slices) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int N = static_cast<int>(p.n), E = static_cast<int>(p.e), pairs = N * E;
  const float* bias = smem + 2 * kWarps * E + kThreads;
  float* sc = smem + warp * E;               // this warp's row: scores
  float* gb = smem + (kWarps + warp) * E;    // group bests (noaux_tc: then the choice)
  float* raw = smem + 2 * kWarps * E + kThreads + E + warp * E;  // the row's raw weights (k <= E)
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
      finish_row(p, n, choose_top_k(p, n, sc, gb, raw, lane), raw, lane);
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
    finish_row(p, n, choose_top_k(p, n, sc, sc, raw, lane), raw, lane);
  }
}

// One block: the logits (the chunks' partials summed) and the selection, a warp per row.
__global__ void __launch_bounds__(kThreads) moe_route_select_kernel(const MoeRouteParams p, int chunks) {
  extern __shared__ __align__(16) float smem[];
  const int tid = threadIdx.x;
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
  select_rows(p, smem, sums, slices);
}

template <typename T, typename R, int V>
cudaError_t launch_partials(const MoeRouteParams& p, int kc, int chunks, cudaStream_t stream) {
  return launch_programmatic(moe_route_partials_kernel<T, R, V>, dim3(static_cast<unsigned>(chunks)), dim3(kThreads),
                             partials_smem_floats<V>(p.n, kc) * sizeof(float), true, stream, p, kc);
}

template <typename T, typename R>
cudaError_t launch_typed(const MoeRouteParams& p, cudaStream_t stream) {
  const int kc = static_cast<int>(moe_route_chunk_rows(p.n, p.h, p.e, p.router_dtype));
  const int chunks = static_cast<int>(moe_route_chunks(p.n, p.h, p.e, p.router_dtype));
  // 16-byte router loads where every K row starts 16-byte aligned
  constexpr int kVec = Vec16<R>::kLanes;
  const bool vec = (p.e * static_cast<int64_t>(sizeof(R))) % 16 == 0 && reinterpret_cast<uintptr_t>(p.router) % 16 == 0;
  const cudaError_t partials = vec ? launch_partials<T, R, kVec>(p, kc, chunks, stream)
                                   : launch_partials<T, R, 1>(p, kc, chunks, stream);
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(partials);
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
