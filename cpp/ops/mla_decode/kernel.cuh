// The CUDA kernels of mla_decode's latent attention (params.h has the math).
//
// Split kernel: one block per (token split, 16-head tile, row), 4 warps. The heads are the
// M dimension of m16n8k16 mma.sync, so every cache token is read once for 16 heads (all of
// DeepSeek-V2-Lite's; V2's 128 heads are 8 tiles whose re-reads of a token hit L2). Per
// 32-token stage, the next stage's cp.async loads in flight (2 stages, both issued at the
// split's start; 2 blocks/SM):
//   S = Q K^T     [16 heads x 32 tokens] over E = r + dr, the k-steps split between the
//                 warps (warp w: k-steps w, w + 4, ...; its Q fragments stay in registers,
//                 so the stage is read from shared memory once); the four partial S summed
//                 through shared memory in warp order, every warp then holding all of S
//   online softmax in the exp2 domain, in registers (the same in every warp); P becomes
//                 the A fragments of the next mma directly
//   O += P V      [16 heads x r], warp w the columns w r/4..: B = the stage's rows
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
  static constexpr int kKSteps = kRowElems / 16;                // k-steps of S (used or not)
  static constexpr int kKStepsPerWarp = (kKSteps + kWarps - 1) / kWarps;
  static constexpr int kSStride = kTokens + 8;                    // partial-S row (floats)
  static constexpr int kQBytes = kHeads * kRowBytes;
  static constexpr int kStageBytes = kTokens * kRowBytes;
  static constexpr int kSBytes = kWarps * kHeads * kSStride * 4;  // the warps' partial S
  static constexpr size_t kSmemBytes = kQBytes + kStages * kStageBytes + kSBytes;
  static constexpr int kQItems = (kHeads * kRowElems / 8 + kThreads - 1) / kThreads;  // per thread, at most
  static_assert(kRowBytes % 128 == 0 && kNT % 2 == 0 && kTokens == 32, "tile shapes");
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
  // k-steps of S: used k-step u -> shared k-step index (two chunks each).
  __device__ int ksteps() const { return count() / 2; }
  template <int RT>
  __device__ int shared_kstep(int u) const { return u < lat / 2 ? u : RT / 16 + (u - lat / 2); }
  // Shared chunk -> feature of the token row (E = rank + rope_dim), or -1 for padding.
  template <int RT>
  __device__ static int feature(int chunk, int rank, int rope_dim) {
    if (chunk < RT / 8) return 8 * chunk < rank ? 8 * chunk : -1;
    const int f = 8 * (chunk - RT / 8);
    return f < rope_dim ? rank + f : -1;
  }
};

// Whether row b may run: its length in range and, paged, every used block in the pool.
// Every thread of the block calls it (a block-wide vote). A thread's block-table loads go
// out kBatch at a time: one round trip for up to kBatch x kThreads blocks (a row of 32768
// slots in 64-token pages has 512), not one per kThreads.
template <int kThreads>
__device__ __forceinline__ bool mla_row_valid_block(const MlaDecodeParams& p, int b, int length) {
  constexpr int kBatch = 8;
  bool ok = length >= 0 && length < p.capacity;
  if (ok && p.paged) {
    const int used = length / static_cast<int>(p.page_size) + 1;
    const int32_t* table = p.block_table + static_cast<int64_t>(b) * p.max_blocks;
    for (int i0 = threadIdx.x; i0 < used; i0 += kBatch * kThreads) {
      int32_t page[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) page[j] = i0 + j * kThreads < used ? table[i0 + j * kThreads] : 0;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) ok &= mla_decode_page_valid(p, page[j]);
    }
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
  float* s_part = reinterpret_cast<float*>(kv_s + L::kStages * L::kStageBytes);

  const int split = blockIdx.x, h0 = blockIdx.y * L::kHeads, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3;
  const int H = static_cast<int>(p.num_heads), R = static_cast<int>(p.rank);
  const int DR = static_cast<int>(p.rope_dim), E = R + DR;
  const int S = static_cast<int>(p.splits);
  T* out = static_cast<T*>(p.out);
  T* cache = static_cast<T*>(p.cache);

  ptx::griddep_wait();  // q, new_latent and the cache come from the previous kernels
  const int length = p.lengths[b];
  const bool in_range = length >= 0 && length < p.capacity;
  const int n_tok = length + 1;
  const int per = ((n_tok + S - 1) / S + L::kTokens - 1) / L::kTokens * L::kTokens;
  const int t0 = split * per, t1 = min(n_tok, t0 + per);
  const int tiles = in_range && t1 > t0 ? (t1 - t0 + L::kTokens - 1) / L::kTokens : 0;
  const bool writes_token = in_range && t0 <= length && length < t1;

  // Thread tid loads row tid / 4 of a stage, used chunks tid % 4, + 4, ... A paged row's
  // page is looked up with a page outside the pool read as page 0: the stages can then be
  // issued before the row's validity is known (its block-table round trip hides under
  // them), and an invalid row, which only ever gets NaN, reads inside the pool.
  const int ld_row = tid >> 2, ld_sub = tid & 3;
  auto row_of = [&](int tile) -> int64_t {  // the cache row of this thread's row of a tile
    const int t = t0 + tile * L::kTokens + ld_row;
    return tile >= tiles || t >= t1 ? -1 : mla_decode_slot_offset(p, b, t);
  };
  const MlaChunks used(R, DR);
  auto load_stage = [&](int64_t cache_row, int stage) {  // cache_row < 0: past the split
    const bool ok = cache_row >= 0;
    const T* row = ok ? cache + cache_row * E : cache;
    const uint32_t base = ptx::smem_addr(kv_s + stage * L::kStageBytes);
    for (int u = ld_sub; u < used.count(); u += 4) {
      const int c = used.shared_chunk<RT>(u);
      const int f = MlaChunks::feature<RT>(c, R, DR);
      const bool real = ok && f >= 0;
      cp_async_16(base + swz(ld_row, c, L::kRowBytes), real ? row + f : row, real ? 16u : 0u);
    }
  };
  // Every stage in flight from the start (a 64-token split is two stages: both HBM round
  // trips overlap), and before Q, whose L2 round trip then hides under them; a stage's
  // buffer is refilled kStages tiles ahead once it is read. The split holding the step's
  // token issues them once the token is in its slot.
  auto issue_first_stages = [&]() {
#pragma unroll
    for (int st = 0; st < L::kStages; ++st) {
      if (st < tiles) load_stage(row_of(st), st);
      cp_async_commit();
    }
  };
  // A row's validity is a block-wide vote (block-table loads when paged); an invalid row
  // only gets NaN. The split holding the step's token votes before it writes anything; the
  // others once their stages and Q's loads are issued, so that the three round trips
  // overlap.
  auto leave_invalid = [&]() {
    cp_async_wait<0>();  // nothing may land in shared memory after the block has left
    ptx::griddep_launch_dependents();
    if (S == 1) {  // else the merge kernel writes the NaN row
      for (int i = tid; i < L::kHeads * R; i += L::kThreads) {
        const int h = h0 + i / R;
        if (h < H) out[(static_cast<int64_t>(b) * H + h) * R + i % R] = T(NAN);
      }
    }
  };
  if (writes_token) {  // the step's token into its slot, before it is streamed
    if (!mla_row_valid_block<L::kThreads>(p, b, length)) {
      leave_invalid();
      return;
    }
    // Every element loaded before the first store: one round trip instead of one per
    // element (the compiler cannot move a load above a store that may alias it).
    T* dst = cache + mla_decode_slot_offset(p, b, length) * E;
    constexpr int kPer = (L::kRowElems + L::kThreads - 1) / L::kThreads;  // E <= kRowElems
    float v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = tid + i * L::kThreads;
      v[i] = e < E ? p.new_latent[static_cast<int64_t>(b) * E + e] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = tid + i * L::kThreads;
      if (e < E) dst[e] = T(v[i]);
    }
    __threadfence();
    __syncthreads();  // (block-uniform) written for every thread that streams it
  }
  issue_first_stages();
  int64_t refill_row = row_of(L::kStages);  // looked up a tile before it is needed

  // Q: 16 heads x used chunks, rounded to T; padding and heads past H are zero. Every
  // thread's loads are issued before the first store (one L2 round trip, not one per item).
  {
    const int items = L::kHeads * used.count();
    float4 qv[L::kQItems][2];
#pragma unroll
    for (int j = 0; j < L::kQItems; ++j) {
      const int i = tid + j * L::kThreads;
      const int h = i / used.count(), c = used.shared_chunk<RT>(i % used.count());
      const int f = MlaChunks::feature<RT>(c, R, DR);
      qv[j][0] = qv[j][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (i < items && f >= 0 && h0 + h < H) {
        const float4* src = reinterpret_cast<const float4*>(p.q + (static_cast<int64_t>(b) * H + h0 + h) * E + f);
        qv[j][0] = src[0];  // E and f are multiples of 8: 32-byte aligned
        qv[j][1] = src[1];
      }
    }
    if (!writes_token && !mla_row_valid_block<L::kThreads>(p, b, length)) {
      leave_invalid();
      return;
    }
#pragma unroll
    for (int j = 0; j < L::kQItems; ++j) {
      const int i = tid + j * L::kThreads;
      if (i >= items) break;
      const int h = i / used.count(), c = used.shared_chunk<RT>(i % used.count());
      const float4 a = qv[j][0], c4 = qv[j][1];
      *reinterpret_cast<uint4*>(q_s + swz(h, c, L::kRowBytes)) =
          make_uint4(pack2<T>(a.x, a.y), pack2<T>(a.z, a.w), pack2<T>(c4.x, c4.y), pack2<T>(c4.z, c4.w));
    }
  }
  __syncthreads();  // Q staged

  float o[L::kNT][4];
#pragma unroll
  for (int nt = 0; nt < L::kNT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows gq, gq + 8
  const float qk_scale = p.scale * 1.4426950408889634f;
  // This warp's k-steps of S (w, w + 4, ...) and their Q fragments, in registers for good.
  uint32_t qa[L::kKStepsPerWarp][4];
#pragma unroll
  for (int i = 0; i < L::kKStepsPerWarp; ++i) {
    const int u = warp + L::kWarps * i;
    if (u < used.ksteps()) {
      ldsm_x4(qa[i], ptx::smem_addr(q_s) + swz(lane & 15, 2 * used.shared_kstep<RT>(u) + (lane >> 4), L::kRowBytes));
    }
  }
  for (int tile = 0; tile < tiles; ++tile) {
    cp_async_wait<L::kStages - 1>();
    __syncthreads();  // this tile's stage landed for every thread
    const uint32_t kv_base = ptx::smem_addr(kv_s + (tile % L::kStages) * L::kStageBytes);
    const int first = t0 + tile * L::kTokens;

    // This warp's share of S over all 32 tokens (4 n-tiles, independent accumulators).
    float acc[4][4] = {};
#pragma unroll
    for (int i = 0; i < L::kKStepsPerWarp; ++i) {
      const int u = warp + L::kWarps * i;
      if (u >= used.ksteps()) break;
      const int ks = used.shared_kstep<RT>(u);
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        uint32_t kb[4];
        ldsm_x4(kb, kv_base + swz(16 * pair + (lane & 7) + 8 * (lane >> 4), 2 * ks + ((lane >> 3) & 1),
                                  L::kRowBytes));
        mma16816<T>(acc[2 * pair], qa[i], kb[0], kb[1]);
        mma16816<T>(acc[2 * pair + 1], qa[i], kb[2], kb[3]);
      }
    }
    float* mine = s_part + warp * L::kHeads * L::kSStride;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      *reinterpret_cast<float2*>(mine + gq * L::kSStride + 8 * nt + 2 * cq) = make_float2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<float2*>(mine + (gq + 8) * L::kSStride + 8 * nt + 2 * cq) =
          make_float2(acc[nt][2], acc[nt][3]);
    }
    __syncthreads();
    // All of S in every warp: the partials summed in warp order (the same bits everywhere).
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int w = 0; w < L::kWarps; ++w) {
        const float* part = s_part + w * L::kHeads * L::kSStride + 8 * nt + 2 * cq;
        const float2 lo = *reinterpret_cast<const float2*>(part + gq * L::kSStride);
        const float2 hi = *reinterpret_cast<const float2*>(part + (gq + 8) * L::kSStride);
        s[nt][0] += lo.x, s[nt][1] += lo.y, s[nt][2] += hi.x, s[nt][3] += hi.y;
      }
      const int tok = first + 8 * nt + 2 * cq;
#pragma unroll
      for (int j = 0; j < 4; ++j) s[nt][j] = tok + (j & 1) < t1 ? s[nt][j] * qk_scale : -INFINITY;
    }

    // Online softmax of rows gq (s[.][0..1]) and gq + 8 (s[.][2..3]).
    float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      x0 = fmaxf(x0, fmaxf(s[nt][0], s[nt][1]));
      x1 = fmaxf(x1, fmaxf(s[nt][2], s[nt][3]));
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
    }
    const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
    const float u0 = n0 == -INFINITY ? 0.f : n0, u1 = n1 == -INFINITY ? 0.f : n1;
    const float a0 = exp2f(m0 - u0), a1 = exp2f(m1 - u1);
    m0 = n0;
    m1 = n1;
    float z0 = 0.f, z1 = 0.f;
    uint32_t pa[2][4];  // P as the A fragments of the two 16-token k-steps of P V
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float p0 = exp2f(s[nt][0] - u0), p1 = exp2f(s[nt][1] - u0);
      const float p2 = exp2f(s[nt][2] - u1), p3 = exp2f(s[nt][3] - u1);
      z0 += p0 + p1;
      z1 += p2 + p3;
      pa[nt >> 1][(nt & 1) * 2] = pack2<T>(p0, p1);
      pa[nt >> 1][(nt & 1) * 2 + 1] = pack2<T>(p2, p3);
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      z0 += __shfl_xor_sync(0xffffffffu, z0, off);
      z1 += __shfl_xor_sync(0xffffffffu, z1, off);
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
#pragma unroll
      for (int np = 0; np < L::kNT / 2; ++np) {
        const int c0 = (warp * L::kWarpCols) / 8 + 2 * np;
        if (8 * c0 >= R) break;  // columns past r: never written out
        uint32_t vb[4];
        ldsm_x4_trans(vb, kv_base + swz(16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1), c0 + (lane >> 4),
                                        L::kRowBytes));
        mma16816<T>(o[2 * np], pa[kk], vb[0], vb[1]);
        mma16816<T>(o[2 * np + 1], pa[kk], vb[2], vb[3]);
      }
    }
    if (tile + L::kStages < tiles) {
      __syncthreads();  // every warp is done with this stage's buffer
      load_stage(refill_row, tile % L::kStages);
      refill_row = row_of(tile + L::kStages + 1);
    }
    cp_async_commit();  // a group per iteration, empty or not: the wait above counts them
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

// out[b, h, c] = the splits' states of (row b, head h) merged in index order; NaN rows for
// invalid rows. Grid (columns / 128, H, B): the splits' weights exp2(m_s - max m) / L once
// per block (warp 0), then one column per thread, the splits summed in index order.
template <typename T>
__global__ void __launch_bounds__(128) mla_decode_merge_kernel(const MlaDecodeParams p) {
  __shared__ float weight[kMlaDecodeMaxSplits];
  const int h = blockIdx.y, b = blockIdx.z, c = blockIdx.x * 128 + threadIdx.x;
  const int R = static_cast<int>(p.rank), S = static_cast<int>(p.splits);
  const int64_t bh = static_cast<int64_t>(b) * p.num_heads + h;
  T* out = static_cast<T*>(p.out) + bh * R;
  // lengths and the block table are the call's inputs, complete before the split kernel
  // passed its own wait: checked while the split kernel drains.
  const bool valid = mla_row_valid_block<128>(p, b, p.lengths[b]);
  ptx::griddep_wait();
  if (!valid) {
    if (c < R) out[c] = T(NAN);
    return;
  }
  const float* st = p.partial + bh * S * (R + 2);
  // 32 splits' loads in flight before their adds (the merge is L2 round trips, one per
  // batch), the first batch issued before the weights so that the two round trips overlap;
  // a split of weight 0 is skipped by a select, so its unwritten state never reaches o,
  // and the sum keeps its index order.
  constexpr int kInFlight = 32;
  float v[kInFlight];
  auto load_batch = [&](int s0) {
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) v[j] = c < R && s0 + j < S ? __ldcg(st + (s0 + j) * (R + 2) + c) : 0.f;
  };
  load_batch(0);
  if (threadIdx.x < 32) {  // warp 0: lane j the splits j, j + 32, ...; fixed shuffle trees
    constexpr int kPerLane = kMlaDecodeMaxSplits / 32;
    const int lane = threadIdx.x;
    float ms[kPerLane], ls[kPerLane];  // every split's (m, l) loaded before the first use
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int s = lane + 32 * j;
      ms[j] = s < S ? __ldcg(st + s * (R + 2) + R) : -INFINITY;
      ls[j] = s < S ? __ldcg(st + s * (R + 2) + R + 1) : 0.f;
    }
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) m = fmaxf(m, ms[j]);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float l = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const float w = ms[j] == -INFINITY ? 0.f : exp2f(ms[j] - m);  // a split without tokens weighs 0
      ms[j] = w;
      l = fmaf(ls[j], w, l);
    }
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (lane + 32 * j < S) weight[lane + 32 * j] = ms[j] / l;
    }
  }
  __syncthreads();
  if (c >= R) return;
  float o = 0.f;
  for (int s0 = 0; s0 < S; s0 += kInFlight) {
    if (s0 > 0) load_batch(s0);
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const float w = s0 + j < S ? weight[s0 + j] : 0.f;
      o = w != 0.f ? fmaf(v[j], w, o) : o;
    }
  }
  out[c] = T(o);
}

}  // namespace jax_cluster
