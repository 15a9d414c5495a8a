// Split-K decode attention (flash-decoding) for GQA: one block per (split s, KV head g,
// row b) attends all G query heads of the group over its slice of tokens
// [s * per, (s + 1) * per) of the row's pos[b] + 1, so each K/V byte is read once for the
// whole group. Two token loops: for MHA attention_decode's (attend_cached: K/V streamed
// straight into registers, several token steps in flight per warp, exp2-domain online
// softmax), for GQA decode_attention_mma.cuh's (tensor cores); 256 threads each.
// The warps' states merge in a fixed order into a per-split partial (o, l, m), and a
// second kernel merges the splits in split order; with one split the block writes the
// output itself. No atomics: bitwise reproducible.
// Append mode (DecodeAttentionParams::qkv): the blocks build q and the new k, v from the
// QKV projection's row (RoPE, k and v rounded to the cache dtype), attend the new token
// from shared memory, and k, v go into the caches after every block has read its tokens
// (by the merge kernel, or by the one split).
// Both kernels are launched programmatically (PDL), like attention_decode's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "jax_cluster/cluster_collectives.cuh"
#include "jax_cluster/mma.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/thread_group.cuh"
#include "ops/attention_block/launch.h"
#include "ops/decode_attention/launch.h"
#include "jax_cluster/launch.cuh"

namespace jax_cluster {
namespace {

#include "ops/attention_block/kernel_common.cuh"     // NOLINT(build/include)
#include "ops/attention_block/kernel_registers.cuh"  // NOLINT(build/include): attend_cached

// Token steps per warp in flight in the MHA kernel: enough bytes in flight per SM to
// cover the latency of HBM (attend_cached's fused-kernel default is built for two blocks
// per SM).
constexpr int kSplitTokenSteps = 8;

// What a split block knows once its prologue ran: the helpers' view of the step (p, c:
// caches, geometry, RoPE), its row's position and its token slice [t0, t1) of the pos + 1
// attended (in append mode the last one, pos, is the new token, not read from the caches).
struct SplitBlock {
  AttentionDecodeParams p;
  Ctx c;
  int pos, t0, t1;
  bool valid, append;
  int64_t bg;  // row * Hkv + KV head
};

// The prologue both split kernels share (kThreads of them): waits for the previous kernel
// (q, pos and the caches may come from it), then fills q (fp32) with the group's queries,
// then, in append mode, the new token's RoPE'd k and v (rounded to the cache dtype; zeros
// otherwise: merge_warp_states_each reads them only for a new token). Each thread issues
// all its loads before storing any (a loop of load-store pairs waited out one memory
// latency per element: ~1.5 us in a 128-thread version, session 22). With several splits, split 0 leaves k, v
// in the workspace for the merge kernel, which writes them to the caches once every block
// has read its tokens. (Written here, into the caches the split kernels read, the token
// loop ran 6% slower: 110.4 against 104.1 us at batch 16, 8 KV heads, 4K tokens, H100,
// session 21.) Ends with a block barrier.
template <typename T, int DH, int kThreads>
__device__ SplitBlock begin_split(const DecodeAttentionParams& dp, float* q) {
  SplitBlock sb;
  const int s = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int G = static_cast<int>(dp.group), splits = static_cast<int>(dp.splits);
  sb.append = dp.qkv != nullptr;
  sb.bg = static_cast<int64_t>(b) * dp.num_kv_heads + g;

  AttentionDecodeParams& p = sb.p;
  p = AttentionDecodeParams{};
  p.k_cache = const_cast<void*>(dp.k_cache);  // written in append mode only
  p.v_cache = const_cast<void*>(dp.v_cache);
  p.num_kv_heads = dp.num_kv_heads;
  p.num_q_heads = dp.num_kv_heads * G;
  p.head_dim = DH;
  p.max_seq = dp.max_seq;
  p.rotary_dim = dp.rotary_dim;
  p.rope_layout = dp.rope_layout;
  p.inv_freq = dp.inv_freq;
  p.scale = sb.append ? dp.scale : 1.f;  // a given q comes scaled
  Ctx& c = sb.c;
  c = Ctx{};
  c.b = b;
  c.g = g;
  c.rank = s;

  // Append mode: [Q heads of the group | k | v] of the row (fp32); else the group's q.
  constexpr int kPer = ((kDecodeAttentionMaxGroup + 2) * DH + kThreads - 1) / kThreads;
  const int n = (G + 2) * DH;
  const int64_t cols = (p.num_q_heads + 2 * p.num_kv_heads) * DH;
  const T* qg = static_cast<const T*>(dp.q) + sb.bg * G * DH;
  ptx::griddep_wait();
  sb.pos = dp.pos[b];
  const int half = static_cast<int>(dp.rotary_dim / 2);
  const float inv_freq = sb.append && threadIdx.x < half ? dp.inv_freq[threadIdx.x] : 0.f;
  float vals[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = threadIdx.x + i * kThreads;
    vals[i] = 0.f;
    if (e < n && sb.append) vals[i] = dp.qkv[b * cols + qkv_column(p, c, G, e)];
    if (e < G * DH && !sb.append) vals[i] = to_float(qg[e]);
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = threadIdx.x + i * kThreads;
    if (e < n) q[e] = vals[i];
  }
  sb.valid = sb.pos >= 0 && sb.pos < dp.max_seq;
  const int len = sb.valid ? sb.pos + 1 : 0;  // entries attended (invalid rows: none)
  const int per = (len + splits - 1) / splits;
  sb.t0 = min(len, s * per);
  sb.t1 = min(len, sb.t0 + per);
  c.len = sb.append ? sb.pos : len;  // cached tokens read from the caches
  __syncthreads();
  if (sb.append) {  // RoPE on q and k (apply_rope's math, one sincos per frequency)
    __shared__ float2 rot[DH / 2];
    if (threadIdx.x < half) {
      float sn, cs;
      sincosf(static_cast<float>(sb.valid ? sb.pos : 0) * inv_freq, &sn, &cs);
      rot[threadIdx.x] = make_float2(cs, sn);
    }
    __syncthreads();
    const bool halves = dp.rope_layout == RopeLayout::kHalf;
    for (int e = threadIdx.x; e < (G + 1) * half; e += kThreads) {
      const int i = e % half;
      float* v = q + (e / half) * DH;  // heads 0..G-1: q, G: k
      const int i1 = halves ? i : 2 * i, i2 = halves ? i + half : 2 * i + 1;
      const float x1 = v[i1], x2 = v[i2];
      v[i1] = x1 * rot[i].x - x2 * rot[i].y;
      v[i2] = x2 * rot[i].x + x1 * rot[i].y;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 2 * DH; e += kThreads) {  // k, v as the cache holds them
      q[G * DH + e] = to_float(from_float<T>(q[G * DH + e]));
    }
    __syncthreads();
    if (s == 0 && splits > 1) {
      float* kv = dp.partial + decode_attention_partial_floats(dp) + sb.bg * 2 * DH;
      for (int e = threadIdx.x; e < 2 * DH; e += kThreads) kv[e] = q[G * DH + e];
    }
  }
  return sb;
}

// The epilogue both split kernels share: the warps' states (and the new token, where this
// split owns it) merged in warp order into the split's partial (o, l, m) per head. With
// one split there is nothing to merge across blocks: the block writes the output (o / l,
// NaN for rows whose pos is out of range) and, in append mode, the new k, v into the
// caches (after its own reads of them: no other block reads this row's head), and the
// merge kernel is not launched.
template <typename T, int DH, int kThreads, int kWarps>
__device__ void finish_split(const DecodeAttentionParams& dp, const SplitBlock& sb,
                             const float* q, const float* warp_states) {
  const int G = static_cast<int>(dp.group);
  const bool has_new = sb.append && sb.t0 <= sb.pos && sb.pos < sb.t1;
  if (dp.splits > 1) {
    float* out = dp.partial + (sb.bg * dp.splits + blockIdx.x) * G * (DH + 2);
    merge_warp_states_each<DH, kThreads, kWarps, kMaxH>(
        G, has_new, sb.p.scale * kLog2e, q, warp_states,
        [&](int head, int i, float acc, float mm) {
          out[head * (DH + 2) + i] = acc;
          if (i == DH) out[head * (DH + 2) + DH + 1] = mm;
        },
        [] { __syncthreads(); });
    return;
  }
  __shared__ float merged[kDecodeAttentionMaxGroup * (DH + 1)];  // per head: o[DH], l
  merge_warp_states_each<DH, kThreads, kWarps, kMaxH>(
      G, has_new, sb.p.scale * kLog2e, q, warp_states,
      [&](int head, int i, float acc, float) { merged[head * (DH + 1) + i] = acc; },
      [] { __syncthreads(); });
  __syncthreads();
  T* out = static_cast<T*>(dp.out) + sb.bg * G * DH;
  for (int e = threadIdx.x; e < G * DH; e += kThreads) {
    const float* st = merged + (e / DH) * (DH + 1);
    out[e] = from_float<T>(sb.valid ? st[e % DH] / st[DH] : NAN);
  }
  if (sb.append && sb.valid) {
    const int64_t slot = (sb.bg * dp.max_seq + sb.pos) * DH;
    for (int e = threadIdx.x; e < 2 * DH; e += kThreads) {
      T* cache = static_cast<T*>(const_cast<void*>(e < DH ? dp.k_cache : dp.v_cache));
      cache[slot + e % DH] = from_float<T>(q[G * DH + e]);
    }
  }
}

// MHA (G = 1): the CUDA-core split kernel. GQA runs decode_attention_mma_split_kernel.
template <typename T, int DH>
__global__ void __launch_bounds__(kBlockThreads, 1)
    decode_attention_split_kernel(const DecodeAttentionParams dp) {
  __shared__ __align__(16) float q[(kDecodeAttentionMaxGroup + 2) * DH];
  __shared__ __align__(16) float warp_states[kBlockWarps * kMaxH * (DH + 2)];
  const SplitBlock sb = begin_split<T, DH, kBlockThreads>(dp, q);
  attend_cached<T, DH, 1, kSplitTokenSteps>(sb.p, sb.c, 1, q, sb.t0, min(sb.t1, sb.c.len),
                                            warp_states);
  ptx::griddep_launch_dependents();
  finish_split<T, DH, kBlockThreads, kBlockWarps>(dp, sb, q, warp_states);
}

#include "ops/decode_attention/kernel_mma.cuh"  // NOLINT(build/include): the tensor-core split kernel

// out[b, g, head, d] = the splits' states merged in split order, o / l; NaN for rows whose
// pos is outside [0, S_max). One block per (row, KV head), one thread per (head, d).
template <typename T, int DH>
__global__ void __launch_bounds__(kDecodeAttentionMaxGroup * DH)
    decode_attention_merge_kernel(const DecodeAttentionParams dp) {
  ptx::griddep_wait();
  ptx::griddep_launch_dependents();
  const int64_t bg = blockIdx.x;
  const int head = threadIdx.x / DH, d = threadIdx.x % DH;
  if (head >= dp.group) return;
  const int pos = dp.pos[bg / dp.num_kv_heads];
  const bool valid = pos >= 0 && pos < dp.max_seq;
  if (dp.qkv != nullptr && valid) {  // append mode: the new k, v into the caches at pos
    const float* kv = dp.partial + decode_attention_partial_floats(dp) + bg * 2 * DH;
    const int64_t slot = (bg * dp.max_seq + pos) * DH;
    for (int e = threadIdx.x; e < 2 * DH; e += blockDim.x) {
      T* cache = static_cast<T*>(const_cast<void*>(e < DH ? dp.k_cache : dp.v_cache));
      cache[slot + e % DH] = from_float<T>(kv[e]);
    }
  }
  const int64_t stride = dp.group * (DH + 2);
  const float* st = dp.partial + bg * dp.splits * stride + head * (DH + 2);
  float m = -INFINITY;
  for (int64_t s = 0; s < dp.splits; ++s) m = fmaxf(m, st[s * stride + DH + 1]);
  float o = 0.f, l = 0.f;
  for (int64_t s = 0; s < dp.splits; ++s) {
    const float* ss = st + s * stride;
    const float ms = ss[DH + 1];
    if (ms == -INFINITY) continue;  // a split without tokens
    const float w = exp2f(ms - m);
    o = fmaf(ss[d], w, o);
    l = fmaf(ss[DH], w, l);
  }
  static_cast<T*>(dp.out)[(bg * dp.group + head) * DH + d] = from_float<T>(valid ? o / l : NAN);
}

// The merge kernel, where there is something to merge (see finish_split).
template <typename T, int DH>
cudaError_t launch_merge(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.splits == 1) return cudaSuccess;
  return launch_programmatic(decode_attention_merge_kernel<T, DH>,
                             dim3(static_cast<unsigned>(p.batch * p.num_kv_heads)),
                             dim3(static_cast<unsigned>(p.group * DH)), 0, true, stream, p);
}

dim3 split_grid(const DecodeAttentionParams& p) {
  return dim3(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.num_kv_heads),
              static_cast<unsigned>(p.batch));
}

template <typename T, int DH>
cudaError_t launch_cuda_cores(const DecodeAttentionParams& p, cudaStream_t stream) {
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(decode_attention_split_kernel<T, DH>,
                                                       split_grid(p), dim3(kBlockThreads), 0,
                                                       true, stream, p));
  return launch_merge<T, DH>(p, stream);
}

template <typename T, int DH>
cudaError_t launch_tensor_cores(const DecodeAttentionParams& p, cudaStream_t stream) {
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(decode_attention_mma_split_kernel<T, DH>,
                                                       split_grid(p), dim3(MmaSplitTile<DH>::kThreads),
                                                       0, true, stream, p));
  return launch_merge<T, DH>(p, stream);
}

template <typename T, int DH>
cudaError_t launch_group(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (decode_attention_uses_tensor_cores(p)) return launch_tensor_cores<T, DH>(p, stream);
  return launch_cuda_cores<T, DH>(p, stream);
}

template <typename T>
cudaError_t launch_dh(const DecodeAttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_group<T, 64>(p, stream);
    case 80: return launch_group<T, 80>(p, stream);
    case 96: return launch_group<T, 96>(p, stream);
    case 128: return launch_group<T, 128>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_decode_attention(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (!decode_attention_cuda_supports(p) || p.splits < 1 || p.splits > kDecodeAttentionMaxSplits) {
    return cudaErrorInvalidValue;
  }
  if (p.dtype == DType::kF16) return launch_dh<__half>(p, stream);
  return launch_dh<__nv_bfloat16>(p, stream);
}

}  // namespace jax_cluster
