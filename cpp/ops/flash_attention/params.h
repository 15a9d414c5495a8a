// Non-causal attention of several query chunks over several key/value chunks in one
// launch, folded into a running (o, lse) state per query chunk (StreamFusion App. C,
// Alg. 2). No XLA includes here.
//
//   for every query chunk i, every row r, every head h:
//     s_j   = scale * q_i[r, h] . k[j, h]       over the keys j of ALL kv chunks
//     new   = (o = softmax(s) V, lse = log sum_j exp(s_j))
//     state = merge(state_i[r, h], new)          (log-sum-exp / sigmoid form)
//   out: o fp32 normalized + lse (natural log), or with `finalize` o in the input dtype
//   (0 where nothing was seen) + lse.
//
// Layouts: q, k, v, o [B, L, H, Dh] (row r of head h at ((b L + r) H + h) Dh);
// lse [B, H, L]. The empty state is lse = -inf (its o is ignored).
#pragma once

#include <cstdint>

#include "jax_cluster/types.h"

namespace jax_cluster {

// Chunks one launch takes (the Python wrapper concatenates beyond these).
inline constexpr int kFlashMaxQChunks = 32;
inline constexpr int kFlashMaxKVChunks = 32;

struct FlashQChunk {
  const void* q;        // [B, len, H, Dh], dtype
  const float* o_in;    // [B, len, H, Dh] fp32 normalized; null = empty state
  const float* lse_in;  // [B, H, len] fp32; null = empty state
  void* o;              // [B, len, H, Dh]: fp32, or dtype when finalize
  float* lse;           // [B, H, len]
  int64_t len;
};

struct FlashKVChunk {
  const void* k;  // [B, len, H, Dh], dtype
  const void* v;
  int64_t len;
};

// Which CUDA kernel runs a call (the FFI attribute `kernel`, FlashAttentionConfig.kernel).
enum class FlashKernel : int32_t {
  kAuto = 0,   // the wgmma kernel where it serves the call, else the mma.sync one
  kWgmma = 1,  // the wgmma/TMA kernel (an error where it does not serve the call)
  kMma = 2,    // the mma.sync kernel
};
inline constexpr int kFlashNumKernels = 3;

// Shapes with a CUDA kernel; the Python wrapper runs others on XLA (it reads this rule
// through the extension's plans, cpp/ops/flash_attention/plan.cc).
inline bool flash_attention_cuda_supports(int64_t head_dim, DType dtype) {
  return (head_dim == 64 || head_dim == 128) && dtype != DType::kF32;
}

struct FlashAttentionParams {
  DType dtype;  // q, k, v (and o when finalize)
  int64_t batch, heads, head_dim;
  float scale;
  bool finalize;
  FlashKernel kernel;
  int num_q, num_kv;
  FlashQChunk q[kFlashMaxQChunks];
  FlashKVChunk kv[kFlashMaxKVChunks];
};

}  // namespace jax_cluster
