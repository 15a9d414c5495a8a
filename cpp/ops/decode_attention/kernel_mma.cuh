// The tensor-core split kernel of decode_attention (GQA): the same blocks, prologue and
// partials as decode_attention_split_kernel, but the group's scores and values come from
// mma.sync instead of per-head dot products on CUDA cores.
//
// Why: at G query heads per KV head the CUDA-core loop does G dot products and G value
// FMAs per cache element, and streams the cache well below the MHA rate. Here a warp takes
// 16 tokens at a time (8 warps; two chunks in registers, the next one's loads in flight
// while this one's math runs):
//   S^T[token][head] = K Q'^T      A = K rows, B = Q' (registers), M = tokens, N = 8 heads
//                                  (G <= 8; unused heads have q = 0)
//   O^T[dh][head]  += V^T P^T      A = V rows transposed in registers (movmatrix), B = P^T:
//                                  S^T's fragment after exp2, transposed the same way
// so each thread's O columns are the heads of its S columns and the online-softmax
// rescale needs no exchange. Q' = q * scale * log2(e) and P are each split into a 16-bit
// high part and the 16-bit rounding of the rest (two mma each): scores and weights keep
// ~fp32 precision, as the CUDA-core kernel's fp32 math does, for twice the mma count (at
// these rates the tensor cores idle either way). The loads carry a 256-byte L2
// prefetch-size hint. What was tried and lost (a cp.async ring with ldmatrix, loads-then-
// math of two chunks): docs/decode_attention.md.
// decoder_layer runs a lean form of the same block (kLean, 128 registers per thread): Q'
// from shared memory, one chunk buffer refilled half by half, 8-token chunks at head_dim
// 128 (docs/decoder_layer.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/mma.cuh"
#include "ops/decode_attention/kernel_split.cuh"  // begin_split, finish_split

namespace jax_cluster {

// The 16-bit value in the low (high = false) or high half of a packed pair, as float.
__device__ __forceinline__ float half_of(__half, uint32_t x, bool high) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(high ? x >> 16 : x)));
}
__device__ __forceinline__ float half_of(__nv_bfloat16, uint32_t x, bool high) {
  return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(high ? x >> 16 : x)));
}

// (a, b) -> hi = their 16-bit roundings, lo = the 16-bit roundings of what hi missed.
template <typename T>
__device__ __forceinline__ void split_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
  hi = pack2<T>(a, b);
  lo = pack2<T>(a - half_of(T{}, hi, false), b - half_of(T{}, hi, true));
}

// The 8x8 16-bit matrix whose fragment the warp holds (lane: row lane / 4, columns
// 2 (lane % 4) + {0, 1}), transposed, in the same fragment layout.
__device__ __forceinline__ uint32_t transpose_fragment(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// K and V go from global memory straight into mma fragments (16-byte loads, no
// shared-memory staging), as in the CUDA-core kernel's loop. The head dimension
// is read in a permuted order that makes each thread's 16 bytes of a row (dims
// 32 j + 8 c .. + 8, c = lane % 4) its fragment registers: for K (A of S^T = K Q'^T) the
// permutation is undone by loading Q' in the same order; for V (A of O^T = V^T P^T) each
// 8x8 block of a row pair is transposed in registers (movmatrix), and O^T's rows come out
// permuted, undone when the warp stores its state.
template <int DH>
struct MmaSplitTile {
  static constexpr int kWarps = 8, kThreads = 32 * kWarps;
  static constexpr int J32 = DH / 32;           // 32-dim groups (16-byte loads)
  static constexpr bool kTail = DH % 32 != 0;   // a last 16-dim group (8-byte loads): Dh 80
  static constexpr int KS = DH / 16;            // k-steps of S^T, m-tiles of O^T
};

// Physical dim of O^T row r (0..15) of m-tile mt (MmaSplitTile's permuted order).
template <int DH>
__device__ __forceinline__ int mma_out_dim(int mt, int r) {
  const int half = r >> 3, rr = r & 7;
  if (mt < 2 * MmaSplitTile<DH>::J32) {  // 32-dim group j = mt / 2, blocks 2t and 2t + 1
    const int j = mt >> 1, t = mt & 1;
    return 32 * j + 8 * (rr >> 1) + 4 * t + 2 * half + (rr & 1);
  }
  return 32 * MmaSplitTile<DH>::J32 + 4 * (rr >> 1) + 2 * half + (rr & 1);  // the 16-dim tail
}

// Shared memory of the lean form's Q' fragments (uint4 per k-step and lane).
template <int DH>
__host__ __device__ constexpr int mma_split_lean_smem_floats() {
  return MmaSplitTile<DH>::KS * 32 * 4;
}

// One split block on tensor cores (shared memory as decode_attention_split_block's).
// kLean: the form for 128 registers per thread (decoder_layer at two blocks per SM): Q'
// fragments read from shared memory (q_frags, mma_split_lean_smem_floats) at each k-step
// instead of held in registers, and one chunk buffer whose K half is reloaded with the
// next chunk once the scores are in and its V half once the values are (the default form
// keeps two whole chunks: the next one's loads in flight during all of this one's math).
template <typename T, int DH, bool kLean = false>
__device__ void decode_attention_mma_split_block(const DecodeAttentionParams& dp, SplitItem item, float* q,
                                                 float* warp_states, uint4* q_frags = nullptr) {
  using L = MmaSplitTile<DH>;
  constexpr int KS = L::KS, J32 = L::J32;
  const SplitBlock sb = begin_split<T, DH, L::kThreads>(dp, q, item);
  const int G = static_cast<int>(dp.group);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gq = lane >> 2, cq = lane & 3;

  // Q'^T (B of S^T) in the permuted order of the K fragments: k-step 2 j + h of group j
  // holds dims 32 j + 8 cq + 4 h + {0, 1} (b0) and + {2, 3} (b1); the tail's k-step dims
  // 32 J32 + 4 cq + {0, 1} and + {2, 3}. Fragment {hi b0, hi b1, lo b0, lo b1} of k-step ks
  // for lane (gq, cq).
  const float qscale = sb.p.scale * kLog2e;
  auto q_fragment = [&](int ks, int fgq, int fcq) {
    const int d0 = ks < 2 * J32 ? 32 * (ks >> 1) + 8 * fcq + 4 * (ks & 1) : 32 * J32 + 4 * fcq;
    uint4 f;
    const float a0 = fgq < G ? q[fgq * DH + d0] * qscale : 0.f;
    const float b0 = fgq < G ? q[fgq * DH + d0 + 1] * qscale : 0.f;
    const float a1 = fgq < G ? q[fgq * DH + d0 + 2] * qscale : 0.f;
    const float b1 = fgq < G ? q[fgq * DH + d0 + 3] * qscale : 0.f;
    split_pair<T>(a0, b0, f.x, f.z);
    split_pair<T>(a1, b1, f.y, f.w);
    return f;
  };
  uint4 qreg[kLean ? 1 : KS];
  if constexpr (kLean) {
    for (int e = threadIdx.x; e < KS * 32; e += L::kThreads) q_frags[e] = q_fragment(e >> 5, (e & 31) >> 2, e & 3);
    __syncthreads();
  } else {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) qreg[ks] = q_fragment(ks, gq, cq);
  }

  const int t0 = sb.t0, t_end = min(sb.t1, sb.c.len), skip = sb.skip;
  // Tokens per warp chunk, in 8s: the lean form at head_dim 128 takes 8 (the mma's other 8
  // rows are zeros), so that a chunk's K and V fit beside O in 128 registers.
  constexpr int kRows = kLean && DH > 96 ? 1 : 2;
  const int64_t row0 = sb.bg * dp.max_seq * DH;
  const T* K = static_cast<const T*>(dp.k_cache) + row0;
  const T* V = static_cast<const T*>(dp.v_cache) + row0;

  float o[KS][4];
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  // One 16-token chunk of a warp: rows gq and gq + 8, 16 bytes per 32-dim group (+ 8 of
  // the tail), of K and of V.
  struct Chunk {
    uint4 k[2][J32 + 1], v[2][J32 + 1];
  };
  // One half (K or V) of the chunk at `first`: 16 bytes per 32-dim group and row.
  auto load_rows = [&](int first, const T* base, uint4 (&rows)[2][J32 + 1]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = first + gq + 8 * r;
      const bool ok = t < t_end && r < kRows && t != skip;
      const T* p = base + static_cast<int64_t>(t) * DH;
#pragma unroll
      for (int j = 0; j < J32; ++j) rows[r][j] = ok ? ptx::ldg_stream_256(p + 32 * j + 8 * cq) : make_uint4(0, 0, 0, 0);
      if constexpr (L::kTail) {
        const uint2 tail = ok ? ptx::ldg_stream8_256(p + 32 * J32 + 4 * cq) : make_uint2(0, 0);
        rows[r][J32] = make_uint4(tail.x, tail.y, 0, 0);
      }
    }
  };
  auto load = [&](int first, Chunk& ch) {
    load_rows(first, K, ch.k);
    load_rows(first, V, ch.v);
  };
  // S^T of the chunk at `first` (masked past t_end).
  auto score = [&](int first, const Chunk& ch, float (&s)[4]) {
    s[0] = s[1] = s[2] = s[3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const int j = ks < 2 * J32 ? ks >> 1 : J32;
      const int h = ks < 2 * J32 ? ks & 1 : 0;
      const uint4& lo_row = ch.k[0][j];
      const uint4& hi_row = ch.k[1][j];
      const uint32_t a[4] = {h ? lo_row.z : lo_row.x, h ? hi_row.z : hi_row.x,
                             h ? lo_row.w : lo_row.y, h ? hi_row.w : hi_row.y};
      uint4 f;
      if constexpr (kLean) {  // a volatile load: hoisted out of the loop it is registers again
        f = ptx::lds128(q_frags + ks * 32 + lane);
      } else {
        f = qreg[ks];
      }
      mma16816<T>(s, a, f.x, f.y);
      mma16816<T>(s, a, f.z, f.w);
    }
    const int tok = first + gq;
    if (tok >= t_end || tok == skip) s[0] = s[1] = -INFINITY;
    if (kRows == 1 || tok + 8 >= t_end || tok + 8 == skip) s[2] = s[3] = -INFINITY;
  };
  // The online softmax's step with the chunk's scores, and O^T += V^T P^T.
  auto absorb = [&](float (&s)[4], const Chunk& ch) {
    float x0 = fmaxf(s[0], s[2]), x1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
    }
    const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
    const float u0 = n0 == -INFINITY ? 0.f : n0, u1 = n1 == -INFINITY ? 0.f : n1;
    const float a0 = exp2f(m0 - u0), a1 = exp2f(m1 - u1);
    m0 = n0;
    m1 = n1;
    const float p0 = exp2f(s[0] - u0), p1 = exp2f(s[1] - u1);
    const float p2 = exp2f(s[2] - u0), p3 = exp2f(s[3] - u1);
    l0 = fmaf(l0, a0, p0 + p2);
    l1 = fmaf(l1, a1, p1 + p3);
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      o[mt][0] *= a0;
      o[mt][1] *= a1;
      o[mt][2] *= a0;
      o[mt][3] *= a1;
    }
    uint32_t ph0, pl0, ph1, pl1;
    split_pair<T>(p0, p1, ph0, pl0);
    split_pair<T>(p2, p3, ph1, pl1);
    ph0 = transpose_fragment(ph0);
    pl0 = transpose_fragment(pl0);
    ph1 = transpose_fragment(ph1);
    pl1 = transpose_fragment(pl1);
    // O^T += V^T P^T: m-tile (j, t) = blocks 2 t (rows 0-7) and 2 t + 1 (rows 8-15) of
    // group j; a block is one register of each row's 16 bytes, transposed.
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      const int j = mt < 2 * J32 ? mt >> 1 : J32;
      const int t = mt < 2 * J32 ? mt & 1 : 0;
      const uint4& lo_row = ch.v[0][j];
      const uint4& hi_row = ch.v[1][j];
      const uint32_t b0 = t ? lo_row.z : lo_row.x, b1 = t ? lo_row.w : lo_row.y;
      const uint32_t c0 = t ? hi_row.z : hi_row.x, c1 = t ? hi_row.w : hi_row.y;
      const uint32_t a[4] = {transpose_fragment(b0), transpose_fragment(b1),
                             transpose_fragment(c0), transpose_fragment(c1)};
      mma16816<T>(o[mt], a, ph0, ph1);
      mma16816<T>(o[mt], a, pl0, pl1);
    }
  };

  // Warp w takes chunks w, w + kWarps, ... of [t0, t_end).
  constexpr int kStep = 8 * kRows * L::kWarps;
  int first = t0 + 8 * kRows * warp;
  if constexpr (kLean) {  // one buffer, each half refilled as soon as its math is done
    Chunk ch;
    if (first < t_end) load(first, ch);
    while (first < t_end) {
      const int next = first + kStep;
      float s[4];
      score(first, ch, s);
      if (next < t_end) load_rows(next, K, ch.k);
      absorb(s, ch);
      if (next < t_end) load_rows(next, V, ch.v);
      first = next;
    }
  } else {  // two buffers rolling: the next chunk's loads in flight while this one's math runs
    Chunk a, b;
    auto attend = [&](int at, const Chunk& ch) {
      float s[4];
      score(at, ch, s);
      absorb(s, ch);
    };
    if (first < t_end) load(first, a);
    while (first < t_end) {
      const int next = first + kStep;
      if (next < t_end) load(next, b);
      attend(first, a);
      if (next >= t_end) break;
      const int after = next + kStep;
      if (after < t_end) load(after, a);
      attend(next, b);
      first = after;
    }
  }
  ptx::griddep_launch_dependents();

#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  float* ws = warp_states + warp * kMaxH * (DH + 2);
  const int h0 = 2 * cq, h1 = 2 * cq + 1;
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int d = mma_out_dim<DH>(mt, gq + 8 * r);
      if (h0 < G) ws[h0 * (DH + 2) + d] = o[mt][2 * r];
      if (h1 < G) ws[h1 * (DH + 2) + d] = o[mt][2 * r + 1];
    }
  }
  if (gq == 0) {
    if (h0 < G) {
      ws[h0 * (DH + 2) + DH] = m0;
      ws[h0 * (DH + 2) + DH + 1] = l0;
    }
    if (h1 < G) {
      ws[h1 * (DH + 2) + DH] = m1;
      ws[h1 * (DH + 2) + DH + 1] = l1;
    }
  }
  __syncthreads();
  finish_split<T, DH, L::kThreads, L::kWarps>(dp, sb, q, warp_states);
}

// decode_attention's own tensor-core kernel runs the lean form where two whole chunks do not
// fit in registers beside O: at head_dim 256 (O alone takes 64 registers per thread).
template <int DH>
constexpr bool kMmaSplitKernelLean = DH > 128;

// A tensor-core split block's shared memory in floats: split_smem_floats, then, in the lean
// form, its Q' fragments.
template <int DH, bool kLean>
JAX_CLUSTER_HOST_DEVICE constexpr int mma_split_smem_floats() {
  static_assert(MmaSplitTile<DH>::kWarps == kBlockWarps, "warp states sized for kBlockWarps");
  static_assert(split_smem_floats<DH>() % 4 == 0, "the Q' fragments after it are 16-byte aligned");
  return split_smem_floats<DH>() + (kLean ? mma_split_lean_smem_floats<DH>() : 0);
}

template <typename T, int DH>
__global__ void __launch_bounds__(MmaSplitTile<DH>::kThreads, 1)
    decode_attention_mma_split_kernel(const DecodeAttentionParams dp) {
  extern __shared__ __align__(16) float split_smem[];
  float* warp_states = split_smem + split_q_floats<DH>();
  decode_attention_mma_split_block<T, DH, kMmaSplitKernelLean<DH>>(
      dp, split_item_of_block(), split_smem, warp_states,
      reinterpret_cast<uint4*>(split_smem + split_smem_floats<DH>()));
}

}  // namespace jax_cluster
