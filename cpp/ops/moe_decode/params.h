// The routed experts of a mixture-of-experts layer at decode (DeepSeek-V2's MoE):
//
//   y[n] = sum_s weights[n, s] * SwiGLU_{ids[n, s]}(x[n])  (+ residual[n])
//   SwiGLU_e(x) = (round(silu(x @ w_gate[e]) * (x @ w_up[e]))) @ w_down[e]
//
// x [N, H]; weights float32 [N, k] and ids int32 [N, k] (the router's output: route.h's
// kernel or XLA); w_gate, w_up [E, H, I]; w_down [E, I, H]; residual [N, H] or none. fp16 /
// bf16 (the CPU handler also float32), fp32 accumulation; the activation h = silu(g) * u is
// rounded to x's dtype (as a 16-bit implementation stores it); the per-(row, slot) expert
// outputs stay fp32 and y is rounded once, after the weighted sum and the residual.
//
// Kernels (experts.cuh and combine.cuh, launched by launch.cu; docs/moe_decode.md):
//  1. gate/up: grid (I column tiles of cols_up, min(E, N k)): grid row j is the j-th
//     smallest expert id chosen (rows past the distinct count exit at once). A block lists
//     the (row, slot) pairs whose id is its expert (a scan of ids, in pair order), then
//     streams its expert's w_gate / w_up column tile ONCE for all those pairs (passes of
//     kMoeDecodeMaxPassRows pairs) and writes h [pair][I] (x's dtype) to the workspace.
//     Only the chosen experts' weights are read, each once per call.
//  2. down: grid (H column tiles of cols_down, min(E, N k)), the same scheme over w_down:
//     the fp32 expert outputs y_e [pair][H] to the workspace.
//  3. combine: y[n] = sum over s = 0..k-1 in order of weights[n, s] * y_e[n * k + s]
//     (+ residual), one thread per 4 outputs. No atomics anywhere: bitwise deterministic.
//  Kernels 2 and 3 launch programmatically (PDL) behind the previous one.
//
// Shared experts (optional, DeepSeek-V2's always-on SwiGLU of width Is: s_gate, s_up
// [H, Is], s_down [Is, H]) run in the same kernels: a SwiGLU's output is the sum of the
// SwiGLUs of its column chunks, so the shared expert is ceil(Is / I) pseudo-experts of width
// at most I (chunk c: columns [c I, c I + I) of s_gate / s_up, the same rows of s_down), each
// chosen by every row with weight 1. They take the grid rows after the routed ones; their
// pairs follow the routed pairs (pair N k + c N + n), and the combine adds them after the
// routed sum:
//   y[n] = round( round(routed[n] + residual[n]) + sum_c y_e[N k + c N + n] )
// (what swiglu(x, shared, residual = routed) computes: the routed sum rounded, the shared
// output added in fp32 and rounded once).
//
// ids outside [0, E) (possible only when the caller passes ids under jit: the Python
// wrapper rejects concrete ones) give an all-NaN output row; no block reads or writes for
// such a pair.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "jax_cluster/types.h"

namespace jax_cluster {

inline constexpr int64_t kMoeDecodeAlign = 8;          // H and I must be multiples of this
inline constexpr int64_t kMoeDecodeMaxExperts = 65535;  // E: the grid's y dimension
inline constexpr int kMoeDecodeMaxPassRows = 8;         // pairs per pass over a weight tile
// The default column tile of either GEMV is the wider 128 when its grid still has this many
// blocks (one per SM of an H100 / H200), else 64: a wide tile streams longer weight-row
// segments per block and pays a block's fixed cost (its pair list, staging x, filling the
// pipeline) over more columns, but at batch 1 it would leave SMs idle.
inline constexpr int64_t kMoeDecodeFillBlocks = 132;
// x (or h) rows of one pass are staged in fp32 in chunks of at most this many floats.
inline constexpr int64_t kMoeDecodeStageFloats = 16384;
inline constexpr int kMoeDecodeThreads = 256;

struct MoeDecodeParams {
  DType dtype;             // x, expert weights, residual, y
  int64_t n, h, i, e, k;   // rows, hidden, expert intermediate, experts, slots per row
  int64_t i_s = 0;         // shared experts' width Is (0: none)
  int cols_up;             // I columns per gate/up block: 32, 64 or 128
  int cols_down;           // H columns per down block: 32, 64 or 128
  bool has_residual;
  bool pdl;                // kernels 2 and 3 launch programmatically
  const void* x;
  const float* weights;    // [N, k]
  const int32_t* ids;      // [N, k]
  const void* w_gate;      // [E, H, I]
  const void* w_up;        // [E, H, I]
  const void* w_down;      // [E, I, H]
  const void* s_gate = nullptr;  // [H, Is] (i_s > 0)
  const void* s_up = nullptr;    // [H, Is]
  const void* s_down = nullptr;  // [Is, H]
  const void* residual;    // [N, H] or unused
  void* out;               // [N, H]
  void* workspace;         // MoeDecodeLayout
};

inline int64_t moe_decode_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t moe_decode_align16(int64_t v) { return (v + 15) / 16 * 16; }

inline bool moe_decode_valid_cols(int64_t c) { return c == 32 || c == 64 || c == 128; }

// Pairs per pass (the kernels' template rows): a row picks an expert at most once, so an
// expert has at most N pairs; more than kMoeDecodeMaxPassRows run in several passes.
inline int moe_decode_pass_rows(int64_t n) {
  return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : kMoeDecodeMaxPassRows;
}

// The shared experts' pseudo-experts: chunks of width at most I.
inline int64_t moe_decode_shared_chunks(int64_t i_s, int64_t i) { return i_s > 0 ? moe_decode_ceil_div(i_s, i) : 0; }

// The default column tile of a GEMV over `extent` columns (I for gate/up, H for down).
inline int moe_decode_default_cols(int64_t extent, int64_t n, int64_t k, int64_t e, int64_t i_s, int64_t i) {
  const int64_t grid_rows = std::min(e, n * k) + moe_decode_shared_chunks(i_s, i);
  return moe_decode_ceil_div(extent, 128) * grid_rows >= kMoeDecodeFillBlocks ? 128 : 64;
}

// Workspace: h [pairs][I] in x's dtype, then the fp32 expert outputs [pairs][H]; pairs = the
// routed N k, then N per shared chunk.
struct MoeDecodeLayout {
  int64_t pairs, h_bytes, y_offset, total;
};

inline MoeDecodeLayout moe_decode_layout(int64_t n, int64_t k, int64_t h, int64_t i, int64_t i_s, DType dtype) {
  MoeDecodeLayout l;
  l.pairs = n * k + n * moe_decode_shared_chunks(i_s, i);
  l.h_bytes = l.pairs * i * dtype_size(dtype);
  l.y_offset = moe_decode_align16(l.h_bytes);
  l.total = l.y_offset + l.pairs * h * 4;
  return l;
}

inline int64_t moe_decode_workspace_bytes(int64_t n, int64_t k, int64_t h, int64_t i, int64_t i_s, DType dtype) {
  return moe_decode_layout(n, k, h, i, i_s, dtype).total;
}

// K rows of one staged chunk of a pass (mr rows of fp32 each).
JAX_CLUSTER_HOST_DEVICE inline int64_t moe_decode_chunk_rows(int mr) { return kMoeDecodeStageFloats / mr; }

// Staged row stride (16-bit elements) of the tensor-core GEMV for chunks of `rows` K rows: an
// odd number of 32-byte blocks, so the B fragments' 8-byte loads are conflict-free.
JAX_CLUSTER_HOST_DEVICE inline int64_t moe_decode_mma_stride(int64_t rows) { return (rows + 31) / 32 * 32 + 16; }

// Dynamic shared memory of a GEMV block: first the chosen experts as a bit set (E bits),
// then the staged chunk (fp32 [K][mr], or 16-bit [mr][stride] on the tensor cores), later
// overlaid by the warps' partials [warp][matrices][mr][cols] (fp32).
inline int64_t moe_decode_smem_bytes(int mr, int cols, int64_t k_rows, int matrices, int64_t experts) {
  const int64_t bits = (experts + 31) / 32 * 4;
  const int64_t rows = std::min(k_rows, moe_decode_chunk_rows(mr));
  const int64_t stage = std::max(rows * mr * 4, moe_decode_mma_stride(rows) * mr * 2);
  const int64_t red = int64_t{kMoeDecodeThreads / 32} * matrices * mr * cols * 4;
  return std::max({bits, stage, red});
}

// Why p's sizes and launch fields are not a valid call (of either handler); empty when
// they are. The FFI decoder and the Python planner (plan.cc) both ask this.
inline std::string moe_decode_check(const MoeDecodeParams& p) {
  const auto s = [](int64_t v) { return std::to_string(v); };
  if (p.n < 1) return "x must have at least one row";
  if (p.h < 1 || p.i < 1 || p.h % kMoeDecodeAlign || p.i % kMoeDecodeAlign) {
    return "H (" + s(p.h) + ") and I (" + s(p.i) + ") must be positive multiples of " + s(kMoeDecodeAlign);
  }
  if (p.i_s < 0 || p.i_s % kMoeDecodeAlign) {
    return "the shared experts' width Is (" + s(p.i_s) + ") must be a multiple of " + s(kMoeDecodeAlign);
  }
  if (p.e < 1 || p.e > kMoeDecodeMaxExperts) return "E must be in 1.." + s(kMoeDecodeMaxExperts) + ", got " + s(p.e);
  if (p.k < 1 || p.k > p.e) return "k (slots per row) must be in 1..E, got " + s(p.k);
  if (p.n * p.k > int64_t{1} << 30) return "N * k must be at most 2^30";
  if (p.n * p.k + p.n * moe_decode_shared_chunks(p.i_s, p.i) > int64_t{1} << 30 ||
      std::min(p.e, p.n * p.k) + moe_decode_shared_chunks(p.i_s, p.i) > kMoeDecodeMaxExperts) {
    return "the shared experts' width Is (" + s(p.i_s) + ") must be at most " +
           s(kMoeDecodeMaxExperts - std::min(p.e, p.n * p.k)) + " times I";
  }
  if (!moe_decode_valid_cols(p.cols_up)) return "cols_up must be 32, 64 or 128, got " + s(p.cols_up);
  if (!moe_decode_valid_cols(p.cols_down)) return "cols_down must be 32, 64 or 128, got " + s(p.cols_down);
  return "";
}

// Why the CUDA kernels cannot run p (beyond moe_decode_check); empty when they can.
inline std::string moe_decode_cuda_check(const MoeDecodeParams& p) {
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) {
    return "the CUDA kernels take float16 or bfloat16 (float32 runs on the CPU handler only)";
  }
  return "";
}

}  // namespace jax_cluster
