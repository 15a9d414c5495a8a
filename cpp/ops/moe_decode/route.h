// DeepSeek-V2's and V3's routers at decode, as one custom call (jax_cluster_moe_route) ahead
// of the expert kernels:
//
//   h      = RMSNorm(x) with a norm weight:   norm * (x * rsqrt(mean(x^2) + eps)), each product
//                                             rounded to x's dtype as jnp rounds; h is written
//                                             out for the experts. Without one, h = x.
//   logits = h @ router                       fp32 products and sums, x [N, H], router [H, E]
//   V2 (greedy, group-limited greedy):
//     scores = softmax(logits)
//     group-limited: keep the topk_group groups (of E / n_group experts) whose best score is
//                    highest, the other scores become 0
//     ids    = the top_k scores' experts       (equal scores: the lower expert first)
//     weights = the top_k scores / (their sum + 1e-20)   when norm_topk_prob and top_k > 1,
//               else times routed_scaling_factor
//   V3 (noaux_tc):
//     scores = sigmoid(logits), choice = scores + score_bias  (score_bias [E] fp32)
//     keep the topk_group groups whose two best choices sum highest (the others: -inf)
//     ids    = the top_k choices' experts      (equal choices: the lower expert first)
//     weights = the chosen experts' scores (unbiased), / (their sum + 1e-20) when
//               norm_topk_prob, then times routed_scaling_factor
//
// jax_cluster.reference.moe_route is the contract (XLA's softmax and lax.top_k); the kernel
// sums in a fixed order, so its logits may differ from XLA's in the last bits and a pair of
// scores within an ulp may rank the other way.
//
// CUDA. Block c of a grid over K chunks of H stages h[:, chunk c] in fp32 and computes the
// chunk's fp32 partial logits [N][E] (each column's K rows split over the block's threads,
// summed in a fixed order). With a norm every block reads the whole rows of x for their sums
// of squares (a few KB from L2, the loads that also deliver its chunk), so the norm costs no
// kernel of its own; block c writes h[:, chunk c]. The router depends on no earlier kernel:
// each thread's first batch of router loads is issued before the PDL wait, the rest of the
// chunk asked of L2. The chunks write their partials to the workspace; one select block
// launched programmatically behind them (no counter, so no memset in the stream) sums them (a
// fixed split over its threads, a fixed order) and selects. (A one-cluster form, partials
// summed over DSMEM by rank 0, measured slower at V2-Lite's shape: docs/moe_decode.md.)
// Selection: one warp per row. The router is a few hundred KB over tens of blocks, so a
// block's time is memory round trips: each thread reads 16-byte vectors of a K row's
// experts (one element where E's rows are off the 16-byte grid) and issues its loads in
// batches before using them (a chunk is about kMoeRouteChunkBytes, one batch per thread at
// V2-Lite's E = 64; two at V3's 56 KB chunks).
// No float atomics: bitwise deterministic. Up to kMoeRouteMaxRows rows and
// kMoeRouteMaxExperts experts (larger calls route in XLA).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "jax_cluster/types.h"

namespace jax_cluster {

// The select kernel uses one warp per row and holds the logits [N][E] in shared memory;
// more rows route in XLA (docs/moe_decode.md, "Not done").
inline constexpr int64_t kMoeRouteMaxRows = 8;
inline constexpr int64_t kMoeRouteMaxExperts = 512;  // per warp: the scores and group bests in shared memory
inline constexpr int kMoeRouteThreads = 256;
// Router bytes one block reads (its K chunk), and the staged x floats it may hold.
inline constexpr int64_t kMoeRouteChunkBytes = 8192;
inline constexpr int64_t kMoeRouteStageFloats = 8192;
inline constexpr int64_t kMoeRouteMaxChunks = 64;

struct MoeRouteParams {
  DType dtype;           // x's: fp16, bf16 (fp32: the CPU handler)
  DType router_dtype;    // fp32, fp16 or bf16
  int64_t n, h, e, k;    // rows, hidden, experts, top_k
  bool group_limited;    // the groups apply (group-limited greedy, and noaux_tc)
  bool noaux_tc;         // DeepSeek-V3's sigmoid scores and biased choice
  int64_t n_group, topk_group;
  bool norm_topk_prob;
  float scaling;         // routed_scaling_factor
  const void* x;         // [N, H]
  const void* router;    // [H, E]
  const float* score_bias;  // [E] (noaux_tc; else unused)
  const void* norm;      // [H] RMSNorm weight (x's dtype), or nullptr: x is routed as given
  float norm_eps;
  void* normed;          // [N, H] x's dtype: h = RMSNorm(x), written when norm is given
  float* weights;        // [N, k]
  int32_t* ids;          // [N, k]
  void* workspace;       // moe_route_workspace_bytes
};

// K rows of one block's chunk: about kMoeRouteChunkBytes of router (more where that would make
// more than kMoeRouteMaxChunks chunks), x's chunk stageable.
inline int64_t moe_route_chunk_rows(int64_t n, int64_t h, int64_t e, DType router_dtype) {
  const int64_t by_bytes = kMoeRouteChunkBytes / std::max<int64_t>(1, e * dtype_size(router_dtype));
  const int64_t rows = std::max({int64_t{8}, by_bytes, (h + kMoeRouteMaxChunks - 1) / kMoeRouteMaxChunks});
  return std::min({rows, h, std::max<int64_t>(1, kMoeRouteStageFloats / std::max<int64_t>(1, n))});
}

inline int64_t moe_route_chunks(int64_t n, int64_t h, int64_t e, DType router_dtype) {
  return (h + moe_route_chunk_rows(n, h, e, router_dtype) - 1) / moe_route_chunk_rows(n, h, e, router_dtype);
}

// The partial logits [chunks][N][E] fp32.
inline int64_t moe_route_workspace_bytes(int64_t n, int64_t h, int64_t e, DType router_dtype) {
  return moe_route_chunks(n, h, e, router_dtype) * n * e * 4;
}

// Why p is not a valid call of either handler, or "".
inline std::string moe_route_check(const MoeRouteParams& p) {
  const auto s = [](int64_t v) { return std::to_string(v); };
  if (p.n < 1 || p.h < 1 || p.e < 1) return "x must be [N >= 1, H >= 1] and router [H, E >= 1]";
  if (p.k < 1 || p.k > p.e) return "top_k must be in 1..E (" + s(p.e) + "), got " + s(p.k);
  if (p.noaux_tc && !p.group_limited) return "noaux_tc routes within groups (group_limited must be set)";
  if (p.group_limited) {
    if (p.n_group < 1 || p.e % p.n_group) return "n_group (" + s(p.n_group) + ") must divide E (" + s(p.e) + ")";
    if (p.noaux_tc && p.e / p.n_group < 2) return "noaux_tc scores a group by its two best: E / n_group must be >= 2";
    if (p.topk_group < 1 || p.topk_group > p.n_group) return "topk_group must be in 1..n_group";
    if (p.k > p.topk_group * (p.e / p.n_group)) return "top_k exceeds the experts the kept groups hold";
  }
  return "";
}

// Why the CUDA kernel cannot run p (beyond moe_route_check), or "".
inline std::string moe_route_cuda_check(const MoeRouteParams& p) {
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) return "x must be float16 or bfloat16 on the GPU";
  if (p.n > kMoeRouteMaxRows) return "at most " + std::to_string(kMoeRouteMaxRows) + " rows";
  if (p.e > kMoeRouteMaxExperts) return "at most " + std::to_string(kMoeRouteMaxExperts) + " experts";
  if (p.norm != nullptr && p.h % 8) return "with a norm, H must be a multiple of 8 (16-byte row loads)";
  return "";
}

}  // namespace jax_cluster
