// decode_attention's split kernels, shared parts and the CUDA-core one: one block per
// (split s, KV head g, row b) attends all G query heads of the group over its slice of
// tokens [s * per, (s + 1) * per) of the row's lengths[b] + 1, so each K/V byte is read once
// for the whole group. The token loop for MHA is attention_block's attend_cached (K/V
// streamed straight into registers, several token steps in flight per warp, exp2-domain
// online softmax); GQA's is kernel_mma.cuh's (tensor cores); 256 threads each. The warps'
// states merge in a fixed order into a per-split partial (o, l, m), and the merge kernel
// merges the splits in split order; with one split the block writes the output itself. No
// atomics: bitwise reproducible.
// Append mode (DecodeAttentionParams::qkv): the blocks build q and the new k, v from the QKV
// projection's row (RoPE, k and v rounded to the cache dtype), attend the new token from
// shared memory, and k, v go into the caches after every block has read its tokens (by the
// merge kernel, or by the one split).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "jax_cluster/ptx.cuh"
#include "jax_cluster/softmax.cuh"
#include "ops/attention_block/kernel_common.cuh"
#include "ops/attention_block/kernel_registers.cuh"  // attend_cached
#include "ops/decode_attention/params.h"

namespace jax_cluster {

// Token steps per warp in flight in the MHA kernel: enough bytes in flight per SM to
// cover the latency of HBM (attend_cached's default is built for attention_block's two
// blocks per SM).
constexpr int kSplitTokenSteps = 8;

// What a split block knows once its prologue ran: the attention_block helpers' view of the
// step (p, c: caches, geometry, RoPE), its row's length and its token slice [t0, t1) of the
// slots attended (length + 1; in append mode the one at new_at, slot length, is the new
// token, not read from the caches; over a rolling buffer new_at is length % S_max and, once
// the buffer is full, a slot in the middle whose cached token is skipped).
struct SplitBlock {
  AttentionBlockParams p;
  int s;  // the split
  Ctx c;
  int length, t0, t1;
  int new_at, skip;  // append mode: the new token's slot; a cached slot not read (-1: none)
  bool valid, append;
  int64_t bg;  // row * Hkv + KV head
};

// One split block's work: split s of KV head g of row b. The split kernels take it from
// blockIdx; decoder_layer's persistent kernel walks the items with its own blocks.
struct SplitItem {
  int s, g, b;
};
__device__ __forceinline__ SplitItem split_item_of_block() {
  return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
}

// The prologue both split kernels share (kThreads of them): waits for the previous kernel
// (q, lengths and the caches may come from it), then fills q (fp32) with the group's
// queries, then, in append mode, the new token's RoPE'd k and v (rounded to the cache dtype;
// zeros otherwise: merge_warp_states_each reads them only for a new token). Each thread
// issues all its loads before storing any (a loop of load-store pairs waited out one memory
// latency per element). With several splits, split 0 leaves k, v in the workspace for the
// merge kernel, which writes them to the caches once every block has read its tokens
// (written here, into the caches the split kernels read, the token loop ran slower:
// docs/decode_attention.md). Ends with a block barrier.
template <typename T, int DH, int kThreads>
__device__ SplitBlock begin_split(const DecodeAttentionParams& dp, float* q, SplitItem item) {
  SplitBlock sb;
  const int s = item.s, g = item.g, b = item.b;
  sb.s = s;
  const int G = static_cast<int>(dp.group), splits = static_cast<int>(dp.splits);
  sb.append = dp.qkv != nullptr;
  sb.bg = static_cast<int64_t>(b) * dp.num_kv_heads + g;

  AttentionBlockParams& p = sb.p;
  p = AttentionBlockParams{};
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
  sb.length = dp.lengths[b];
  const int half = static_cast<int>(dp.rotary_dim / 2);
  const float inv_freq = sb.append && threadIdx.x < half ? dp.inv_freq[threadIdx.x] : 0.f;
  float vals[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = threadIdx.x + i * kThreads;
    vals[i] = 0.f;
    if (e < n && sb.append) vals[i] = __ldcg(dp.qkv + b * cols + qkv_column(p, c, G, e));  // L2: may be this grid's
    if (e < G * DH && !sb.append) vals[i] = to_float(qg[e]);
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = threadIdx.x + i * kThreads;
    if (e < n) q[e] = vals[i];
  }
  const AppendSlots slots = append_slots(sb.length, dp.max_seq, sb.append && dp.rolling);
  sb.valid = slots.valid;
  const int len = static_cast<int>(slots.attended);  // entries attended (invalid rows: none)
  const int per = (len + splits - 1) / splits;
  sb.t0 = min(len, s * per);
  sb.t1 = min(len, sb.t0 + per);
  sb.new_at = sb.append ? static_cast<int>(slots.slot) : -1;
  // Cached tokens read: [0, len) but the new token's slot (the last one unless the rolling
  // buffer is full, where the slot's old token is skipped).
  const bool last = sb.new_at == len - 1;
  c.len = sb.append && last ? len - 1 : len;
  sb.skip = sb.append && !last && sb.valid ? sb.new_at : -1;
  __syncthreads();
  if (sb.append) {  // RoPE on q and k (apply_rope's math, one sincos per frequency)
    __shared__ float2 rot[DH / 2];
    if (threadIdx.x < half) {
      float sn, cs;
      sincosf(static_cast<float>(sb.valid ? sb.length : 0) * inv_freq, &sn, &cs);
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
// NaN for rows whose length is out of range) and, in append mode, the new k, v into the
// caches (after its own reads of them: no other block reads this row's head), and the
// merge kernel is not launched.
template <typename T, int DH, int kThreads, int kWarps>
__device__ void finish_split(const DecodeAttentionParams& dp, const SplitBlock& sb,
                             const float* q, const float* warp_states) {
  const int G = static_cast<int>(dp.group);
  const bool has_new = sb.append && sb.t0 <= sb.new_at && sb.new_at < sb.t1;
  if (dp.splits > 1) {
    float* out = dp.partial + (sb.bg * dp.splits + sb.s) * G * (DH + 2);
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
  for (int e = threadIdx.x; e < G * DH; e += kThreads) {
    const float* st = merged + (e / DH) * (DH + 1);
    const float o = sb.valid ? st[e % DH] / st[DH] : NAN;
    if (dp.out_f32 != nullptr) {
      dp.out_f32[sb.bg * G * DH + e] = o;
    } else {
      static_cast<T*>(dp.out)[sb.bg * G * DH + e] = from_float<T>(o);
    }
  }
  if (sb.append && sb.valid) {
    const int64_t slot = (sb.bg * dp.max_seq + sb.new_at) * DH;
    for (int e = threadIdx.x; e < 2 * DH; e += kThreads) {
      T* cache = static_cast<T*>(const_cast<void*>(e < DH ? dp.k_cache : dp.v_cache));
      cache[slot + e % DH] = from_float<T>(q[G * DH + e]);
    }
  }
}

// MHA (G = 1): one split block on CUDA cores (q: (kDecodeAttentionMaxGroup + 2) DH floats,
// warp_states: kBlockWarps kMaxH (DH + 2) floats of shared memory, 16-byte aligned).
template <typename T, int DH, int U = kSplitTokenSteps>
__device__ void decode_attention_split_block(const DecodeAttentionParams& dp, SplitItem item, float* q,
                                             float* warp_states) {
  const SplitBlock sb = begin_split<T, DH, kBlockThreads>(dp, q, item);
  attend_cached<T, DH, 1, U>(sb.p, sb.c, 1, q, sb.t0, min(sb.t1, sb.c.len), warp_states, sb.skip);
  ptx::griddep_launch_dependents();
  finish_split<T, DH, kBlockThreads, kBlockWarps>(dp, sb, q, warp_states);
}

// A split block's shared memory (dynamic in every kernel that runs one: at head_dim 256 it
// passes the 48 KB of a static array), in floats: q and the new k, v, then the warps' states
// (kMaxH heads per warp), then whatever the kernel adds (the lean tensor-core form's Q'
// fragments: mma_split_smem_floats).
template <int DH>
JAX_CLUSTER_HOST_DEVICE constexpr int split_q_floats() {
  return (kDecodeAttentionMaxGroup + 2) * DH;
}
template <int DH>
JAX_CLUSTER_HOST_DEVICE constexpr int split_smem_floats() {
  return split_q_floats<DH>() + kBlockWarps * kMaxH * (DH + 2);
}

// The CUDA-core split kernel (MHA). GQA runs decode_attention_mma_split_kernel.
template <typename T, int DH>
__global__ void __launch_bounds__(kBlockThreads, 1)
    decode_attention_split_kernel(const DecodeAttentionParams dp) {
  extern __shared__ __align__(16) float split_smem[];
  decode_attention_split_block<T, DH>(dp, split_item_of_block(), split_smem,
                                      split_smem + split_q_floats<DH>());
}

// The new token's k, v of (row, KV head) bg into the caches at its slot (lengths[b], or
// lengths[b] % S_max over a rolling buffer; append mode, several splits: split 0 left them in
// the workspace), by threads tid of n.
template <typename T, int DH>
__device__ void write_new_kv(const DecodeAttentionParams& dp, int64_t bg, int tid, int n) {
  const AppendSlots slots = append_slots(dp.lengths[bg / dp.num_kv_heads], dp.max_seq, dp.rolling);
  if (dp.qkv == nullptr || !slots.valid) return;
  const float* kv = dp.partial + decode_attention_partial_floats(dp) + bg * 2 * DH;
  const int64_t slot = (bg * dp.max_seq + slots.slot) * DH;
  for (int e = tid; e < 2 * DH; e += n) {
    T* cache = static_cast<T*>(const_cast<void*>(e < DH ? dp.k_cache : dp.v_cache));
    cache[slot + e % DH] = from_float<T>(__ldcg(kv + e));
  }
}

// Element d of query head `head` of (row, KV head) bg: the splits' states merged in split
// order, o / l; NaN for rows whose length is invalid (outside [0, S_max), or negative over a
// rolling buffer).
template <int DH>
__device__ float merge_splits(const DecodeAttentionParams& dp, int64_t bg, int head, int d) {
  const bool valid = append_slots(dp.lengths[bg / dp.num_kv_heads], dp.max_seq, dp.qkv != nullptr && dp.rolling).valid;
  const int64_t stride = dp.group * (DH + 2);
  const float* st = dp.partial + bg * dp.splits * stride + head * (DH + 2);
  const float o_l = merge_partial_states(
      dp.splits, [&](int64_t s) { return __ldcg(st + s * stride + DH + 1); },
      [&](int64_t s) { return __ldcg(st + s * stride + DH); }, [&](int64_t s) { return __ldcg(st + s * stride + d); });
  return valid ? o_l : NAN;
}

// Threads of the merge kernel's block: one per (head, d) up to the block's limit (eight
// heads of 256 dims take two entries each).
template <int DH>
constexpr int merge_threads(int group) {
  return group * DH < 1024 ? group * DH : 1024;
}

// out[b, g, head, d] = merge_splits; in append mode the new k, v go into the caches first.
// One block per (row, KV head), merge_threads(G) threads over the (head, d) entries.
template <typename T, int DH>
__global__ void __launch_bounds__(merge_threads<DH>(kDecodeAttentionMaxGroup))
    decode_attention_merge_kernel(const DecodeAttentionParams dp) {
  ptx::griddep_wait();
  ptx::griddep_launch_dependents();
  const int64_t bg = blockIdx.x;
  write_new_kv<T, DH>(dp, bg, threadIdx.x, blockDim.x);
  for (int e = threadIdx.x; e < dp.group * DH; e += blockDim.x) {
    const float o = merge_splits<DH>(dp, bg, e / DH, e % DH);
    static_cast<T*>(dp.out)[bg * dp.group * DH + e] = from_float<T>(o);
  }
}

}  // namespace jax_cluster
