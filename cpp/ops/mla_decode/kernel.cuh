// The CUDA kernels of mla_decode's latent attention (params.h has the math).
//
// Split kernel: one block per (token split, 16-head tile, row), 4 warps. The heads are the
// M dimension of m16n8k16 mma.sync, so every cache token is read once for 16 heads (all of
// DeepSeek-V2-Lite's; V2's 128 heads are 8 tiles whose re-reads of a token hit L2). Per
// 32-token stage, with the next stage's cp.async loads in flight (2 stages, 2 blocks/SM):
//   S = Q K^T     [16 heads x 32 tokens], warp w the tokens 8w..8w+7, over E = r + dr:
//                 A = Q (shared memory), B = the cache rows (ldmatrix)
//   online softmax in the exp2 domain: tile row maxima and sums exchanged through shared
//                 memory (fixed order), P rounded to 16 bits into shared memory
//   O += P V      [16 heads x r], warp w the columns w r/4..: B = the same cache rows
//                 transposed by ldmatrix.trans (values are the tokens' first r features)
// Shared-memory rows are [latent (padded to RT) | rope (padded to 64)], 128-byte XOR
// swizzled; padding is zero-filled, so r and dr only need to be multiples of 8.
//
// The block whose split holds slot lengths[b] first writes the step's token there (rounded
// to the cache dtype; with several head tiles each writes the same bytes), fences, and then
// streams it like any cached token. With one split the block normalises and writes out;
// otherwise it leaves (o, m, l) and mla_decode_merge_kernel combines the splits in index
// order (no atomics: bitwise reproducible).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "jax_cluster/mma.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/softmax.cuh"
#include "ops/mla_decode/params.h"
#include "ops/mla_decode/slots.h"

namespace jax_cluster {

template <int RT>
struct MlaTile {
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kHeads = kMlaDecodeHeadTile;
  static constexpr int kTokens = kMlaDecodeTileTokens, kStages = 2;
  static constexpr int kRopeCols = kMlaDecodeMaxRopeDim;
  static constexpr int kRowElems = RT + kRopeCols;   // [latent | rope] of one token
  static constexpr int kRowBytes = 2 * kRowElems;    // a multiple of 128 (swz)
  static constexpr int kWarpCols = RT / kWarps;      // O columns of one warp
  static constexpr int kNT = kWarpCols / 8;          // its n8 tiles
  static constexpr int kPStride = kTokens + 8;       // P row (elements): conflict-free ldmatrix
  static constexpr int kQBytes = kHeads * kRowBytes;
  static constexpr int kStageBytes = kTokens * kRowBytes;
  static constexpr int kPBytes = kHeads * kPStride * 2;
  static constexpr size_t kSmemBytes =
      kQBytes + kStages * kStageBytes + kPBytes + 2 * kWarps * kHeads * sizeof(float);
  static_assert(kRowBytes % 128 == 0 && kNT % 2 == 0, "tile shapes");
};

// The used 16-byte chunks of a shared row, in 32-feature steps (pairs of mma k-steps; the
// zero-filled rest of a step is harmless): latent chunks [0, lat), rope [RT / 8, + rope).
struct MlaChunks {
  int lat, rope;
  __device__ MlaChunks(int rank, int rope_dim)
      : lat(4 * ((rank + 31) / 32)), rope(4 * ((rope_dim + 31) / 32)) {}
  __device__ int count() const { return lat + rope; }
  // u-th used chunk -> shared chunk index.
  template <int RT>
  __device__ int shared_chunk(int u) const { return u < lat ? u : RT / 8 + (u - lat); }
  // Shared chunk -> feature of the token row (E = rank + rope_dim), or -1 for padding.
  template <int RT>
  __device__ static int feature(int chunk, int rank, int rope_dim) {
    if (chunk < RT / 8) return 8 * chunk < rank ? 8 * chunk : -1;
    const int f = 8 * (chunk - RT / 8);
    return f < rope_dim ? rank + f : -1;
  }
};

// Whether row b may run: its length in range and, paged, every used block in the pool.
// Every thread of the block calls it (a block-wide vote).
template <int kThreads>
__device__ __forceinline__ bool mla_row_valid_block(const MlaDecodeParams& p, int b, int length) {
  bool ok = length >= 0 && length < p.capacity;
  if (ok && p.paged) {
    for (int i = threadIdx.x; i <= length / p.page_size; i += kThreads) ok &= mla_decode_block_valid(p, b, i);
  }
  return __syncthreads_and(ok) != 0;
}

template <typename T, int RT>
__global__ void __launch_bounds__(MlaTile<RT>::kThreads, 2)
    mla_decode_split_kernel(const MlaDecodeParams p) {
  using L = MlaTile<RT>;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_s = smem;
  unsigned char* kv_s = q_s + L::kQBytes;
  T* p_s = reinterpret_cast<T*>(kv_s + L::kStages * L::kStageBytes);
  float* red_max = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(p_s) + L::kPBytes);
  float* red_sum = red_max + L::kWarps * L::kHeads;

  const int split = blockIdx.x, h0 = blockIdx.y * L::kHeads, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3;
  const int H = static_cast<int>(p.num_heads), R = static_cast<int>(p.rank);
  const int DR = static_cast<int>(p.rope_dim), E = R + DR;
  const int S = static_cast<int>(p.splits);
  T* out = static_cast<T*>(p.out);
  T* cache = static_cast<T*>(p.cache);

  ptx::griddep_wait();  // q, new_latent and the cache come from the previous kernels
  const int length = p.lengths[b];
  if (!mla_row_valid_block<L::kThreads>(p, b, length)) {
    ptx::griddep_launch_dependents();
    if (S == 1) {  // else the merge kernel writes the NaN row
      for (int i = tid; i < L::kHeads * R; i += L::kThreads) {
        const int h = h0 + i / R;
        if (h < H) out[(static_cast<int64_t>(b) * H + h) * R + i % R] = T(NAN);
      }
    }
    return;
  }
  const int n_tok = length + 1;
  const int per = ((n_tok + S - 1) / S + L::kTokens - 1) / L::kTokens * L::kTokens;
  const int t0 = split * per, t1 = min(n_tok, t0 + per);
  const MlaChunks used(R, DR);

  if (t0 <= length && length < t1) {  // the step's token into its slot, before it is streamed
    T* dst = cache + mla_decode_slot_offset(p, b, length) * E;
    for (int e = tid; e < E; e += L::kThreads) dst[e] = T(p.new_latent[static_cast<int64_t>(b) * E + e]);
    __threadfence();
  }
  // Q: 16 heads x used chunks, rounded to T; padding and heads past H are zero.
  for (int i = tid; i < L::kHeads * used.count(); i += L::kThreads) {
    const int h = i / used.count(), c = used.shared_chunk<RT>(i % used.count());
    const int f = MlaChunks::feature<RT>(c, R, DR);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (f >= 0 && h0 + h < H) {
      const float* src = p.q + (static_cast<int64_t>(b) * H + h0 + h) * E + f;
      v = make_uint4(pack2<T>(src[0], src[1]), pack2<T>(src[2], src[3]), pack2<T>(src[4], src[5]),
                     pack2<T>(src[6], src[7]));
    }
    *reinterpret_cast<uint4*>(q_s + swz(h, c, L::kRowBytes)) = v;
  }
  __syncthreads();  // the new token's write (and fence) before any block thread streams it

  // Thread tid loads row tid / 4 of a stage, used chunks tid % 4, + 4, ...
  const int ld_row = tid >> 2, ld_sub = tid & 3;
  auto load_stage = [&](int first, int stage) {
    const int t = first + ld_row;
    const bool ok = t < t1;
    const T* row = ok ? cache + mla_decode_slot_offset(p, b, t) * E : cache;
    const uint32_t base = ptx::smem_addr(kv_s + stage * L::kStageBytes);
    for (int u = ld_sub; u < used.count(); u += 4) {
      const int c = used.shared_chunk<RT>(u);
      const int f = MlaChunks::feature<RT>(c, R, DR);
      const bool real = ok && f >= 0;
      cp_async_16(base + swz(ld_row, c, L::kRowBytes), real ? row + f : row, real ? 16u : 0u);
    }
  };

  float o[L::kNT][4];
#pragma unroll
  for (int nt = 0; nt < L::kNT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows gq, gq + 8
  const float qk_scale = p.scale * 1.4426950408889634f;
  const uint32_t q_base = ptx::smem_addr(q_s), p_base = ptx::smem_addr(p_s);
  const int tiles = t1 > t0 ? (t1 - t0 + L::kTokens - 1) / L::kTokens : 0;

  if (tiles > 0) load_stage(t0, 0);
  cp_async_commit();
  for (int i = 0; i < tiles; ++i) {
    cp_async_wait<0>();
    __syncthreads();  // stage i landed for every thread; stage i - 1 is free
    if (i + 1 < tiles) load_stage(t0 + (i + 1) * L::kTokens, (i + 1) % L::kStages);
    cp_async_commit();
    const uint32_t kv_base = ptx::smem_addr(kv_s + (i % L::kStages) * L::kStageBytes);
    const int first = t0 + i * L::kTokens;

    // S for this warp's 8 tokens: two k-steps per B load (ldmatrix x4).
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    auto score_steps = [&](int ks0, int steps) {
      for (int ks = ks0; ks < ks0 + steps; ks += 2) {
        uint32_t kb[4], qa0[4], qa1[4];
        ldsm_x4(kb, kv_base + swz(8 * warp + (lane & 7), 2 * ks + (lane >> 3), L::kRowBytes));
        ldsm_x4(qa0, q_base + swz(lane & 15, 2 * ks + (lane >> 4), L::kRowBytes));
        ldsm_x4(qa1, q_base + swz(lane & 15, 2 * ks + 2 + (lane >> 4), L::kRowBytes));
        mma16816<T>(s, qa0, kb[0], kb[1]);
        mma16816<T>(s, qa1, kb[2], kb[3]);
      }
    };
    score_steps(0, used.lat / 2);
    score_steps(RT / 16, used.rope / 2);
    const int tok = first + 8 * warp + 2 * cq;
#pragma unroll
    for (int j = 0; j < 4; ++j) s[j] = tok + (j & 1) < t1 ? s[j] * qk_scale : -INFINITY;

    float x0 = fmaxf(s[0], s[1]), x1 = fmaxf(s[2], s[3]);
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
    if (cq == 0) {
      red_max[warp * L::kHeads + gq] = x0;
      red_max[warp * L::kHeads + gq + 8] = x1;
    }
    __syncthreads();
    float n0 = m0, n1 = m1;
#pragma unroll
    for (int w = 0; w < L::kWarps; ++w) {
      n0 = fmaxf(n0, red_max[w * L::kHeads + gq]);
      n1 = fmaxf(n1, red_max[w * L::kHeads + gq + 8]);
    }
    const float u0 = n0 == -INFINITY ? 0.f : n0, u1 = n1 == -INFINITY ? 0.f : n1;
    const float a0 = exp2f(m0 - u0), a1 = exp2f(m1 - u1);
    m0 = n0;
    m1 = n1;
    const float p0 = exp2f(s[0] - u0), p1 = exp2f(s[1] - u0);
    const float p2 = exp2f(s[2] - u1), p3 = exp2f(s[3] - u1);
    *reinterpret_cast<uint32_t*>(p_s + gq * L::kPStride + 8 * warp + 2 * cq) = pack2<T>(p0, p1);
    *reinterpret_cast<uint32_t*>(p_s + (gq + 8) * L::kPStride + 8 * warp + 2 * cq) = pack2<T>(p2, p3);
    float y0 = p0 + p1, y1 = p2 + p3;
    y0 += __shfl_xor_sync(0xffffffffu, y0, 1);
    y1 += __shfl_xor_sync(0xffffffffu, y1, 1);
    y0 += __shfl_xor_sync(0xffffffffu, y0, 2);
    y1 += __shfl_xor_sync(0xffffffffu, y1, 2);
    if (cq == 0) {
      red_sum[warp * L::kHeads + gq] = y0;
      red_sum[warp * L::kHeads + gq + 8] = y1;
    }
    __syncthreads();
    float z0 = 0.f, z1 = 0.f;  // the same order in every warp: the same l everywhere
#pragma unroll
    for (int w = 0; w < L::kWarps; ++w) {
      z0 += red_sum[w * L::kHeads + gq];
      z1 += red_sum[w * L::kHeads + gq + 8];
    }
    l0 = fmaf(l0, a0, z0);
    l1 = fmaf(l1, a1, z1);

    // O (this warp's columns) += P V.
#pragma unroll
    for (int nt = 0; nt < L::kNT; ++nt) {
      o[nt][0] *= a0;
      o[nt][1] *= a0;
      o[nt][2] *= a1;
      o[nt][3] *= a1;
    }
#pragma unroll
    for (int kk = 0; kk < L::kTokens / 16; ++kk) {
      uint32_t pa[4];
      ldsm_x4(pa, p_base + ((lane & 15) * L::kPStride + 16 * kk + 8 * (lane >> 4)) * 2);
#pragma unroll
      for (int np = 0; np < L::kNT / 2; ++np) {
        const int c0 = (warp * L::kWarpCols) / 8 + 2 * np;
        if (8 * c0 >= R) break;  // columns past r: never written out
        uint32_t vb[4];
        ldsm_x4_trans(vb, kv_base + swz(16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1), c0 + (lane >> 4),
                                        L::kRowBytes));
        mma16816<T>(o[2 * np], pa, vb[0], vb[1]);
        mma16816<T>(o[2 * np + 1], pa, vb[2], vb[3]);
      }
    }
  }
  ptx::griddep_launch_dependents();

  // Rows gq, gq + 8 of this warp's columns: normalised into out, or the split's state.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + gq + 8 * r;
    if (h >= H) continue;
    const float m = r ? m1 : m0, l = r ? l1 : l0;
    const int64_t bh = static_cast<int64_t>(b) * H + h;
#pragma unroll
    for (int nt = 0; nt < L::kNT; ++nt) {
      const int c = warp * L::kWarpCols + 8 * nt + 2 * cq;
      if (c >= R) break;
      const float v0 = o[nt][2 * r], v1 = o[nt][2 * r + 1];
      if (S == 1) {
        *reinterpret_cast<uint32_t*>(out + bh * R + c) = pack2<T>(v0 / l, v1 / l);
      } else {
        float* st = p.partial + (bh * S + split) * (R + 2);
        st[c] = v0;
        st[c + 1] = v1;
        if (warp == 0 && nt == 0 && cq == 0) {
          st[R] = m;
          st[R + 1] = l;
        }
      }
    }
  }
}

// out[b, h] = the splits' states of (row b, head h) merged in index order; NaN rows for
// invalid rows. Grid (H, B).
template <typename T>
__global__ void __launch_bounds__(128) mla_decode_merge_kernel(const MlaDecodeParams p) {
  ptx::griddep_wait();
  const int h = blockIdx.x, b = blockIdx.y;
  const int R = static_cast<int>(p.rank), S = static_cast<int>(p.splits);
  const int64_t bh = static_cast<int64_t>(b) * p.num_heads + h;
  T* out = static_cast<T*>(p.out) + bh * R;
  if (!mla_row_valid_block<128>(p, b, p.lengths[b])) {
    for (int c = threadIdx.x; c < R; c += 128) out[c] = T(NAN);
    return;
  }
  const float* st = p.partial + bh * S * (R + 2);
  for (int c = threadIdx.x; c < R; c += 128) {
    out[c] = T(merge_partial_states(
        S, [&](int s) { return st[s * (R + 2) + R]; }, [&](int s) { return st[s * (R + 2) + R + 1]; },
        [&](int s) { return st[s * (R + 2) + c]; }));
  }
}

}  // namespace jax_cluster
