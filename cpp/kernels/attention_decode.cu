// Fused decode attention block (ClusterFusion Alg. 3, SplitToken dataflow).
//
// One cluster of N blocks per (batch row b, KV head g, chunk of <= 8 query
// heads of that group): the KV of a group is read once for all its heads.
//   1. every block normalises x[b] into shared memory (fp32);
//   2. block r computes its share of the group's Q|K|V columns (GEMV, 16-byte
//      weight loads, 16 in flight per thread); ClusterGather gives every block
//      all of them;
//   3. RoPE on q and k at position lengths[b]; block 0 of chunk 0 writes the
//      new k, v into the caches;
//   4. block r attends over its slice of the tokens (online softmax in the
//      exp2 domain, q pre-scaled by scale*log2(e)); ClusterReduce(max) and
//      ClusterReduce(sum) combine (m, l, o) across the cluster, every block
//      ending with the normalised attention output of all its heads;
//   5. block r multiplies it by its slice of W_o's columns and writes an fp32
//      partial; a second small kernel sums the partials of all clusters of a
//      row in a fixed order (+ bias, + residual). No floating-point atomics:
//      results are bitwise reproducible.
// Each phase's first 32 KB (QKV rows, this block's K/V tokens, its W_o slice) is
// prefetched into L2 while the previous phase finishes, so no phase starts with an
// empty memory pipeline.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "jax_cluster/cluster_collectives.cuh"
#include "jax_cluster/ptx.cuh"
#include "kernels/attention_decode_launch.h"
#include "kernels/launch.cuh"

namespace jax_cluster {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxH = kAttnMaxHeadsPerCluster;
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory carve-up, computed identically on host and device.
struct Layout {
  int hpc, dh, n;
  int qkv_vecs;      // 8-column vectors of the group's Q|K|V columns
  int vecs_per_blk;  // their share per block (ceil)
  int64_t h_off, qkv_off, red_off, warp_off, max_off, max_recv_off, sum_off, sum_recv_off, bytes;
  int sum_vecs;  // 16-byte vectors of the (o, l) all-reduce

  __host__ __device__ Layout(int hidden, int hpc_, int dh_, int n_) : hpc(hpc_), dh(dh_), n(n_) {
    int rounds = 0;
    while ((1 << rounds) < n) ++rounds;
    qkv_vecs = (hpc + 2) * dh / 8;
    vecs_per_blk = (qkv_vecs + n - 1) / n;
    sum_vecs = (hpc * dh + kMaxH) / 4;
    int64_t off = 0;
    auto take = [&](int64_t bytes) {
      int64_t at = off;
      off += (bytes + 127) / 128 * 128;
      return at;
    };
    h_off = take(4LL * hidden);
    qkv_off = take(32LL * vecs_per_blk * n);  // gathered Q|K|V, fp32, natural column order
    red_off = take(4LL * kThreads * 8);       // GEMV partial sums across row groups
    warp_off = take(4LL * kWarps * kMaxH * (dh + 2));
    max_off = take(4LL * kMaxH);
    max_recv_off = take(4LL * kMaxH * rounds);
    sum_off = take(16LL * sum_vecs);
    sum_recv_off = take(16LL * sum_vecs * rounds);
    bytes = off;
  }
};

struct Ctx {  // per-cluster coordinates
  int64_t b, g, chunk;
  int rank;
  int len;
};

// This block's cluster -> (b, g, chunk), the batch row fastest: the clusters resident
// at one time then share a KV group's weight columns (read from HBM once, from L2 by
// the other rows) instead of each bringing its own.
__device__ __forceinline__ Ctx cluster_ctx(const AttentionDecodeParams& p) {
  const int64_t cluster = blockIdx.x / p.cluster_size, rest = cluster / p.batch;
  Ctx c;
  c.rank = static_cast<int>(ptx::cluster_rank());
  c.b = cluster % p.batch;
  c.chunk = rest % p.head_chunks();
  c.g = rest / p.head_chunks();
  c.len = p.lengths[c.b];
  return c;
}

// This block's share of the output projection: W_o column vectors [first, first + count)
// of its cluster's fp32 partial row.
struct OutputSlice {
  float* row;
  int first, count;
};

__device__ __forceinline__ OutputSlice output_slice(const AttentionDecodeParams& p, const Ctx& c) {
  const int vecs = static_cast<int>(p.hidden / 8);
  const int per_block = (vecs + p.cluster_size - 1) / p.cluster_size;
  const int first = c.rank * per_block;
  return {p.partial + ((c.b * p.num_kv_heads + c.g) * p.head_chunks() + c.chunk) * p.hidden, first,
          max(0, min(per_block, vecs - first))};
}

// A length outside [0, S_max) makes the row's output NaN (loud, never silently wrong); the
// whole cluster agrees, as it serves one row.
__device__ __forceinline__ bool length_out_of_range(const AttentionDecodeParams& p, const Ctx& c,
                                                    const OutputSlice& out) {
  if (c.len >= 0 && c.len < p.max_seq) return false;
  for (int e = threadIdx.x; e < out.count * 8; e += kThreads) out.row[out.first * 8 + e] = NAN;
  return true;
}

// out[jl*8 + i] = sum_r vec[r] * W[(row0 + r) * ld + col_of(j0 + jl) + i] for this
// block's `ncv` column vectors. Threads split rows into groups; partial sums
// meet in shared memory in a fixed order.
template <typename T, typename ColOf, typename Emit>
__device__ void block_gemv(const float* vec, int rows, const T* W, int64_t ld, int ncv,
                           ColOf col_of, float* red, Emit emit) {
  for (int j0 = 0; j0 < ncv; j0 += kThreads) {
    const int cv = min(kThreads, ncv - j0);
    const int groups = kThreads / cv;
    const int jl = threadIdx.x % cv, rg = threadIdx.x / cv;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (rg < groups) {
      const T* wcol = W + col_of(j0 + jl);
      int r = rg;
      constexpr int U = 16;  // 16-byte loads in flight per thread: 64 KB per block
      for (; r + (U - 1) * groups < rows; r += U * groups) {
        uint4 w[U];
#pragma unroll
        for (int u = 0; u < U; ++u) w[u] = ptx::ldg_stream(wcol + (r + u * groups) * ld);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float f[8];
          unpack<T>(w[u], f);
          const float s = vec[r + u * groups];
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] = fmaf(s, f[i], acc[i]);
        }
      }
      for (; r < rows; r += groups) {
        float f[8];
        unpack<T>(ptx::ldg_stream(wcol + r * ld), f);
        const float s = vec[r];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(s, f[i], acc[i]);
      }
    }
    __syncthreads();  // `red` free (previous chunk consumed)
    if (rg < groups) {
#pragma unroll
      for (int i = 0; i < 8; ++i) red[(rg * cv + jl) * 8 + i] = acc[i];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < cv * 8; e += kThreads) {
      float s = 0.f;
      for (int q = 0; q < groups; ++q) s += red[q * cv * 8 + e];
      emit(j0 + e / 8, e % 8, s);
    }
  }
  __syncthreads();
}

template <typename T>
__device__ void normalize_input(const AttentionDecodeParams& p, int64_t b, float* h) {
  __shared__ float stats[2 * kWarps];
  const T* x = static_cast<const T*>(p.x) + b * p.hidden;
  float sum = 0.f, sq = 0.f;
  for (int64_t i = threadIdx.x; i < p.hidden; i += kThreads) {
    const float v = to_float(x[i]);
    h[i] = v;
    sum += v;
    sq += v * v;
  }
  if (p.norm == NormKind::kNone) {
    __syncthreads();
    return;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, off);
    sq += __shfl_xor_sync(0xffffffffu, sq, off);
  }
  if ((threadIdx.x & 31) == 0) {
    stats[threadIdx.x / 32] = sum;
    stats[kWarps + threadIdx.x / 32] = sq;
  }
  __syncthreads();
  float tsum = 0.f, tsq = 0.f;
  for (int w = 0; w < kWarps; ++w) {
    tsum += stats[w];
    tsq += stats[kWarps + w];
  }
  const float inv_d = 1.f / static_cast<float>(p.hidden);
  const T* wn = static_cast<const T*>(p.norm_w);
  if (p.norm == NormKind::kRms) {
    const float r = rsqrtf(tsq * inv_d + p.eps);
    for (int64_t i = threadIdx.x; i < p.hidden; i += kThreads) h[i] = h[i] * r * to_float(wn[i]);
  } else {
    const float mean = tsum * inv_d;
    const float var = fmaxf(tsq * inv_d - mean * mean, 0.f);
    const float r = rsqrtf(var + p.eps);
    const T* bn = static_cast<const T*>(p.norm_b);
    for (int64_t i = threadIdx.x; i < p.hidden; i += kThreads) {
      h[i] = (h[i] - mean) * r * to_float(wn[i]) + to_float(bn[i]);
    }
  }
  __syncthreads();
}

constexpr uint32_t kPrefetchBytes = 32 * 1024;  // per block, per stream, ahead of a phase

// The first kPrefetchBytes of `rows` row segments of `seg_bytes` each, `ld` elements
// apart, into L2: one bulk prefetch per row, one row per thread.
template <typename T>
__device__ void prefetch_rows(const T* first, int64_t ld, int rows, int64_t seg_bytes) {
  if (seg_bytes <= 0) return;
  const int64_t fit = static_cast<int64_t>(kPrefetchBytes) / seg_bytes;
  const int n = static_cast<int>(fit < 1 ? 1 : fit < rows ? fit : rows);
  for (int r = threadIdx.x; r < n; r += kThreads) {
    ptx::prefetch_l2(first + r * ld, static_cast<uint32_t>(seg_bytes));
  }
}

// Global column of the group's local Q|K|V column c.
__device__ __forceinline__ int64_t qkv_column(const AttentionDecodeParams& p, const Ctx& c,
                                              int hpc, int64_t col) {
  const int64_t dh = p.head_dim;
  if (col < hpc * dh) return (c.g * p.group() + c.chunk * hpc) * dh + col;
  if (col < (hpc + 1) * dh) return p.num_q_heads * dh + c.g * dh + (col - hpc * dh);
  return (p.num_q_heads + p.num_kv_heads) * dh + c.g * dh + (col - (hpc + 1) * dh);
}

__device__ void apply_rope(const AttentionDecodeParams& p, float* qkv, int hpc, int pos) {
  const int dh = static_cast<int>(p.head_dim), half = static_cast<int>(p.rotary_dim / 2);
  for (int e = threadIdx.x; e < (hpc + 1) * half; e += kThreads) {
    const int head = e / half, i = e % half;  // heads 0..hpc-1 = q, hpc = k
    float* v = qkv + head * dh;
    float s, c;
    sincosf(static_cast<float>(pos) * p.inv_freq[i], &s, &c);
    const int i1 = p.rope_layout == RopeLayout::kHalf ? i : 2 * i;
    const int i2 = p.rope_layout == RopeLayout::kHalf ? i + half : 2 * i + 1;
    const float x1 = v[i1], x2 = v[i2];
    v[i1] = x1 * c - x2 * s;
    v[i2] = x2 * c + x1 * s;
  }
  __syncthreads();
}

// This block's `my_vecs` column vectors of the group's Q|K|V (from `first_vec`, + bias)
// into qkv; the rest of its `seg_vecs`-vector segment is zero padding for the gather.
template <typename T>
__device__ void project_qkv_slice(const AttentionDecodeParams& p, const Ctx& c, int hpc,
                                  const float* h, float* red, float* qkv, int first_vec,
                                  int my_vecs, int seg_vecs) {
  float* my_seg = qkv + static_cast<int64_t>(first_vec) * 8;
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const int64_t ld = (p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim;
  for (int e = threadIdx.x; e < seg_vecs * 8; e += kThreads) my_seg[e] = 0.f;
  __syncthreads();
  block_gemv<T>(
      h, static_cast<int>(p.hidden), static_cast<const T*>(p.w_qkv), ld, my_vecs,
      [&](int j) { return qkv_column(p, c, hpc, static_cast<int64_t>(first_vec + j) * 8); }, red,
      [&](int j, int i, float v) {
        if (p.has_qkv_bias) {
          v += to_float(bias[qkv_column(p, c, hpc, static_cast<int64_t>(first_vec + j) * 8 + i)]);
        }
        my_seg[j * 8 + i] = v;
      });
}

// RoPE at position `pos`, then the new k, v rounded to the cache dtype (what attention
// reads back for the other tokens). Callers synchronise before reading k, v.
template <typename T>
__device__ void rope_and_round_kv(const AttentionDecodeParams& p, float* qkv, int hpc, int pos) {
  apply_rope(p, qkv, hpc, pos);
  const int dh = static_cast<int>(p.head_dim);
  for (int e = threadIdx.x; e < 2 * dh; e += kThreads) {
    float& v = qkv[hpc * dh + e];
    v = to_float(from_float<T>(v));
  }
}

// The new token's k, v into the caches at lengths[b]: one block of the KV head's first
// cluster writes them.
template <typename T>
__device__ void write_new_kv(const AttentionDecodeParams& p, const Ctx& c, const float* qkv,
                             int hpc, int64_t kv_row0) {
  if (c.chunk != 0 || c.rank != 0) return;
  const int64_t dh = p.head_dim, row = (kv_row0 + c.len) * dh;
  for (int e = threadIdx.x; e < dh; e += kThreads) {
    static_cast<T*>(p.k_cache)[row + e] = from_float<T>(qkv[hpc * dh + e]);
    static_cast<T*>(p.v_cache)[row + e] = from_float<T>(qkv[(hpc + 1) * dh + e]);
  }
}

// Blocks per SM the kernel is built for: 2 where ptxas fits it in 128 registers without
// spills, else 1. Two let clusters of 8 and 16 find enough SMs: at one block per SM an
// H100 keeps only 7 clusters of 16 resident (ncu: Max Active Clusters), and Llama-3-8B's
// 8 KV heads then ran in two waves.
template <int DH, int MH>
constexpr int kMinBlocks = MH <= 4 && DH % 64 == 0 ? 2 : 1;
// Token steps per warp in flight in attention: as many as the registers allow.
template <int DH, int MH>
constexpr int kTokenSteps = MH <= 2 ? 8 : MH == 4 && kMinBlocks<DH, MH> == 2 ? 2 : 4;

// Online-softmax state of one thread: MH heads x its 8 dims of the head.
template <int MH>
struct SoftmaxState {
  float m[MH], l[MH], o[MH][8];
  __device__ void init() {
#pragma unroll
    for (int h = 0; h < MH; ++h) {
      m[h] = -INFINITY;
      l[h] = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) o[h][i] = 0.f;
    }
  }
  // Merges another state (same dims) into this one.
  __device__ void merge(const float (&m2)[MH], const float (&l2)[MH],
                        const float (&o2)[MH][8]) {
#pragma unroll
    for (int h = 0; h < MH; ++h) {
      const float mn = fmaxf(m[h], m2[h]);
      const float a = mn == -INFINITY ? 0.f : exp2f(m[h] - mn);
      const float b = mn == -INFINITY ? 0.f : exp2f(m2[h] - mn);
      m[h] = mn;
      l[h] = l[h] * a + l2[h] * b;
#pragma unroll
      for (int i = 0; i < 8; ++i) o[h][i] = o[h][i] * a + o2[h][i] * b;
    }
  }
};

// Attention of the block's queries over cached tokens [t0, t1).
template <typename T, int DH, int MH>
__device__ void attend_cached(const AttentionDecodeParams& p, const Ctx& c, int hpc,
                              const float* qkv, int t0, int t1, float* warp_states) {
  constexpr int NV = DH / 8;                   // 16-byte vectors per row
  constexpr int LPT = NV <= 8 ? 8 : 16;        // lanes per token (power of two)
  constexpr int TPW = 32 / LPT;                // tokens per warp step
  constexpr int U = kTokenSteps<DH, MH>;       // token steps in flight
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int dv = lane % LPT, slot = lane / LPT;
  const bool active = dv < NV;

  float q[MH][8];
#pragma unroll
  for (int h = 0; h < MH; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      q[h][i] = (h < hpc && active) ? qkv[h * DH + dv * 8 + i] * p.scale * kLog2e : 0.f;
    }
  }
  const int64_t row0 = (c.b * p.num_kv_heads + c.g) * p.max_seq;
  const T* K = static_cast<const T*>(p.k_cache) + row0 * DH + dv * 8;
  const T* V = static_cast<const T*>(p.v_cache) + row0 * DH + dv * 8;

  SoftmaxState<MH> st;
  st.init();
  for (int first = t0 + warp * TPW * U; first < t1; first += kWarps * TPW * U) {
    uint4 kr[U], vr[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = first + u * TPW + slot;
      ok[u] = t < t1;
      if (ok[u] && active) {
        kr[u] = ptx::ldg_stream(K + static_cast<int64_t>(t) * DH);
        vr[u] = ptx::ldg_stream(V + static_cast<int64_t>(t) * DH);
      } else {
        kr[u] = make_uint4(0, 0, 0, 0);
        vr[u] = make_uint4(0, 0, 0, 0);
      }
    }
    float s[U][MH];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      unpack<T>(kr[u], kf);
#pragma unroll
      for (int h = 0; h < MH; ++h) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) d = fmaf(q[h][i], kf[i], d);
#pragma unroll
        for (int off = LPT / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
        s[u][h] = ok[u] ? d : -INFINITY;
      }
    }
#pragma unroll
    for (int h = 0; h < MH; ++h) {
      if (h >= hpc) break;
      float mx = st.m[h];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u][h]);
      if (mx == -INFINITY) continue;
      const float a = exp2f(st.m[h] - mx);
      st.m[h] = mx;
      st.l[h] *= a;
#pragma unroll
      for (int i = 0; i < 8; ++i) st.o[h][i] *= a;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float pr = exp2f(s[u][h] - mx);
        st.l[h] += pr;
        float vf[8];
        unpack<T>(vr[u], vf);
#pragma unroll
        for (int i = 0; i < 8; ++i) st.o[h][i] = fmaf(pr, vf[i], st.o[h][i]);
      }
    }
  }
  // Merge the token slots of the warp (lanes LPT apart hold the same dims).
#pragma unroll
  for (int off = LPT; off < 32; off <<= 1) {
    float m2[MH], l2[MH], o2[MH][8];
#pragma unroll
    for (int h = 0; h < MH; ++h) {
      m2[h] = __shfl_xor_sync(0xffffffffu, st.m[h], off);
      l2[h] = __shfl_xor_sync(0xffffffffu, st.l[h], off);
#pragma unroll
      for (int i = 0; i < 8; ++i) o2[h][i] = __shfl_xor_sync(0xffffffffu, st.o[h][i], off);
    }
    st.merge(m2, l2, o2);
  }
  // Warp state -> shared: [warp][head][DH + 2] = (o..., m, l).
  if (slot == 0) {
#pragma unroll
    for (int h = 0; h < MH; ++h) {
      if (h >= hpc) break;
      float* ws = warp_states + (warp * kMaxH + h) * (DH + 2);
      if (active) {
#pragma unroll
        for (int i = 0; i < 8; ++i) ws[dv * 8 + i] = st.o[h][i];
      }
      if (lane == 0) {
        ws[DH] = st.m[h];
        ws[DH + 1] = st.l[h];
      }
    }
  }
  __syncthreads();
}

// Blocks per SM: kMinBlocks (above).
template <typename T, int DH, int MH>
__global__ void __launch_bounds__(kThreads, kMinBlocks<DH, MH>)
    attention_decode_kernel(const AttentionDecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ ClusterCollectiveBarriers gather_bars, max_bars, sum_bars;
  const int hpc = static_cast<int>(p.heads_per_cluster());
  const int n = p.cluster_size;
  const Layout L(static_cast<int>(p.hidden), hpc, DH, n);
  float* h = reinterpret_cast<float*>(smem + L.h_off);
  float* qkv = reinterpret_cast<float*>(smem + L.qkv_off);
  float* red = reinterpret_cast<float*>(smem + L.red_off);
  float* warp_states = reinterpret_cast<float*>(smem + L.warp_off);
  float* mx = reinterpret_cast<float*>(smem + L.max_off);
  float* sums = reinterpret_cast<float*>(smem + L.sum_off);

  const Ctx c = cluster_ctx(p);

  ClusterGather<float> gather(&gather_bars, reinterpret_cast<uint4*>(qkv), 2 * L.vecs_per_blk);
  ClusterReduce<float, ReduceOp::kMax> reduce_max(
      &max_bars, reinterpret_cast<uint4*>(smem + L.max_recv_off), kMaxH / 4);
  ClusterReduce<float, ReduceOp::kSum> reduce_sum(
      &sum_bars, reinterpret_cast<uint4*>(smem + L.sum_recv_off), L.sum_vecs);
  gather.init();
  reduce_max.init();
  reduce_sum.init();
  ptx::cluster_arrive();  // barrier init visible to peers; overlap the wait with the norm

  const OutputSlice out = output_slice(p, c);
  float* partial_row = out.row;
  const int o_first = out.first, o_count = out.count;
  if (length_out_of_range(p, c, out)) {
    ptx::cluster_wait();
    return;
  }
  // This block's share of each phase: QKV column vectors, tokens, W_o columns.
  const int first_vec = c.rank * L.vecs_per_blk;
  const int my_vecs = max(0, min(L.vecs_per_blk, L.qkv_vecs - first_vec));
  const int total = c.len + 1;
  const int per_block = (total + n - 1) / n;
  const int t0 = min(total, c.rank * per_block), t1 = min(total, t0 + per_block);
  const T* wqkv = static_cast<const T*>(p.w_qkv);
  const int64_t qkv_ld = (p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim;
  const T* wo = static_cast<const T*>(p.w_o) + (c.g * p.group() + c.chunk * hpc) * DH * p.hidden;

  // Each phase's first bytes are requested ahead (L2 prefetch) so no phase starts with an
  // empty memory pipeline: here the QKV rows (per contiguous run: Q, K or V columns).
  for (int v = first_vec, end = first_vec + my_vecs; v < end;) {
    const int bound = v < hpc * DH / 8 ? hpc * DH / 8 : v < (hpc + 1) * DH / 8 ? (hpc + 1) * DH / 8
                                                                               : end;
    const int run_end = min(end, bound);
    prefetch_rows(wqkv + qkv_column(p, c, hpc, static_cast<int64_t>(v) * 8), qkv_ld,
                  static_cast<int>(p.hidden), static_cast<int64_t>(run_end - v) * 16);
    v = run_end;
  }
  normalize_input<T>(p, c.b, h);
  ptx::cluster_wait();

  // 2. QKV projection: this block's column vectors, then gather.
  project_qkv_slice<T>(p, c, hpc, h, red, qkv, first_vec, my_vecs, L.vecs_per_blk);
  const int64_t kv_row0 = (c.b * p.num_kv_heads + c.g) * p.max_seq;
  if (threadIdx.x < 2 && t0 < c.len) {  // this block's first cached K and V tokens
    const T* cache = static_cast<const T*>(threadIdx.x == 0 ? p.k_cache : p.v_cache);
    const int64_t bytes = static_cast<int64_t>(min(t1, c.len) - t0) * DH * sizeof(T);
    const int64_t ahead = bytes < kPrefetchBytes ? bytes : kPrefetchBytes;
    ptx::prefetch_l2(cache + (kv_row0 + t0) * DH, static_cast<uint32_t>(ahead));
  }
  gather();

  // 3. RoPE, the new k, v rounded to the cache dtype and written.
  rope_and_round_kv<T>(p, qkv, hpc, c.len);
  __syncthreads();
  write_new_kv<T>(p, c, qkv, hpc, kv_row0);

  // 4. Attention over this block's token slice; the new token comes from smem.
  attend_cached<T, DH, MH>(p, c, hpc, qkv, t0, min(t1, c.len), warp_states);
  prefetch_rows(wo + o_first * 8, p.hidden, hpc * DH, static_cast<int64_t>(o_count) * 16);

  // Combine the warps (fixed order), then the new token, per head.
  const float qscale = p.scale * kLog2e;
  for (int e = threadIdx.x; e < hpc * (DH + 1); e += kThreads) {
    const int head = e / (DH + 1), i = e % (DH + 1);  // i == DH: the l entry
    float m = -INFINITY;
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warp_states[(w * kMaxH + head) * (DH + 2) + DH]);
    float s_new = -INFINITY;
    if (t0 <= c.len && c.len < t1) {
      float d = 0.f;
      for (int k = 0; k < DH; ++k) d = fmaf(qkv[head * DH + k] * qscale, qkv[hpc * DH + k], d);
      s_new = d;
    }
    const float mm = fmaxf(m, s_new);
    float acc = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float* ws = warp_states + (w * kMaxH + head) * (DH + 2);
      const float wm = ws[DH];
      if (wm == -INFINITY) continue;
      acc += (i < DH ? ws[i] : ws[DH + 1]) * exp2f(wm - mm);
    }
    if (s_new != -INFINITY) {
      const float pr = exp2f(s_new - mm);
      acc += i < DH ? pr * qkv[(hpc + 1) * DH + i] : pr;
    }
    if (i < DH) {
      sums[head * DH + i] = acc;
    } else {
      sums[hpc * DH + head] = acc;
      mx[head] = mm;
    }
  }
  for (int e = threadIdx.x; e < kMaxH; e += kThreads) {
    if (e >= hpc) mx[e] = -INFINITY;
  }
  for (int e = hpc * DH + hpc + threadIdx.x; e < L.sum_vecs * 4; e += kThreads) sums[e] = 0.f;
  __syncthreads();
  __shared__ float local_max[kMaxH];
  if (threadIdx.x < kMaxH) local_max[threadIdx.x] = mx[threadIdx.x];
  reduce_max(reinterpret_cast<uint4*>(mx));  // starts with a block barrier
  for (int e = threadIdx.x; e < hpc * (DH + 1); e += kThreads) {
    const int head = e < hpc * DH ? e / DH : e - hpc * DH;
    const float scale = local_max[head] == -INFINITY ? 0.f : exp2f(local_max[head] - mx[head]);
    sums[e] *= scale;
  }
  reduce_sum(reinterpret_cast<uint4*>(sums));
  for (int e = threadIdx.x; e < hpc * DH; e += kThreads) sums[e] /= sums[hpc * DH + e / DH];
  __syncthreads();

  // 5. Output projection: this block's output columns of the group's W_o rows.
  block_gemv<T>(
      sums, hpc * DH, wo, p.hidden, o_count,
      [&](int j) { return static_cast<int64_t>(o_first + j) * 8; }, red,
      [&](int j, int i, float v) { partial_row[(o_first + j) * 8 + i] = v; });

  gather.finish();
}

// y[b, :] = sum over the row's clusters (fixed order) + bias + residual.
template <typename T>
__global__ void __launch_bounds__(256) attention_decode_combine_kernel(const AttentionDecodeParams p) {
  const int64_t b = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (col >= p.hidden) return;
  const int64_t parts = p.num_kv_heads * p.head_chunks();
  const float* src = p.partial + b * parts * p.hidden + col;
  float acc = 0.f;
  for (int64_t k = 0; k < parts; ++k) acc += src[k * p.hidden];
  if (p.has_o_bias) acc += to_float(static_cast<const T*>(p.o_bias)[col]);
  if (p.residual) acc += to_float(static_cast<const T*>(p.x)[b * p.hidden + col]);
  static_cast<T*>(p.y)[b * p.hidden + col] = from_float<T>(acc);
}

// The SplitHead kernel: a textual part of this file (same anonymous namespace, helpers).
#include "kernels/attention_decode_split_head.cuh"  // NOLINT(build/include)

// MH: register arrays sized for the heads a cluster serves (1, 2, 4 or 8).
template <typename T, int DH, int MH>
cudaError_t launch_typed(const AttentionDecodeParams& p, cudaStream_t stream) {
  if (p.dataflow == AttnDataflow::kSplitHead) {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR((launch_split_head_typed<T, DH, MH>(p, stream)));
    const dim3 grid(static_cast<unsigned>((p.hidden + 255) / 256), static_cast<unsigned>(p.batch));
    attention_decode_combine_kernel<T><<<grid, 256, 0, stream>>>(p);
    return cudaGetLastError();
  }
  const Layout L(static_cast<int>(p.hidden), static_cast<int>(p.heads_per_cluster()), DH,
                 p.cluster_size);
  const int64_t clusters = p.batch * p.num_kv_heads * p.head_chunks();
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_cluster(
      attention_decode_kernel<T, DH, MH>, dim3(static_cast<unsigned>(clusters * p.cluster_size)),
      dim3(kThreads), static_cast<size_t>(L.bytes), p.cluster_size, stream, p));
  const dim3 grid(static_cast<unsigned>((p.hidden + 255) / 256), static_cast<unsigned>(p.batch));
  attention_decode_combine_kernel<T><<<grid, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int DH>
cudaError_t launch_heads(const AttentionDecodeParams& p, cudaStream_t stream) {
  const int64_t hpc = p.heads_per_cluster();
  if (hpc == 1) return launch_typed<T, DH, 1>(p, stream);
  if (hpc == 2) return launch_typed<T, DH, 2>(p, stream);
  if (hpc <= 4) return launch_typed<T, DH, 4>(p, stream);
  return launch_typed<T, DH, 8>(p, stream);
}

template <typename T>
cudaError_t launch_dh(const AttentionDecodeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_heads<T, 64>(p, stream);
    case 80: return launch_heads<T, 80>(p, stream);
    case 96: return launch_heads<T, 96>(p, stream);
    case 128: return launch_heads<T, 128>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_attention_decode(const AttentionDecodeParams& p, cudaStream_t stream) {
  if (p.dtype == DType::kF16) return launch_dh<__half>(p, stream);
  if (p.dtype == DType::kBF16) return launch_dh<__nv_bfloat16>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace jax_cluster
