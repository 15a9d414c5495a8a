// The MoE decode combine (params.h has the algorithm; launch.cu launches it): the k slots
// of each row summed in slot order (+ residual), then the shared chunks added to the
// rounded sum in chunk order; NaN for a row with an invalid id. A PDL launch: the ids, the
// routing weights and the residual are loaded before it waits for the down kernel's y_e.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "ops/moe_decode/params.h"

namespace jax_cluster {
namespace moe {

struct CombineArgs {
  const float* y;        // y_e [pairs][H] fp32
  const float* weights;  // [N, k]
  const int32_t* ids;    // [N, k]
  const void* residual;  // [N, H] or null
  void* out;             // [N, H]
  int64_t n, h, k, e;
  int64_t shared_chunks;  // shared pseudo-experts, their pairs after the routed N k
};

// Slots (or shared chunks) whose loads the combine issues together: each load is a round
// trip to L2, and one at a time they were the end of the layer's critical path.
constexpr int kCombineBatch = 8;

template <typename T>
__global__ void __launch_bounds__(kMoeDecodeThreads) moe_combine_kernel(const CombineArgs a) {
  const int64_t quads = a.h / 4, total = a.n * quads;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kMoeDecodeThreads;
  bool waited = false;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * kMoeDecodeThreads + threadIdx.x; q < total; q += stride) {
    const int64_t row = q / quads, c = (q - row * quads) * 4, o = row * a.h + c;
    float s[4] = {0.f, 0.f, 0.f, 0.f}, res[4] = {0.f, 0.f, 0.f, 0.f};
    if (a.residual != nullptr) {  // an input of the call: loaded ahead of the wait
      T r[4];
      *reinterpret_cast<uint2*>(r) = *reinterpret_cast<const uint2*>(static_cast<const T*>(a.residual) + o);
#pragma unroll
      for (int i = 0; i < 4; ++i) res[i] = to_float(r[i]);
    }
    bool valid = true;
    for (int64_t s0 = 0; s0 < a.k; s0 += kCombineBatch) {
      int id[kCombineBatch];
      float w[kCombineBatch];
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        const int64_t p = row * a.k + s0 + u;
        id[u] = s0 + u < a.k ? __ldg(a.ids + p) : -1;
        w[u] = s0 + u < a.k ? __ldg(a.weights + p) : 0.f;
      }
      if (!waited) {  // ids and weights are the router's; y_e is the previous kernel's
        ptx::griddep_wait();  // a no-op without PDL
        waited = true;
      }
      float4 v[kCombineBatch];
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        const bool chosen = id[u] >= 0 && id[u] < a.e;  // no block wrote an invalid pair's y_e
        v[u] = chosen ? __ldcg(reinterpret_cast<const float4*>(a.y + (row * a.k + s0 + u) * a.h + c))
                      : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {  // slot order
        if (s0 + u >= a.k) break;
        if (id[u] < 0 || id[u] >= a.e) {
          valid = false;
          continue;
        }
        s[0] = fmaf(w[u], v[u].x, s[0]);
        s[1] = fmaf(w[u], v[u].y, s[1]);
        s[2] = fmaf(w[u], v[u].z, s[2]);
        s[3] = fmaf(w[u], v[u].w, s[3]);
      }
    }
    if (a.residual != nullptr) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] += res[i];
    }
    if (!waited) {
      ptx::griddep_wait();
      waited = true;
    }
    if (a.shared_chunks > 0) {  // the routed sum rounded, the shared chunks added in chunk order
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] = to_float(from_float<T>(s[i]));
      for (int64_t c0 = 0; c0 < a.shared_chunks; c0 += kCombineBatch) {
        float4 v[kCombineBatch];
#pragma unroll
        for (int u = 0; u < kCombineBatch; ++u) {
          const int64_t pair = a.n * a.k + (c0 + u) * a.n + row;
          v[u] = c0 + u < a.shared_chunks ? __ldcg(reinterpret_cast<const float4*>(a.y + pair * a.h + c))
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < kCombineBatch; ++u) {
          if (c0 + u >= a.shared_chunks) break;
          s[0] += v[u].x;
          s[1] += v[u].y;
          s[2] += v[u].z;
          s[3] += v[u].w;
        }
      }
    }
    T out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = from_float<T>(valid ? s[i] : __int_as_float(0x7fc00000));
    *reinterpret_cast<uint2*>(static_cast<T*>(a.out) + o) = *reinterpret_cast<const uint2*>(out);
  }
}

}  // namespace moe
}  // namespace jax_cluster
