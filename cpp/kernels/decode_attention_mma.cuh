// The tensor-core split kernel of decode_attention (DecodeAttentionCores::kTensor): the
// same blocks, prologue and partials as decode_attention_split_kernel, but the group's
// scores and values come from mma.sync instead of per-head dot products on CUDA cores.
//
// Why: at G query heads per KV head the CUDA-core loop does G dot products and G value
// FMAs per cache element, and held only ~8 token steps per warp in flight; at G = 4 it
// streamed 2.6 TB/s on an H100 where MHA streams 3.07 (session 21). Here 4 warps share a
// ring of cp.async stages of 64 tokens (K and V rows, ~35 KB per stage at Dh = 128), so
// ~140 KB per SM are in flight whatever G is, and the math is a few mma per 16 tokens.
//
// Per warp and stage, 16 tokens:
//   S^T[token][head] = K Q'^T      A = K rows (ldmatrix), B = Q' (registers), M = tokens,
//                                  N = 8 heads (G <= 8; unused heads have q = 0)
//   O^T[dh][head]  += V^T P^T      A = V rows (ldmatrix.trans), B = P^T: S^T's fragment
//                                  after exp2, transposed in registers (movmatrix)
// so each thread's O columns are the heads of its S columns and the online-softmax
// rescale needs no exchange. Q' = q * scale * log2(e) and P are each split into a 16-bit
// high part and the 16-bit rounding of the rest (two mma each): scores and weights keep
// ~fp32 precision, as the CUDA-core kernel's fp32 math does, for twice the mma count (at
// these rates the tensor cores idle either way).
// Included inside decode_attention.cu's anonymous namespace (begin_split, finish_split;
// jax_cluster/mma.cuh included there).
#pragma once

template <int DH>
struct MmaSplitTile {
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kTokens = 16 * kWarps;  // per stage: 16 per warp
  static constexpr int kChunks = DH / 8;       // 16-byte chunks per cache row
  // Rows padded by 16 bytes: the 8 rows one ldmatrix reads start 4 banks apart (Dh 64,
  // 128) or at other disjoint bank quads (80, 96): conflict-free.
  static constexpr int kRowBytes = DH * 2 + 16;
  static constexpr int kStageBytes = 2 * kTokens * kRowBytes;  // K rows, then V rows
#ifdef JC_DA_STAGE_BYTES  // probe builds: other ring sizes
  static constexpr int kRingBytes = JC_DA_STAGE_BYTES;
#else
  static constexpr int kRingBytes = 176 * 1024;
#endif
  static constexpr int kStages = kRingBytes / kStageBytes < 6 ? kRingBytes / kStageBytes : 6;
  static constexpr int kSmemBytes = kStages * kStageBytes;
};

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

template <typename T, int DH>
__global__ void __launch_bounds__(MmaSplitTile<DH>::kThreads, 1)
    decode_attention_mma_split_kernel(const DecodeAttentionParams dp) {
  using L = MmaSplitTile<DH>;
  constexpr int KS = DH / 16;  // 16-wide steps over the head dimension
  extern __shared__ __align__(128) unsigned char kv_stages[];
  __shared__ __align__(16) float q[(kDecodeAttentionMaxGroup + 2) * DH];
  __shared__ __align__(16) float warp_states[L::kWarps * kMaxH * (DH + 2)];
  const SplitBlock sb = begin_split<T, DH, L::kThreads>(dp, q);
  const int G = static_cast<int>(dp.group);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gq = lane >> 2, cq = lane & 3;  // fragment row (token / head), column pair

  // Q'^T as the B operand: head gq, dims 16 ks + 8 j + 2 cq + {0, 1}.
  uint32_t qh[KS][2], ql[KS][2];
  const float qscale = sb.p.scale * kLog2e;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int d = 16 * ks + 8 * j + 2 * cq;
      const float a = gq < G ? q[gq * DH + d] * qscale : 0.f;
      const float b = gq < G ? q[gq * DH + d + 1] * qscale : 0.f;
      split_pair<T>(a, b, qh[ks][j], ql[ks][j]);
    }
  }

  const int t0 = sb.t0, t_end = min(sb.t1, sb.c.len);  // cached tokens of this split
  const int tiles = t_end > t0 ? (t_end - t0 + L::kTokens - 1) / L::kTokens : 0;
  const int64_t row0 = sb.bg * dp.max_seq * DH;
  const T* K = static_cast<const T*>(dp.k_cache) + row0;
  const T* V = static_cast<const T*>(dp.v_cache) + row0;
  const uint32_t smem = ptx::smem_addr(kv_stages);
  // Tile `tile`'s K and V rows into stage `stage`; rows past t_end are zero-filled (not
  // read).
  auto load_tile = [&](int tile, int stage) {
    const int first = t0 + tile * L::kTokens;
    const uint32_t base = smem + stage * L::kStageBytes;
#pragma unroll 4
    for (int e = threadIdx.x; e < 2 * L::kTokens * L::kChunks; e += L::kThreads) {
      const int kv = e / (L::kTokens * L::kChunks), rest = e % (L::kTokens * L::kChunks);
      const int row = rest / L::kChunks, chunk = rest % L::kChunks;
      const bool ok = first + row < t_end;
      const T* src = (kv ? V : K) + static_cast<int64_t>(ok ? first + row : t0) * DH + chunk * 8;
      cp_async_16(base + (kv * L::kTokens + row) * L::kRowBytes + chunk * 16, src, ok ? 16 : 0);
    }
  };
#pragma unroll
  for (int s = 0; s < L::kStages - 1; ++s) {
    if (s < tiles) load_tile(s, s);
    cp_async_commit();
  }

  float o[KS][4];  // O^T fragments: dims 16 mt + gq (+ 8), heads 2 cq, 2 cq + 1
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // heads 2 cq, 2 cq + 1

  for (int i = 0; i < tiles; ++i) {
    cp_async_wait<L::kStages - 2>();
    __syncthreads();  // tile i landed for every thread; tile i - 1's stage is free
    if (i + L::kStages - 1 < tiles) load_tile(i + L::kStages - 1, (i + L::kStages - 1) % L::kStages);
    cp_async_commit();
    const uint32_t kb = smem + (i % L::kStages) * L::kStageBytes + 16 * warp * L::kRowBytes;
    const uint32_t vb = kb + L::kTokens * L::kRowBytes;

    float s[4] = {0.f, 0.f, 0.f, 0.f};  // S^T: tokens gq, gq + 8 x heads 2 cq, 2 cq + 1
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t a[4];
      ldsm_x4(a, kb + ((lane & 7) + ((lane >> 3) & 1) * 8) * L::kRowBytes + (2 * ks + (lane >> 4)) * 16);
      mma16816<T>(s, a, qh[ks][0], qh[ks][1]);
      mma16816<T>(s, a, ql[ks][0], ql[ks][1]);
    }
    const int tok = t0 + i * L::kTokens + 16 * warp + gq;
    if (tok >= t_end) s[0] = s[1] = -INFINITY;
    if (tok + 8 >= t_end) s[2] = s[3] = -INFINITY;

    // Online softmax per head over the warp's 16 tokens (lanes of one cq share heads).
    float x0 = fmaxf(s[0], s[2]), x1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
    }
    const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
    const float u0 = n0 == -INFINITY ? 0.f : n0, u1 = n1 == -INFINITY ? 0.f : n1;  // no inf - inf
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
    // P^T as the B operand (tokens 2 cq + {0, 1} (+ 8) of head gq), high and low parts.
    uint32_t ph0, pl0, ph1, pl1;
    split_pair<T>(p0, p1, ph0, pl0);
    split_pair<T>(p2, p3, ph1, pl1);
    ph0 = transpose_fragment(ph0);
    pl0 = transpose_fragment(pl0);
    ph1 = transpose_fragment(ph1);
    pl1 = transpose_fragment(pl1);
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      uint32_t a[4];
      ldsm_x4_trans(a, vb + ((lane & 7) + (lane >> 4) * 8) * L::kRowBytes + (2 * mt + ((lane >> 3) & 1)) * 16);
      mma16816<T>(o[mt], a, ph0, ph1);
      mma16816<T>(o[mt], a, pl0, pl1);
    }
  }
  cp_async_wait<0>();
  ptx::griddep_launch_dependents();

  // The warp's state -> warp_states[warp][head][DH + 2] = (o..., m, l), heads < G.
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
      const int d = 16 * mt + gq + 8 * r;
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
