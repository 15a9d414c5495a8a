// Device pieces shared by attention_block's kernels (kernel_registers.cuh: SplitToken with
// the register pipeline; kernel_tma.cuh: SplitToken with the TMA ring; kernel_split_head.cuh:
// SplitHead) and by decode_attention's split kernels: the cluster's coordinates, the input
// norm, RoPE, the new token's cache write, the online-softmax state and its merges, the
// block GEMV, the combine kernel. They run on a ThreadGroup: the whole block, or the consumer
// warps of a warp-specialised block (threads [0, group.threads)).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "jax_cluster/ptx.cuh"
#include "jax_cluster/softmax.cuh"
#include "jax_cluster/thread_group.cuh"
#include "jax_cluster/vec.cuh"
#include "ops/attention_block/params.h"
#include "ops/attention_block/plan.h"

namespace jax_cluster {

constexpr int kMaxComputeWarps = 8;
constexpr float kLog2e = 1.4426950408889634f;

struct Ctx {  // per-cluster coordinates
  int64_t b, g, chunk;
  int rank;
  int len;
};

// This block's cluster -> (b, g, chunk), the batch row fastest: the clusters resident
// at one time then share a KV group's weight columns (read from HBM once, from L2 by
// the other rows) instead of each bringing its own. Reads no memory (len is not set).
__device__ __forceinline__ Ctx cluster_coords(const AttentionBlockParams& p) {
  const int64_t cluster = blockIdx.x / p.cluster_size, rest = cluster / p.batch;
  Ctx c;
  c.rank = static_cast<int>(ptx::cluster_rank());
  c.b = cluster % p.batch;
  c.chunk = rest % p.head_chunks();
  c.g = rest / p.head_chunks();
  c.len = 0;
  return c;
}

// The kernels are launched programmatically (PDL): they may start while the previous
// kernel of the stream still runs, and that kernel may be what wrote x, lengths or the
// caches, or what still reads the partials workspace. So every access to global memory
// except the weights' L2 prefetch comes after this wait (a no-op without PDL).
__device__ __forceinline__ int wait_for_inputs(const AttentionBlockParams& p, const Ctx& c) {
  ptx::griddep_wait();
  return p.lengths[c.b];
}

__device__ __forceinline__ Ctx cluster_ctx(const AttentionBlockParams& p) {
  Ctx c = cluster_coords(p);
  c.len = wait_for_inputs(p, c);
  return c;
}

// This block's share of the output projection: W_o column vectors [first, first + count)
// of its cluster's fp32 partial row, in whole kOutTileCols-column tiles (the unit of the
// streamed kernel's W_o boxes).
struct OutputSlice {
  float* row;
  int first, count;  // 8-column vectors
};

__device__ __forceinline__ OutputSlice output_slice(const AttentionBlockParams& p, const Ctx& c) {
  constexpr int kTileVecs = kOutTileCols / 8;
  const int tiles = static_cast<int>(p.hidden / kOutTileCols);
  const int per_block = (tiles + p.cluster_size - 1) / p.cluster_size;
  const int first = c.rank * per_block;
  return {p.partial + ((c.b * p.num_kv_heads + c.g) * p.head_chunks() + c.chunk) * p.hidden,
          first * kTileVecs, max(0, min(per_block, tiles - first)) * kTileVecs};
}

// A length outside [0, S_max) makes the row's output NaN (loud, never silently wrong); the
// whole cluster agrees, as it serves one row.
__device__ __forceinline__ bool length_out_of_range(const AttentionBlockParams& p, const Ctx& c) {
  return c.len < 0 || c.len >= p.max_seq;
}

__device__ __forceinline__ void write_nan_slice(const OutputSlice& out, ThreadGroup group) {
  for (int e = threadIdx.x; e < out.count * 8; e += group.threads) out.row[out.first * 8 + e] = NAN;
}

// Whole-block kernels, right after their cluster_arrive: a row out of range gets NaN outputs
// and the block completes that barrier phase (its peers wait for it). True: return now.
__device__ __forceinline__ bool finish_out_of_range_row(const AttentionBlockParams& p,
                                                        const Ctx& c, const OutputSlice& out) {
  if (!length_out_of_range(p, c)) return false;
  write_nan_slice(out, ThreadGroup::block());
  ptx::cluster_wait();
  return true;
}

// Up to kNormVecs 16-byte vectors of src per thread, [base + threadIdx.x + u * threads],
// loaded before any is used: the loads are in flight together (a scalar loop storing to
// shared memory between loads ran them one after another; docs/attention_block.md).
constexpr int kNormVecs = 4;

template <typename T>
__device__ __forceinline__ void load_row_vecs(const T* src, int base, int nv, int threads,
                                              uint4 (&r)[kNormVecs]) {
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int u = 0; u < kNormVecs; ++u) {
    const int v = base + static_cast<int>(threadIdx.x) + u * threads;
    r[u] = v < nv ? __ldg(s4 + v) : make_uint4(0, 0, 0, 0);
  }
}

// h = norm(x[b]) in fp32 (or x itself). hidden % 8 == 0 (whole 16-byte vectors).
template <typename T>
__device__ void normalize_input(const AttentionBlockParams& p, int64_t b, float* h,
                                ThreadGroup group) {
  __shared__ float stats[2 * kMaxComputeWarps];
  const int warps = static_cast<int>(group.threads / 32);
  const int threads = static_cast<int>(group.threads);
  const int nv = static_cast<int>(p.hidden / 8);
  const T* x = static_cast<const T*>(p.x) + b * p.hidden;
  float sum = 0.f, sq = 0.f;
  for (int base = 0; base < nv; base += kNormVecs * threads) {
    uint4 r[kNormVecs];
    load_row_vecs<T>(x, base, nv, threads, r);
#pragma unroll
    for (int u = 0; u < kNormVecs; ++u) {
      const int v = base + static_cast<int>(threadIdx.x) + u * threads;
      if (v >= nv) break;
      float f[8];
      unpack<T>(r[u], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        sum += f[i];
        sq += f[i] * f[i];
      }
      reinterpret_cast<float4*>(h)[2 * v] = make_float4(f[0], f[1], f[2], f[3]);
      reinterpret_cast<float4*>(h)[2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
  }
  if (p.norm == NormKind::kNone) {
    group.sync();
    return;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, off);
    sq += __shfl_xor_sync(0xffffffffu, sq, off);
  }
  if ((threadIdx.x & 31) == 0) {
    stats[threadIdx.x / 32] = sum;
    stats[kMaxComputeWarps + threadIdx.x / 32] = sq;
  }
  group.sync();
  float tsum = 0.f, tsq = 0.f;
  for (int w = 0; w < warps; ++w) {
    tsum += stats[w];
    tsq += stats[kMaxComputeWarps + w];
  }
  const float inv_d = 1.f / static_cast<float>(p.hidden);
  const bool layer = p.norm == NormKind::kLayer;
  const float mean = layer ? tsum * inv_d : 0.f;
  const float r = layer ? rsqrtf(fmaxf(tsq * inv_d - mean * mean, 0.f) + p.eps)
                        : rsqrtf(tsq * inv_d + p.eps);
  const T* wn = static_cast<const T*>(p.norm_w);
  const T* bn = static_cast<const T*>(p.norm_b);
  for (int base = 0; base < nv; base += kNormVecs * threads) {
    uint4 wr[kNormVecs], br[kNormVecs];
    load_row_vecs<T>(wn, base, nv, threads, wr);
    if (layer) load_row_vecs<T>(bn, base, nv, threads, br);
#pragma unroll
    for (int u = 0; u < kNormVecs; ++u) {
      const int v = base + static_cast<int>(threadIdx.x) + u * threads;
      if (v >= nv) break;
      float w[8], bias[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      unpack<T>(wr[u], w);
      if (layer) unpack<T>(br[u], bias);
#pragma unroll
      for (int i = 0; i < 8; ++i) h[v * 8 + i] = (h[v * 8 + i] - mean) * r * w[i] + bias[i];
    }
  }
  group.sync();
}

// Global column of the group's local Q|K|V column c.
__device__ __forceinline__ int64_t qkv_column(const AttentionBlockParams& p, const Ctx& c,
                                              int hpc, int64_t col) {
  const int64_t dh = p.head_dim;
  if (col < hpc * dh) return (c.g * p.group() + c.chunk * hpc) * dh + col;
  if (col < (hpc + 1) * dh) return p.num_q_heads * dh + c.g * dh + (col - hpc * dh);
  return (p.num_q_heads + p.num_kv_heads) * dh + c.g * dh + (col - (hpc + 1) * dh);
}

__device__ inline void apply_rope(const AttentionBlockParams& p, float* qkv, int hpc, int pos,
                           ThreadGroup group) {
  const int dh = static_cast<int>(p.head_dim), half = static_cast<int>(p.rotary_dim / 2);
  const int n = (hpc + 1) * half;  // heads 0..hpc-1 = q, hpc = k
  constexpr int kBatch = 4;        // a thread's frequencies loaded together, ahead of its stores
  for (int e0 = threadIdx.x; e0 < n; e0 += kBatch * group.threads) {
    float freq[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * group.threads;
      freq[u] = e < n ? __ldg(p.inv_freq + e % half) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * group.threads;
      if (e >= n) break;
      const int head = e / half, i = e % half;
      float* v = qkv + head * dh;
      float s, c;
      sincosf(static_cast<float>(pos) * freq[u], &s, &c);
      const int i1 = p.rope_layout == RopeLayout::kHalf ? i : 2 * i;
      const int i2 = p.rope_layout == RopeLayout::kHalf ? i + half : 2 * i + 1;
      const float x1 = v[i1], x2 = v[i2];
      v[i1] = x1 * c - x2 * s;
      v[i2] = x2 * c + x1 * s;
    }
  }
  group.sync();
}

// RoPE at position `pos`, then the new k, v rounded to the cache dtype (what attention
// reads back for the other tokens). Callers synchronise before reading k, v.
template <typename T>
__device__ void rope_and_round_kv(const AttentionBlockParams& p, float* qkv, int hpc, int pos,
                                  ThreadGroup group) {
  apply_rope(p, qkv, hpc, pos, group);
  const int dh = static_cast<int>(p.head_dim);
  for (int e = threadIdx.x; e < 2 * dh; e += group.threads) {
    float& v = qkv[hpc * dh + e];
    v = to_float(from_float<T>(v));
  }
}

// The new token's k, v into the caches at lengths[b]: one block of the KV head's first
// cluster writes them.
template <typename T>
__device__ void write_new_kv(const AttentionBlockParams& p, const Ctx& c, const float* qkv,
                             int hpc, int64_t kv_row0, ThreadGroup group) {
  if (c.chunk != 0 || c.rank != 0) return;
  const int64_t dh = p.head_dim, row = (kv_row0 + c.len) * dh;
  for (int e = threadIdx.x; e < dh; e += group.threads) {
    static_cast<T*>(p.k_cache)[row + e] = from_float<T>(qkv[hpc * dh + e]);
    static_cast<T*>(p.v_cache)[row + e] = from_float<T>(qkv[(hpc + 1) * dh + e]);
  }
}

// Online-softmax state of one thread: MH heads x its 8 dims of the head.
// This lane's 8 elements (vector dv of the head dim) of each of the block's query heads,
// scaled by p.scale * log2(e) for the log2-domain softmax: zeros for heads >= hpc and for
// idle lanes (!active). The SplitToken kernels' attention (registers and tma pipelines).
template <int DH, int MH>
__device__ __forceinline__ void load_lane_queries(float (&q)[MH][8], const AttentionBlockParams& p,
                                                  const float* qkv, int hpc, int dv, bool active) {
#pragma unroll
  for (int h = 0; h < MH; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      q[h][i] = (h < hpc && active) ? qkv[h * DH + dv * 8 + i] * p.scale * kLog2e : 0.f;
    }
  }
}

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
  // Adds U tokens of heads < hpc: scores s (exp2 domain; -inf = masked) and values v
  // (this thread's 8 dims), rescaling the state to the new running max.
  template <typename T, int U>
  __device__ __forceinline__ void add_tokens(const float (&s)[U][MH], const uint4 (&v)[U],
                                             int hpc) {
#pragma unroll
    for (int h = 0; h < MH; ++h) {
      if (h >= hpc) break;
      float mx = m[h];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u][h]);
      if (mx == -INFINITY) continue;  // nothing yet (and no (-inf) - (-inf))
      const float a = exp2f(m[h] - mx);
      m[h] = mx;
      l[h] *= a;
#pragma unroll
      for (int i = 0; i < 8; ++i) o[h][i] *= a;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float pr = exp2f(s[u][h] - mx);  // 0 for masked tokens
        l[h] += pr;
        float vf[8];
        unpack<T>(v[u], vf);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[h][i] = fmaf(pr, vf[i], o[h][i]);
      }
    }
  }
  // Merges the states of the lanes LPT, 2 LPT, ... apart (same dims, other tokens): every
  // lane of a dims group ends with the warp's state of its dims.
  template <int LPT>
  __device__ __forceinline__ void merge_lanes() {
#pragma unroll
    for (int off = LPT; off < 32; off <<= 1) {
      float m2[MH], l2[MH], o2[MH][8];
#pragma unroll
      for (int h = 0; h < MH; ++h) {
        m2[h] = __shfl_xor_sync(0xffffffffu, m[h], off);
        l2[h] = __shfl_xor_sync(0xffffffffu, l[h], off);
#pragma unroll
        for (int i = 0; i < 8; ++i) o2[h][i] = __shfl_xor_sync(0xffffffffu, o[h][i], off);
      }
      merge(m2, l2, o2);
    }
  }
  // The warp's state of heads < hpc -> states[head][DH + 2] = (o..., m, l): o from the
  // lanes whose dims are in the head (`active`, dims dv * 8..+8), m and l from lane 0.
  // Called by the lanes of one token slot.
  template <int DH>
  __device__ __forceinline__ void store(float* states, int hpc, int dv, bool active,
                                        int lane) const {
#pragma unroll
    for (int h = 0; h < MH; ++h) {
      if (h >= hpc) break;
      float* ws = states + h * (DH + 2);
      if (active) {
#pragma unroll
        for (int i = 0; i < 8; ++i) ws[dv * 8 + i] = o[h][i];
      }
      if (lane == 0) {
        ws[DH] = m[h];
        ws[DH + 1] = l[h];
      }
    }
  }
};

// Entry i of one head's merged state (i < DH: o[i], i == DH: l): the warp states
// [warp][head (kWarpStride)][DH + 2] = (o..., m, l) summed in warp order, then the new token
// (score s_new in the exp2 domain, -inf when absent; values v_new), all rescaled to their
// common max, returned in mm.
template <int DH, int kWarps, int kWarpStride>
__device__ __forceinline__ float merged_state_entry(const float* warp_states, int head, int i,
                                                    float s_new, const float* v_new, float& mm) {
  float m = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warp_states[(w * kWarpStride + head) * (DH + 2) + DH]);
  mm = fmaxf(m, s_new);
  float acc = 0.f;
  for (int w = 0; w < kWarps; ++w) {
    const float* ws = warp_states + (w * kWarpStride + head) * (DH + 2);
    const float wm = ws[DH];
    if (wm == -INFINITY) continue;
    acc += (i < DH ? ws[i] : ws[DH + 1]) * exp2f(wm - mm);
  }
  if (s_new != -INFINITY) {
    const float pr = exp2f(s_new - mm);
    acc += i < DH ? pr * v_new[i] : pr;
  }
  return acc;
}

// The new token's score q_h . k_new (exp2 domain) per head -> s_new[head], -inf where the
// block does not own the token: one warp per head, lanes over the head dimension. Warps
// [0, kWarps) take part; the caller's barrier makes s_new visible.
template <int DH, int kWarps>
__device__ __forceinline__ void new_token_scores(int hpc, bool has_new, float qscale,
                                                 const float* qkv, float* s_new) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  for (int head = warp; head < hpc; head += kWarps) {
    float d = 0.f;
    for (int k = lane; k < DH; k += 32) d = fmaf(qkv[head * DH + k] * qscale, qkv[hpc * DH + k], d);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
    if (lane == 0) s_new[head] = has_new ? d : -INFINITY;
  }
}

// A block's attention state per head after its warps attended over their tokens: the warp
// states [warp][head (kWarpStride)][DH + 2] = (o..., m, l) merged in a fixed warp order with
// the new token (score q . k_new, exp2 domain) where the block owns position len
// (has_new), all rescaled to the block's max. Each merged entry goes to
// store(head, i, value, max): i < DH an o entry, i == DH the l entry. Threads [0, kThreads)
// take part; sync() is their barrier (s_new is written in between); the caller syncs after.
template <int DH, int kThreads, int kWarps, int kWarpStride, typename Store, typename Sync>
__device__ __forceinline__ void merge_warp_states_each(int hpc, bool has_new, float qscale,
                                                       const float* qkv, const float* warp_states,
                                                       Store store, Sync sync) {
  __shared__ float s_new[kMaxH];
  // Once per head, not once per merged entry (a 128-long serial dot product per thread
  // on the cluster's critical path).
  new_token_scores<DH, kWarps>(hpc, has_new, qscale, qkv, s_new);
  sync();
  for (int e = threadIdx.x; e < hpc * (DH + 1); e += kThreads) {
    const int head = e / (DH + 1), i = e % (DH + 1);  // i == DH: the l entry
    float mm;
    const float acc = merged_state_entry<DH, kWarps, kWarpStride>(
        warp_states, head, i, s_new[head], qkv + (hpc + 1) * DH, mm);
    store(head, i, acc, mm);
  }
}

// merge_warp_states_each into the layout the cluster's blocks exchange: sums[head * DH + i]
// = o, sums[hpc * DH + head] = l, mx[head] = the block's max (-inf for heads >= hpc); sums
// zero up to sum_floats. sync() ends it.
template <int DH, int kThreads, int kWarps, int kWarpStride, typename Sync>
__device__ __forceinline__ void merge_warp_states(int hpc, bool has_new, float qscale,
                                                  const float* qkv, const float* warp_states,
                                                  float* mx, float* sums, int sum_floats,
                                                  Sync sync) {
  merge_warp_states_each<DH, kThreads, kWarps, kWarpStride>(
      hpc, has_new, qscale, qkv, warp_states,
      [&](int head, int i, float acc, float mm) {
        if (i < DH) {
          sums[head * DH + i] = acc;
        } else {
          sums[hpc * DH + head] = acc;
          mx[head] = mm;
        }
      },
      sync);
  for (int e = threadIdx.x; e < kMaxH; e += kThreads) {
    if (e >= hpc) mx[e] = -INFINITY;
  }
  for (int e = hpc * DH + hpc + threadIdx.x; e < sum_floats; e += kThreads) sums[e] = 0.f;
  sync();
}

// The cluster's attention output from its n blocks' states (states[r * S.floats ...]),
// merged in rank order: every block computes the same sums in the same order, so all
// hold bitwise-identical results. attn[head * DH + i] = o / l. Threads [0, threads).
template <int DH>
__device__ __forceinline__ void merge_block_states(const BlockStateLayout& S, int hpc, int n,
                                                   const float* states, float* attn,
                                                   int threads) {
  for (int e = threadIdx.x; e < hpc * DH; e += threads) {
    const int head = e / DH;
    attn[e] = merge_partial_states(
        n, [&](int r) { return states[r * S.floats + S.m_off + head]; },
        [&](int r) { return states[r * S.floats + S.l_off + head]; },
        [&](int r) { return states[r * S.floats + e]; });
  }
}

// out[jl*8 + i] = sum_r vec[r] * W[(row0 + r) * ld + col_of(j0 + jl) + i] for this
// block's `ncv` column vectors. Threads split rows into groups; partial sums
// meet in shared memory in a fixed order.
template <typename T, typename ColOf, typename Emit>
__device__ void block_gemv(const float* vec, int rows, const T* W, int64_t ld, int ncv,
                           ColOf col_of, float* red, Emit emit) {
  for (int j0 = 0; j0 < ncv; j0 += kBlockThreads) {
    const int cv = min(kBlockThreads, ncv - j0);
    const int groups = kBlockThreads / cv;
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
    for (int e = threadIdx.x; e < cv * 8; e += kBlockThreads) {
      float s = 0.f;
      for (int q = 0; q < groups; ++q) s += red[q * cv * 8 + e];
      emit(j0 + e / 8, e % 8, s);
    }
  }
  __syncthreads();
}

// This block's `my_vecs` column vectors of the group's Q|K|V (from `first_vec`, + bias)
// into qkv; the rest of its `seg_vecs`-vector segment is zero padding for the gather.
template <typename T>
__device__ void project_qkv_slice(const AttentionBlockParams& p, const Ctx& c, int hpc,
                                  const float* h, float* red, float* qkv, int first_vec,
                                  int my_vecs, int seg_vecs) {
  float* my_seg = qkv + static_cast<int64_t>(first_vec) * 8;
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const int64_t ld = (p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim;
  for (int e = threadIdx.x; e < seg_vecs * 8; e += kBlockThreads) my_seg[e] = 0.f;
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


// y[b, :] = sum over the row's clusters (fixed order) + bias + residual. Launched
// programmatically: scheduled while the main kernel runs (its blocks trigger at their
// start), it waits for that kernel's partials, which hides its launch latency. Once they
// are there it lets the stream's next kernel launch: the next decode step's main kernel
// then runs its prologue (indices, barrier set-up, the weights' L2 prefetch) while this
// one sums, and waits (griddep_wait) before it reads anything this kernel writes.
template <typename T>
__global__ void __launch_bounds__(256) attention_block_combine_kernel(const AttentionBlockParams p) {
  ptx::griddep_wait();
  ptx::griddep_launch_dependents();
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

}  // namespace jax_cluster
