// The CUDA kernels of mla_decode's projections (projections.h has the dataflow).
//
// Both kernels are grids of clusters of kMlaClusterBlocks blocks; a cluster owns one head
// (or a column tile of the latent) and splits its GEMV's K rows between its blocks. A block's GEMV keeps
// `U` 16-byte weight loads per thread in flight (registers, read-only path) and sums its
// row groups through shared memory in group order; the cluster's blocks then read each
// other's sums over DSMEM in rank order, so all hold the same bits. Two cluster barriers
// frame that read (the second: nobody leaves or overwrites its sums while a peer reads).
// Weights never depend on the previous kernel: after griddepcontrol.wait (which guards x,
// o_lat, the residual and lengths) a block first loads its few input values (so that they
// do not queue behind the weights), then issues its GEMVs' first loads into registers and
// asks L2 for the rest of its slices; those stream while the inputs are staged.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "jax_cluster/arrival.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "ops/mla_decode/projections.h"

namespace jax_cluster {

// Per-phase timeline of the two kernels, for the probe only (benchmarks/probes/
// mla_projections_kernel.cu built with -DJAX_CLUSTER_MLA_TIMELINE=1): thread 0 of every
// block stamps the clock at each phase boundary (MlaMark) into a device array the probe
// reads back. Compiled out otherwise.
#ifndef JAX_CLUSTER_MLA_TIMELINE
#define JAX_CLUSTER_MLA_TIMELINE 0
#endif
inline constexpr int kMlaTimelineBlocks = 1024, kMlaTimelineMarks = 8;
enum MlaMark : int {
  kMarkStart = 0,
  kMarkWaited = 1,    // griddepcontrol.wait returned
  kMarkStaged = 2,    // input rows staged in fp32 (project: RMSNorm(x))
  kMarkGemv = 3,      // the block's K slice of its first GEMV summed in shared memory
  kMarkCluster = 4,   // the cluster's sums read over DSMEM
  kMarkSecond = 5,    // project: q rounded and rotated, or the latent's kv written;
                      // output: the W_o GEMV done
  kMarkArrived = 6,   // project: the absorption done; output: the head's partial written
  kMarkEnd = 7,       // the block's last instruction (a slice's last head: after y)
};
#if JAX_CLUSTER_MLA_TIMELINE
__device__ unsigned long long mla_timeline[2][kMlaTimelineBlocks][kMlaTimelineMarks];  // [kernel][block][mark]
#endif
__device__ __forceinline__ void mla_mark(int kernel, MlaMark m) {
#if JAX_CLUSTER_MLA_TIMELINE
  if (threadIdx.x == 0 && blockIdx.x < kMlaTimelineBlocks) mla_timeline[kernel][blockIdx.x][m] = ptx::globaltimer();
#else
  (void)kernel, (void)m;
#endif
}

// Row groups of a GEMV over w columns (8 per lane).
__host__ __device__ constexpr int mla_gemv_groups(int w) { return kMlaProjectThreads / (w / 8); }

// Shared memory of one block, in floats: the GEMV's row-group sums (reused by the
// absorption's per-vector partials), the cluster-visible sums, the combined vector, the
// staged input rows.
struct MlaSmem {
  int red, sums, full, stage;
  __host__ __device__ int total() const { return red + sums + full + stage; }
  __device__ void carve(float* base, float** r, float** s, float** f, float** st) const {
    *r = base;
    *s = *r + red;
    *f = *s + sums;
    *st = *f + full;
  }
};

// A thread's first U weight loads of mla_gemv (rows g, g + groups, ..): weights depend on
// nothing, so a block issues them before its inputs are staged and they stream meanwhile.
// They cover rows [0, mla_gemv_first_rows) of the block's slice.
template <typename T, int U>
struct MlaGemvFirst {
  uint4 wv[U];
  __device__ void issue(const T* W, int64_t ld, int w, int rows) {
    const int lanes = w / 8, groups = kMlaProjectThreads / lanes;
    const int g = threadIdx.x / lanes, l = threadIdx.x % lanes;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = g + u * groups;
      if (g < groups && kk < rows) wv[u] = ptx::ldg_stream(W + 8 * l + static_cast<int64_t>(kk) * ld);
    }
  }
};
template <int U>
__device__ __forceinline__ int mla_gemv_first_rows(int w) { return mla_gemv_groups(w) * U; }

// sums[b * w + c] = sum over rows k < rows of in[b * in_ld + k] * W[k * ld + c] (c < w, a
// multiple of 8; b < NB, rows past `batch` are zero in `in`), the first U rows per thread
// from `first` (issued by MlaGemvFirst::issue on the same W, ld, w, rows). All threads call it.
template <typename T, int NB, int U>
__device__ void mla_gemv(const T* __restrict__ W, int64_t ld, int w, int rows, const float* in, int in_ld,
                         float* red, float* sums, const MlaGemvFirst<T, U>& first) {
  const int lanes = w / 8, groups = kMlaProjectThreads / lanes;
  const int tid = threadIdx.x, g = tid / lanes, l = tid % lanes;
  float acc[NB][8];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[b][j] = 0.f;
  }
  if (g < groups) {
    auto consume = [&](const uint4 (&wv)[U], int k) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kk = k + u * groups;
        if (kk < rows) {
          float wf[8];
          unpack<T>(wv[u], wf);
#pragma unroll
          for (int b = 0; b < NB; ++b) {
            const float xin = in[b * in_ld + kk];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[b][j] = fmaf(xin, wf[j], acc[b][j]);
          }
        }
      }
    };
    consume(first.wv, g);
    const T* col = W + 8 * l;
    for (int k = g + groups * U; k < rows; k += groups * U) {
      uint4 wv[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kk = k + u * groups;
        if (kk < rows) wv[u] = ptx::ldg_stream(col + static_cast<int64_t>(kk) * ld);
      }
      consume(wv, k);
    }
#pragma unroll
    for (int b = 0; b < NB; ++b) {  // two 16-byte stores: conflict-free wavefronts
      float4* dst = reinterpret_cast<float4*>(red + (g * NB + b) * w + 8 * l);
      dst[0] = make_float4(acc[b][0], acc[b][1], acc[b][2], acc[b][3]);
      dst[1] = make_float4(acc[b][4], acc[b][5], acc[b][6], acc[b][7]);
    }
  }
  __syncthreads();
  for (int e = tid; e < NB * w; e += kMlaProjectThreads) {
    float s = 0.f;
    for (int r = 0; r < groups; ++r) s += red[r * NB * w + e];
    sums[e] = s;
  }
  __syncthreads();
}

// full[b * w + c] = the cluster's sums in rank order (launched with kMlaClusterBlocks per
// cluster), then every block's sums are free.
template <int NB>
__device__ void mla_cluster_sum(const float* sums, int w, float* full) {
  __syncthreads();
  ptx::cluster_sync();  // every rank's sums are written (release / acquire)
  const uint32_t base = ptx::smem_addr(sums);
  for (int e = threadIdx.x; e < NB * w; e += kMlaProjectThreads) {
    float v[kMlaClusterBlocks];  // all loads in flight before the first add
#pragma unroll
    for (int r = 0; r < kMlaClusterBlocks; ++r) v[r] = ptx::ld_cluster_f32(ptx::map_to_rank(base + 4u * e, r));
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < kMlaClusterBlocks; ++r) s += v[r];
    full[e] = s;
  }
  ptx::cluster_sync();  // no rank reuses or leaves its sums while a peer reads them
}

template <typename T>
__device__ __forceinline__ float round_t(float v) {
  return to_float(from_float<T>(v));
}

// Asks L2 for rows [from, rows) x w columns of W (one bulk prefetch per row).
template <typename T>
__device__ void mla_prefetch_rows(const T* W, int64_t ld, int w, int rows, int from = 0) {
  for (int k = from + threadIdx.x; k < rows; k += kMlaProjectThreads) {
    ptx::prefetch_l2(W + static_cast<int64_t>(k) * ld, static_cast<uint32_t>(w * sizeof(T)));
  }
}

__device__ __forceinline__ int mla_position(const int32_t* lengths, int b, int64_t capacity) {
  const int32_t len = lengths[b];
  return len >= 0 && len < capacity ? len : 0;
}

// cos, sin (times rope_factor) of pair i at position pos, as the jnp formulation computes them.
__device__ __forceinline__ void mla_rope_angle(int pos, float inv_freq, float factor, float* c, float* s) {
  const float angle = static_cast<float>(pos) * inv_freq;
  *c = cosf(angle) * factor;
  *s = sinf(angle) * factor;
}

// ----------------------------------------------------------------------------- mla_project
// Grid: (H + L) clusters along x; cluster u < H is head u, clusters H.. the latent's column
// tiles (mla_project_latent_tiles), as wide as a head's so no cluster streams more.
template <typename T, int NB>
__global__ void __launch_bounds__(kMlaProjectThreads, 2) mla_project_kernel(MlaProjectParams p, MlaSmem sm) {
  extern __shared__ float4 smem_f4[];
  float *red, *sums, *full, *stage;
  sm.carve(reinterpret_cast<float*>(smem_f4), &red, &sums, &full, &stage);
  const int rank = static_cast<int>(ptx::cluster_rank());
  const int C = static_cast<int>(ptx::cluster_num_blocks());
  const int64_t unit = blockIdx.x / C;
  const bool latent = unit >= p.num_heads;
  const int64_t tile = unit - p.num_heads, hc = p.head_cols(), E = p.latent_cols();
  const int64_t qc = p.num_heads * p.head_cols();
  const bool q_from_x = p.q_src == nullptr;
  mla_mark(0, kMarkStart);
  // This block's K rows of its GEMV and its weight slice.
  const int64_t K = latent || q_from_x ? p.hidden : p.q_in;
  const int64_t chunk = (K + C - 1) / C;
  const int64_t k0 = min(K, rank * chunk);
  const int rows = static_cast<int>(min(chunk, K - k0));  // 32-bit index math below: no 64-bit divisions
  const int w = static_cast<int>(latent ? min(hc, E - tile * hc) : hc);
  const int64_t ld = latent ? E : qc;
  const T* W = latent ? static_cast<const T*>(p.w_kv_a) + k0 * ld + tile * hc
                      : static_cast<const T*>(p.w_q) + k0 * ld + unit * hc;
  // A head's rank also absorbs rows [n0, n0 + nrows) of r through W_uk (after the GEMV).
  const int64_t nr = (p.rank + C - 1) / C, n0 = min(p.rank, rank * nr);
  const int nrows = static_cast<int>(min(nr, p.rank - n0));
  const int64_t ldb = p.num_heads * (p.nope + p.v_dim);
  const T* Wk = static_cast<const T*>(p.w_kv_b) + n0 * ldb + unit * (p.nope + p.v_dim);
  ptx::griddep_wait();  // x, q_src and lengths come from the previous kernels
  mla_mark(0, kMarkWaited);

  // The block's K rows of its input (x, or q_src with q LoRA) and of the norm weight, loaded
  // first: issued ahead of the weights, they do not queue behind them.
  const bool normed = latent || q_from_x;
  const T* src = static_cast<const T*>(normed ? p.x : p.q_src);
  const int64_t src_ld = normed ? p.hidden : p.q_in;
  constexpr int kIn = kMlaProjectMaxCols / kMlaProjectThreads;  // rows per thread held (normed: all)
  // All of them issued before the first is converted (converted as loaded, at 8 rows ptxas
  // left 27 of the 36 loads each waiting for the one before).
  T in_raw[NB][kIn], g_raw[kIn];
  const T zero = from_float<T>(0.f);
#pragma unroll
  for (int i = 0; i < kIn; ++i) {
    const int k = threadIdx.x + i * kMlaProjectThreads;
    g_raw[i] = normed && k < rows ? static_cast<const T*>(p.norm)[k0 + k] : zero;
#pragma unroll
    for (int b = 0; b < NB; ++b) in_raw[b][i] = b < p.batch && k < rows ? src[b * src_ld + k0 + k] : zero;
  }
  float in[NB][kIn], g[kIn];
#pragma unroll
  for (int i = 0; i < kIn; ++i) {
    g[i] = to_float(g_raw[i]);
#pragma unroll
    for (int b = 0; b < NB; ++b) in[b][i] = to_float(in_raw[b][i]);
  }
  // Then the weights: the GEMV's first loads into registers, L2 asked for the rest of its
  // slice and for this head's W_uk rows of the absorption.
  constexpr int kU = NB <= 2 ? 16 : NB == 4 ? 8 : 4;  // the GEMV's loads in flight per thread
  MlaGemvFirst<T, kU> first;
  first.issue(W, ld, w, rows);
  mla_prefetch_rows(W, ld, w, rows, mla_gemv_first_rows<kU>(w));
  if (!latent) mla_prefetch_rows(Wk, ldb, static_cast<int>(p.nope), nrows);

  // Stage the input rows of the chunk in fp32: h = RMSNorm(x) (rounded as jnp rounds), or q_src.
  const int in_ld = static_cast<int>(chunk);
  if (normed) {
    // Sum of squares of each row: the block's slice (per thread in K order, a shuffle tree
    // per warp, warps in order), then the cluster's slices in rank order over DSMEM. `full`
    // is free until mla_cluster_sum's first barrier, which every peer passes after its read.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kIn; ++i) ss = fmaf(in[b][i], in[b][i], ss);
      for (int off = 16; off; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (lane == 0) red[warp * NB + b] = ss;
    }
    __syncthreads();
    if (threadIdx.x < NB) {
      float ss = 0.f;
      for (int w8 = 0; w8 < kMlaProjectThreads / 32; ++w8) ss += red[w8 * NB + threadIdx.x];
      full[threadIdx.x] = ss;
    }
    ptx::cluster_sync();  // every rank's slice sums are written (release / acquire)
    if (threadIdx.x < NB) {
      const uint32_t addr = ptx::smem_addr(full + threadIdx.x);
      float part[kMlaClusterBlocks];
#pragma unroll
      for (int r = 0; r < kMlaClusterBlocks; ++r) part[r] = ptx::ld_cluster_f32(ptx::map_to_rank(addr, r));
      float ss = 0.f;
#pragma unroll
      for (int r = 0; r < kMlaClusterBlocks; ++r) ss += part[r];
      full[NB + threadIdx.x] = rsqrtf(ss / static_cast<float>(p.hidden) + p.eps);
    }
    __syncthreads();
    const float* rstd = full + NB;
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      const int k = threadIdx.x + i * kMlaProjectThreads;
      if (k >= rows) break;
#pragma unroll
      for (int b = 0; b < NB; ++b) stage[b * in_ld + k] = b < p.batch ? round_t<T>(g[i] * round_t<T>(in[b][i] * rstd[b])) : 0.f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      const int k = threadIdx.x + i * kMlaProjectThreads;
      if (k >= rows) break;
#pragma unroll
      for (int b = 0; b < NB; ++b) stage[b * in_ld + k] = in[b][i];
    }
    for (int b = 0; b < NB; ++b) {  // q_lora_rank past what the registers held
      for (int k = kIn * kMlaProjectThreads + threadIdx.x; k < rows; k += kMlaProjectThreads) {
        stage[b * in_ld + k] = b < p.batch ? to_float(src[b * src_ld + k0 + k]) : 0.f;
      }
    }
  }
  __syncthreads();
  mla_mark(0, kMarkStaged);
  mla_gemv<T, NB, kU>(W, ld, w, static_cast<int>(rows), stage, in_ld, red, sums, first);
  mla_mark(0, kMarkGemv);
  ptx::griddep_launch_dependents();  // the attention kernel may take the SMs this grid frees
  mla_cluster_sum<NB>(sums, w, full);
  mla_mark(0, kMarkCluster);

  const int64_t half = p.rope / 2;
  const float* inv_freq = p.inv_freq;
  if (latent) {
    if (rank != 0) return;
    // This tile's kv columns, rounded after their bias, to the workspace; the last tile to
    // arrive (a counter zeroed before the launch) finishes the row for all of them.
    const T* bias = static_cast<const T*>(p.kv_a_bias);
    for (int b = 0; b < p.batch; ++b) {
      for (int c = threadIdx.x; c < w; c += kMlaProjectThreads) {
        const int64_t col = tile * hc + c;
        __stcg(p.kv_raw + b * E + col, round_t<T>(full[b * w + c] + (bias != nullptr ? to_float(bias[col]) : 0.f)));
      }
    }
    mla_mark(0, kMarkSecond);
    if (!last_block_to_arrive(p.counters, static_cast<unsigned>(mla_project_latent_tiles(p)))) return;
    mla_mark(0, kMarkArrived);
    // new_latent = [RMSNorm(kv[:r]) | RoPE(kv[r:])], the whole block on each row: this tail is
    // on the critical path (the attention kernel waits for the grid), so a thread's values
    // are loaded at once instead of a warp walking the row one round trip per 32 columns.
    // Sum of squares: per thread over its columns, a shuffle tree per warp, warps in order.
    constexpr int kPer = (kMlaProjectMaxCols + kMlaProjectThreads - 1) / kMlaProjectThreads;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const T* lnorm = static_cast<const T*>(p.kv_a_norm);
    for (int b = 0; b < p.batch; ++b) {
      const float* kv = p.kv_raw + b * E;
      float v[kPer], g[kPer], ss = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int c = tid + j * kMlaProjectThreads;
        v[j] = c < p.rank ? __ldcg(kv + c) : 0.f;
        g[j] = c < p.rank ? to_float(lnorm[c]) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kPer; ++j) ss = fmaf(v[j], v[j], ss);
      for (int off = 16; off; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (lane == 0) red[warp] = ss;
      __syncthreads();
      ss = 0.f;
      for (int w8 = 0; w8 < kMlaProjectThreads / 32; ++w8) ss += red[w8];
      const float rstd = rsqrtf(ss / static_cast<float>(p.rank) + p.latent_eps);
      float* out = p.new_latent + b * E;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int c = tid + j * kMlaProjectThreads;
        if (c < p.rank) out[c] = round_t<T>(g[j] * round_t<T>(v[j] * rstd));
      }
      for (int i = tid; i < half; i += kMlaProjectThreads) {
        float cs, sn;
        mla_rope_angle(mla_position(p.lengths, b, p.capacity), inv_freq[i], p.rope_factor, &cs, &sn);
        const float a = __ldcg(kv + p.rank + 2 * i), bb = __ldcg(kv + p.rank + 2 * i + 1);
        out[p.rank + 2 * i] = round_t<T>(a * cs - bb * sn);
        out[p.rank + 2 * i + 1] = round_t<T>(a * sn + bb * cs);
      }
      __syncthreads();  // red is the next row's
    }
    mla_mark(0, kMarkEnd);
    return;
  }

  // A head: q rounded as jnp's dense rounds it; rank 0 rotates q_rope into q_full[..., r:].
  const int64_t h = unit;
  for (int e = threadIdx.x; e < NB * w; e += kMlaProjectThreads) full[e] = round_t<T>(full[e]);
  __syncthreads();
  if (rank == 0) {
    for (int b = 0; b < p.batch; ++b) {
      for (int i = threadIdx.x; i < half; i += kMlaProjectThreads) {
      float cs, sn;
      mla_rope_angle(mla_position(p.lengths, b, p.capacity), inv_freq[i], p.rope_factor, &cs, &sn);
      const float a = full[b * w + p.nope + 2 * i], bb = full[b * w + p.nope + 2 * i + 1];
      float* out = p.q_full + (b * p.num_heads + h) * E + p.rank;
      out[2 * i] = round_t<T>(a * cs - bb * sn);
      out[2 * i + 1] = round_t<T>(a * sn + bb * cs);
      }
    }
  }
  mla_mark(0, kMarkSecond);
  // Absorption of this rank's rows n of r: q_full[b, h, n] = q_nope . W_kv_b[n, h, :dn]. Items
  // (row, 8-column vector) spread over the threads, their loads issued together; per-item
  // partials through shared memory (reusing `red`), summed per row in vector order.
  const int vecs = static_cast<int>(p.nope / 8);
  const int items = nrows * vecs;
  constexpr int kBatchLoads = 4;
  for (int i0 = threadIdx.x; i0 < items; i0 += kBatchLoads * kMlaProjectThreads) {
    uint4 wv[kBatchLoads];
#pragma unroll
    for (int u = 0; u < kBatchLoads; ++u) {
      const int i = i0 + u * kMlaProjectThreads;
      if (i < items) wv[u] = ptx::ldg_stream(Wk + (i / vecs) * ldb + 8 * (i % vecs));
    }
#pragma unroll
    for (int u = 0; u < kBatchLoads; ++u) {
      const int i = i0 + u * kMlaProjectThreads;
      if (i < items) {
        float wf[8];
        unpack<T>(wv[u], wf);
        const int v = i % vecs;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          float s = 0.f;
#pragma unroll
          for (int j = 0; j < 8; ++j) s = fmaf(full[b * w + 8 * v + j], wf[j], s);
          red[b * items + i] = s;
        }
      }
    }
  }
  __syncthreads();
  for (int b = 0; b < p.batch; ++b) {
    for (int n = threadIdx.x; n < nrows; n += kMlaProjectThreads) {
      float s = 0.f;
      for (int v = 0; v < vecs; ++v) s += red[b * items + n * vecs + v];
      p.q_full[(b * p.num_heads + h) * E + n0 + n] = s;
    }
  }
  mla_mark(0, kMarkEnd);
}

// ----------------------------------------------------------------------------- mla_output
// Grid: H clusters along x; cluster h is head h. Its counters (mla_project's) are zero at launch.
template <typename T, int NB>
__global__ void __launch_bounds__(kMlaProjectThreads, 2) mla_output_kernel(MlaOutputParams p, MlaSmem sm) {
  extern __shared__ float4 smem_f4[];
  float *red, *sums, *full, *stage;
  sm.carve(reinterpret_cast<float*>(smem_f4), &red, &sums, &full, &stage);
  const int rank = static_cast<int>(ptx::cluster_rank());
  const int C = static_cast<int>(ptx::cluster_num_blocks());
  const int64_t h = blockIdx.x / C;
  const int dv = static_cast<int>(p.v_dim);
  mla_mark(1, kMarkStart);
  // o_h = o_lat[b, h] W_uv_h over this rank's chunk of the r rows.
  const int64_t chunk = (p.rank + C - 1) / C, k0 = min(p.rank, rank * chunk);
  const int rows = static_cast<int>(min(chunk, p.rank - k0));
  const int64_t ldb = p.num_heads * (p.nope + p.v_dim);
  const T* Wv = static_cast<const T*>(p.w_kv_b) + k0 * ldb + h * (p.nope + p.v_dim) + p.nope;
  // Then this rank's column slice of W_o's rows [h dv, (h + 1) dv).
  const int64_t slice = mla_output_slice_cols(p.hidden), c0 = min(p.hidden, rank * slice);
  const int wo = static_cast<int>(min(slice, p.hidden - c0));
  const T* Wo = static_cast<const T*>(p.w_o) + h * dv * p.hidden + c0;
  ptx::griddep_wait();  // o_lat and the residual come from the previous kernels
  mla_mark(1, kMarkWaited);
  // This block's rows of o_lat first (one per thread and row: r <= kMlaProjectMaxCols), so
  // that they do not queue behind the weights; then both GEMVs' first loads, which stream
  // while o_lat is staged, and L2 asked for the rest.
  static_assert(kMlaProjectMaxCols <= kMlaClusterBlocks * kMlaProjectThreads, "one o_lat row per thread");
  const int k = threadIdx.x;
  float ov[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    ov[b] = b < p.batch && k < rows ? to_float(static_cast<const T*>(p.o_lat)[(b * p.num_heads + h) * p.rank + k0 + k]) : 0.f;
  }
  constexpr int kUo = NB <= 4 ? 8 : 4;
  MlaGemvFirst<T, 4> first_v;
  MlaGemvFirst<T, kUo> first_o;
  first_v.issue(Wv, ldb, dv, rows);
  if (wo > 0) first_o.issue(Wo, p.hidden, wo, dv);
  mla_prefetch_rows(Wv, ldb, dv, rows, mla_gemv_first_rows<4>(dv));
  if (wo > 0) mla_prefetch_rows(Wo, p.hidden, wo, dv, mla_gemv_first_rows<kUo>(wo));
  const int in_ld = static_cast<int>(chunk);
  if (k < rows) {
#pragma unroll
    for (int b = 0; b < NB; ++b) stage[b * in_ld + k] = ov[b];
  }
  __syncthreads();
  mla_mark(1, kMarkStaged);
  mla_gemv<T, NB, 4>(Wv, ldb, dv, rows, stage, in_ld, red, sums, first_v);
  mla_mark(1, kMarkGemv);
  mla_cluster_sum<NB>(sums, dv, full);
  mla_mark(1, kMarkCluster);
  for (int e = threadIdx.x; e < NB * dv; e += kMlaProjectThreads) full[e] = round_t<T>(full[e]);
  __syncthreads();
  ptx::griddep_launch_dependents();
  if (wo <= 0) return;
  mla_gemv<T, NB, kUo>(Wo, p.hidden, wo, dv, full, dv, red, sums, first_o);
  mla_mark(1, kMarkSecond);

  // This head's partial of y's slice; the slice's last head sums them all in head order.
  float* part = p.partial;
  for (int b = 0; b < p.batch; ++b) {
    for (int c = threadIdx.x; c < wo; c += kMlaProjectThreads) {
      __stcg(part + (h * p.batch + b) * p.hidden + c0 + c, sums[b * wo + c]);
    }
  }
  const bool last = last_block_to_arrive(p.counters + kMlaOutputCounter + rank, static_cast<unsigned>(p.num_heads));
  mla_mark(1, kMarkArrived);
  if (!last) return;
  const T* bias = static_cast<const T*>(p.o_bias);
  const T* res = static_cast<const T*>(p.residual);
  T* y = static_cast<T*>(p.y);
  for (int e = threadIdx.x; e < p.batch * wo; e += kMlaProjectThreads) {
    const int b = e / wo;  // 32-bit
    const int64_t col = c0 + e % wo;
    // bias and residual asked for first; sixteen heads' loads in flight, summed in head order
    const float bv = bias != nullptr ? to_float(bias[col]) : 0.f;
    const float rv = res != nullptr ? to_float(res[b * p.hidden + col]) : 0.f;
    float s = 0.f;
    for (int64_t g0 = 0; g0 < p.num_heads; g0 += 16) {
      float v[16];
#pragma unroll
      for (int g = 0; g < 16; ++g) v[g] = g0 + g < p.num_heads ? __ldcg(part + ((g0 + g) * p.batch + b) * p.hidden + col) : 0.f;
#pragma unroll
      for (int g = 0; g < 16; ++g) s += v[g];
    }
    if (bias != nullptr) s += bv;
    float v = round_t<T>(s);
    if (res != nullptr) v = v + rv;
    y[b * p.hidden + col] = from_float<T>(v);
  }
  mla_mark(1, kMarkEnd);
}

}  // namespace jax_cluster
