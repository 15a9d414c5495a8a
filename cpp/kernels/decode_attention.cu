// Split-K decode attention (flash-decoding) for GQA: one block of 256 threads per (split
// s, KV head g, row b) attends all G query heads of the group over its slice of tokens
// [s * per, (s + 1) * per) of the row's pos[b] + 1, so each K/V byte is read once for the
// whole group. The token loop is attention_decode's (attend_cached: K/V streamed straight
// into registers, several token steps in flight per warp, exp2-domain online softmax);
// the warps' states merge in a fixed order into a per-split partial (o, l, m), and a
// second kernel merges the splits in split order. No atomics: bitwise reproducible.
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
  // The group's queries (fp32; two zero heads past them: merge_warp_states_each reads a
  // "new token" row there, unused here) and the warps' states.
  __shared__ __align__(16) float q[(MH + 2) * DH];
  __shared__ __align__(16) float warp_states[kBlockWarps * kMaxH * (DH + 2)];
  const int s = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int G = static_cast<int>(dp.group), splits = static_cast<int>(dp.splits);
  ptx::griddep_wait();  // q, pos and the caches may come from the previous kernel
  const int pos = dp.pos[b];
  const int len = pos >= 0 && pos < dp.max_seq ? pos + 1 : 0;  // invalid rows: no tokens
  const int per = (len + splits - 1) / splits;
  const int t0 = min(len, s * per), t1 = min(len, t0 + per);
  const int64_t bg = static_cast<int64_t>(b) * dp.num_kv_heads + g;
  const T* qg = static_cast<const T*>(dp.q) + bg * G * DH;
  for (int e = threadIdx.x; e < (MH + 2) * DH; e += kBlockThreads) {
    q[e] = e < G * DH ? to_float(qg[e]) : 0.f;
  }
  __syncthreads();

  AttentionDecodeParams p{};  // what attend_cached reads: the caches and their geometry
  p.k_cache = const_cast<void*>(dp.k_cache);  // only read
  p.v_cache = const_cast<void*>(dp.v_cache);
  p.num_kv_heads = dp.num_kv_heads;
  p.max_seq = dp.max_seq;
  p.scale = 1.f;  // q comes scaled
  Ctx c{};
  c.b = b;
  c.g = g;
  c.len = len;
  attend_cached<T, DH, MH, kSplitTokenSteps<MH>>(p, c, G, q, t0, t1, warp_states);  // ends with a block barrier
  ptx::griddep_launch_dependents();

  float* out = dp.partial + (bg * splits + s) * G * (DH + 2);
  merge_warp_states_each<DH, kBlockThreads, kBlockWarps, kMaxH>(
      G, /*has_new=*/false, kLog2e, q, warp_states,
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
  const bool valid = pos >= 0 && pos < dp.max_seq;
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
