// Split-K decode attention (flash-decoding) for GQA: one block of 256 threads per (split
// s, KV head g, row b) attends all G query heads of the group over its slice of tokens
// [s * per, (s + 1) * per) of the row's pos[b] + 1, so each K/V byte is read once for the
// whole group. The token loop is attention_decode's (attend_cached: K/V streamed straight
// into registers, several token steps in flight per warp, exp2-domain online softmax);
// the warps' states merge in a fixed order into a per-split partial (o, l, m), and a
// second kernel merges the splits in split order. No atomics: bitwise reproducible.
// Append mode (DecodeAttentionParams::qkv): the blocks build q and the new k, v from the
// QKV projection's row (RoPE, k and v rounded to the cache dtype), attend the new token
// from shared memory, and the merge kernel writes k, v into the caches.
// Both kernels are launched programmatically (PDL), like attention_decode's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "jax_cluster/cluster_collectives.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/thread_group.cuh"
#include "kernels/attention_decode_launch.h"
#include "kernels/decode_attention_launch.h"
#include "kernels/launch.cuh"

namespace jax_cluster {
namespace {

#include "kernels/attention_decode_common.cuh"     // NOLINT(build/include)
#include "kernels/attention_decode_registers.cuh"  // NOLINT(build/include): attend_cached

// Token steps per warp in flight: enough bytes in flight per SM to cover the latency
// of HBM at one block per SM (attend_cached's fused-kernel defaults, built for two blocks
// per SM, left GQA groups of 4 latency-bound: 2.5 TB/s against 3.07 for MHA at batch 16).
template <int MH>
constexpr int kSplitTokenSteps = MH <= 4 ? 8 : 4;

template <typename T, int DH, int MH>
__global__ void __launch_bounds__(kBlockThreads, 1)
    decode_attention_split_kernel(const DecodeAttentionParams dp) {
  // The group's queries (fp32), then the new token's k and v (append mode; zeros
  // otherwise: merge_warp_states_each reads them only for a new token), and the warps'
  // states.
  __shared__ __align__(16) float q[(MH + 2) * DH];
  __shared__ __align__(16) float warp_states[kBlockWarps * kMaxH * (DH + 2)];
  const int s = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int G = static_cast<int>(dp.group), splits = static_cast<int>(dp.splits);
  const bool append = dp.qkv != nullptr;
  ptx::griddep_wait();  // q, pos and the caches may come from the previous kernel
  const int pos = dp.pos[b];
  const bool valid = pos >= 0 && pos < dp.max_seq;
  const int len = valid ? pos + 1 : 0;  // entries attended (invalid rows: none)
  const int per = (len + splits - 1) / splits;
  const int t0 = min(len, s * per), t1 = min(len, t0 + per);
  const int64_t bg = static_cast<int64_t>(b) * dp.num_kv_heads + g;

  AttentionDecodeParams p{};  // what the shared helpers read: caches, geometry, RoPE
  p.k_cache = const_cast<void*>(dp.k_cache);  // written in append mode only
  p.v_cache = const_cast<void*>(dp.v_cache);
  p.num_kv_heads = dp.num_kv_heads;
  p.num_q_heads = dp.num_kv_heads * G;
  p.head_dim = DH;
  p.max_seq = dp.max_seq;
  p.rotary_dim = dp.rotary_dim;
  p.rope_layout = dp.rope_layout;
  p.inv_freq = dp.inv_freq;
  p.scale = append ? dp.scale : 1.f;  // a given q comes scaled
  Ctx c{};
  c.b = b;
  c.g = g;
  c.rank = s;
  c.len = append ? pos : len;  // cached tokens read from the caches
  if (append) {  // [Q heads of the group | k | v] of the row, RoPE'd; k, v rounded
    const int64_t cols = (p.num_q_heads + 2 * p.num_kv_heads) * DH;
    for (int e = threadIdx.x; e < (G + 2) * DH; e += kBlockThreads) {
      q[e] = dp.qkv[b * cols + qkv_column(p, c, G, e)];
    }
    __syncthreads();
    rope_and_round_kv<T>(p, q, G, valid ? pos : 0, ThreadGroup::block());
    __syncthreads();
    // Split 0 leaves the new k, v for the merge kernel, which writes them to the caches
    // once every block has read its tokens. (Written here, into the caches this kernel
    // reads, the token loop ran 6% slower: 110.4 against 104.1 us at batch 16, 8 KV heads,
    // 4K tokens, H100, session 21.)
    if (s == 0) {
      float* kv = dp.partial + decode_attention_partial_floats(dp) + bg * 2 * DH;
      for (int e = threadIdx.x; e < 2 * DH; e += kBlockThreads) kv[e] = q[G * DH + e];
    }
  } else {
    const T* qg = static_cast<const T*>(dp.q) + bg * G * DH;
    for (int e = threadIdx.x; e < (MH + 2) * DH; e += kBlockThreads) {
      q[e] = e < G * DH ? to_float(qg[e]) : 0.f;
    }
    __syncthreads();
  }
  attend_cached<T, DH, MH, kSplitTokenSteps<MH>>(p, c, G, q, t0, min(t1, c.len), warp_states);
  ptx::griddep_launch_dependents();
  const bool has_new = append && t0 <= pos && pos < t1;

  float* out = dp.partial + (bg * splits + s) * G * (DH + 2);
  merge_warp_states_each<DH, kBlockThreads, kBlockWarps, kMaxH>(
      G, has_new, p.scale * kLog2e, q, warp_states,
      [&](int head, int i, float acc, float mm) {
        out[head * (DH + 2) + i] = acc;
        if (i == DH) out[head * (DH + 2) + DH + 1] = mm;
      },
      [] { __syncthreads(); });
}

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

template <typename T, int DH, int MH>
cudaError_t launch_typed(const DecodeAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(p.batch));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_programmatic(decode_attention_split_kernel<T, DH, MH>,
                                                       grid, dim3(kBlockThreads), 0, true, stream, p));
  return launch_programmatic(decode_attention_merge_kernel<T, DH>,
                             dim3(static_cast<unsigned>(p.batch * p.num_kv_heads)),
                             dim3(static_cast<unsigned>(p.group * DH)), 0, true, stream, p);
}

template <typename T, int DH>
cudaError_t launch_group(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.group == 1) return launch_typed<T, DH, 1>(p, stream);
  if (p.group == 2) return launch_typed<T, DH, 2>(p, stream);
  if (p.group <= 4) return launch_typed<T, DH, 4>(p, stream);
  return launch_typed<T, DH, 8>(p, stream);
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
