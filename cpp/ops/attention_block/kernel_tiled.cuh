// The batch-tiled form of the register-streaming SplitToken kernel (rows_per_cluster = R > 1).
//
// attention_decode_registers.cuh runs one cluster per (batch row, KV head, head chunk): at
// batch 16 every KV head's W_qkv columns and W_o rows are streamed 16 times. Here one
// cluster of N blocks of 256 threads serves (KV head, head chunk, tile of R batch rows), so
// the weights are read once per tile and every 16-byte weight load feeds R rows:
//   1. every block normalises the tile's R rows of x into shared memory, h [D][R];
//   2. block r computes its share of the group's Q|K|V columns for all R rows (GEMV with R
//      accumulator rows per thread); after a cluster barrier every block pulls the other
//      blocks' columns over DSMEM into the tile's full q|k|v [R][(hpc + 2) Dh];
//   3. RoPE per row at lengths[b]; the new k, v of row i are written by block i % N of
//      head chunk 0;
//   4. the tile's tokens, row after row (each row's cached tokens and its new one), are
//      split evenly over the cluster's blocks: a block's contiguous share spans one or
//      more row segments; per segment the block keeps an online-softmax state (m, l, o)
//      per head. After a cluster barrier every block combines, per row, the states of the
//      blocks whose shares touch that row, in rank order (deterministic), over DSMEM;
//   5. block r multiplies the R attention rows by its W_o column tiles -> R fp32 partial
//      rows; the combine kernel sums the clusters' partials in a fixed order, as for R = 1.
// Rows past the batch (a last partial tile) are zero and produce nothing; a row whose length
// is out of range gets a NaN output and no cache write, like the other kernels.
// Included, after attention_decode_common.cuh and attention_decode_registers.cuh (for
// attend_cached), inside the anonymous namespace of attention_decode_tiled_{f16,bf16}.cu: one
// file per dtype, so the two halves of the instantiations compile in parallel. Needs
// <type_traits>.
#pragma once

static_assert(TiledLayout::kThreads == kBlockThreads && TiledLayout::kWarps == kBlockWarps);

// Blocks per SM the kernel is built for: 2 (128 registers: 4 weight columns per thread in
// the GEMVs, R <= 8) where ptxas fits that without spills, so that clusters of 4 and 8 find
// SMs for one wave (measured, session 8: at one block per SM, 32 clusters of 4 or 16 of 8
// ran as two waves on an H100); else 1. With 4 heads per cluster the softmax state alone
// (72 registers) plus the tile's bookkeeping spilled at 128.
template <int DH, int MH, int R>
constexpr int kTiledMinBlocks = R <= 8 && MH <= 2 && DH % 64 == 0 ? 2 : 1;
// Token steps per warp in flight in attention (attend_cached's U): as many as fit.
template <int DH, int MH, int R>
constexpr int kTiledTokenSteps = kTiledMinBlocks<DH, MH, R> == 2 ? (MH == 1 ? 8 : 4)
                                                                 : MH <= 2 ? 8 : MH == 4 ? 4 : 2;
// Weight columns per load in the GEMVs: 8 (16-byte loads), or 4 (8-byte loads: half the
// accumulators) at two blocks per SM.
template <int DH, int MH, int R>
constexpr int kTiledCols = kTiledMinBlocks<DH, MH, R> == 2 ? 4 : 8;
// Weight loads in flight per thread in the GEMVs: fewer as the accumulators grow.
template <int DH, int MH, int R>
constexpr int kTiledLoads = kTiledMinBlocks<DH, MH, R> == 2 ? (R <= 4 ? 16 : 8) : R <= 4 ? 16 : R == 8 ? 8 : 4;

// How the normalised rows are stored (TiledLayout::h_bytes_per_value): fp32, or the
// activation dtype at R = 16 and at R = 8 with two blocks per SM.
template <typename T, int DH, int MH, int R>
using TiledH = std::conditional_t<(R >= 16 || (R == 8 && kTiledMinBlocks<DH, MH, R> == 2)), T, float>;

// A load of CW weights (16 or 8 bytes) and its values as floats.
template <int CW>
using WeightVec = std::conditional_t<CW == 8, uint4, uint2>;
template <typename T, int CW>
__device__ __forceinline__ WeightVec<CW> load_weights(const T* p) {
  if constexpr (CW == 8) {
    return ptx::ldg_stream(p);
  } else {
    return ptx::ldg_stream8(p);
  }
}
template <typename T>
__device__ __forceinline__ void unpack_weights(const uint4& v, float (&f)[8]) {
  unpack<T>(v, f);
}
template <typename T>
__device__ __forceinline__ void unpack_weights(const uint2& v, float (&f)[4]) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = to_float(e[i]);
}

// The R values vec[r * R .. r * R + R) as floats; rows are 16-byte aligned (R >= 4 for
// fp32, R = 16 for 16-bit values), 8-byte aligned at R = 2.
template <int R, typename V>
__device__ __forceinline__ void load_row_values(const V* vec, int r, float (&s)[R]) {
  if constexpr (std::is_same_v<V, float>) {
    if constexpr (R % 4 == 0) {
#pragma unroll
      for (int k = 0; k < R / 4; ++k) {
        const float4 v = reinterpret_cast<const float4*>(vec + static_cast<int64_t>(r) * R)[k];
        s[4 * k] = v.x;
        s[4 * k + 1] = v.y;
        s[4 * k + 2] = v.z;
        s[4 * k + 3] = v.w;
      }
    } else {
      static_assert(R == 2);
      const float2 v = reinterpret_cast<const float2*>(vec)[r];
      s[0] = v.x;
      s[1] = v.y;
    }
  } else {
    static_assert(R % 8 == 0);
#pragma unroll
    for (int k = 0; k < R / 8; ++k) {
      float f[8];
      unpack<V>(reinterpret_cast<const uint4*>(vec + static_cast<int64_t>(r) * R)[k], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[8 * k + i] = f[i];
    }
  }
}

// out[i][j*8 + c] = sum_r vec[r][i] * W[r * ld + col_of(j) + c] for the R rows i and this
// block's `ncv` 8-column vectors: block_gemv with R accumulator rows, so each weight load is
// used R times. A thread loads CW columns of a row at a time (a "unit": 8 / CW units per
// vector). vec is [rows][R]. Row groups meet in `red` (TiledLayout::kRedRows rows at a
// time) and are summed in a fixed order; emit(i, j, c, value).
template <typename T, int R, int CW, int U, typename V, typename ColOf, typename Emit>
__device__ void block_gemv_rows(const V* vec, int rows, const T* W, int64_t ld, int ncv,
                                ColOf col_of, float* red, Emit emit) {
  constexpr int RP = TiledLayout::kRedRows;
  constexpr int kPer = 8 / CW;  // units per 8-column vector
  static_assert(R % RP == 0 && (CW == 8 || CW == 4));
  const int units = ncv * kPer;
  for (int j0 = 0; j0 < units; j0 += kBlockThreads) {
    const int cu = min(kBlockThreads, units - j0);
    const int groups = kBlockThreads / cu;
    const int jl = threadIdx.x % cu, rg = threadIdx.x / cu;
    float acc[R][CW];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < CW; ++c) acc[i][c] = 0.f;
    if (rg < groups) {
      const int unit = j0 + jl;
      const T* wcol = W + col_of(unit / kPer) + (unit % kPer) * CW;
      int r = rg;
      for (; r + (U - 1) * groups < rows; r += U * groups) {
        WeightVec<CW> w[U];
#pragma unroll
        for (int u = 0; u < U; ++u) w[u] = load_weights<T, CW>(wcol + static_cast<int64_t>(r + u * groups) * ld);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float f[CW], s[R];
          unpack_weights<T>(w[u], f);
          load_row_values<R>(vec, r + u * groups, s);
#pragma unroll
          for (int i = 0; i < R; ++i)
#pragma unroll
            for (int c = 0; c < CW; ++c) acc[i][c] = fmaf(s[i], f[c], acc[i][c]);
        }
      }
      for (; r < rows; r += groups) {
        float f[CW], s[R];
        unpack_weights<T>(load_weights<T, CW>(wcol + static_cast<int64_t>(r) * ld), f);
        load_row_values<R>(vec, r, s);
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
          for (int c = 0; c < CW; ++c) acc[i][c] = fmaf(s[i], f[c], acc[i][c]);
      }
    }
#pragma unroll
    for (int i0 = 0; i0 < R; i0 += RP) {
      __syncthreads();  // `red` free (previous pass consumed)
      if (rg < groups) {
#pragma unroll
        for (int ii = 0; ii < RP; ++ii)
#pragma unroll
          for (int c = 0; c < CW; ++c) red[((ii * groups + rg) * cu + jl) * CW + c] = acc[i0 + ii][c];
      }
      __syncthreads();
      for (int e = threadIdx.x; e < RP * cu * CW; e += kBlockThreads) {
        const int ii = e / (cu * CW), rest = e % (cu * CW);
        float s = 0.f;
        for (int q = 0; q < groups; ++q) s += red[(ii * groups + q) * cu * CW + rest];
        const int unit = j0 + rest / CW;
        emit(i0 + ii, unit / kPer, (unit % kPer) * CW + rest % CW, s);
      }
    }
  }
  __syncthreads();
}

// Per tile row: what it is (kPad: past the batch; kBadLength: NaN output, nothing written)
// and where its tokens sit in the tile's row-after-row token sequence.
enum RowStatus : int { kPad = 0, kValid = 1, kBadLength = 2 };
template <int R>
struct TileRows {
  int status[R];
  int len[R];
  int off[R + 1];  // row i's tokens (cached and the new one): [off[i], off[i + 1])
};

// h[d][i] = norm(x[b0 + i])[d] for the tile's rows (zero for padding rows).
template <typename T, int R, typename HT>
__device__ void normalize_rows(const AttentionDecodeParams& p, int64_t b0, const TileRows<R>& rows,
                               HT* h) {
  __shared__ float stats[R][2][kBlockWarps];
  __shared__ float row_scale[R], row_mean[R];
  const T* x = static_cast<const T*>(p.x);
  const int warp = threadIdx.x / 32;
  if (p.norm != NormKind::kNone) {
    float sum[R], sq[R];
#pragma unroll
    for (int i = 0; i < R; ++i) sum[i] = sq[i] = 0.f;
    for (int64_t d = threadIdx.x; d < p.hidden; d += kBlockThreads) {
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (rows.status[i] == kPad) continue;
        const float v = to_float(x[(b0 + i) * p.hidden + d]);
        sum[i] += v;
        sq[i] += v * v;
      }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], off);
        sq[i] += __shfl_xor_sync(0xffffffffu, sq[i], off);
      }
      if ((threadIdx.x & 31) == 0) {
        stats[i][0][warp] = sum[i];
        stats[i][1][warp] = sq[i];
      }
    }
    __syncthreads();
    if (threadIdx.x < R) {
      const int i = threadIdx.x;
      float tsum = 0.f, tsq = 0.f;
      for (int w = 0; w < kBlockWarps; ++w) {
        tsum += stats[i][0][w];
        tsq += stats[i][1][w];
      }
      const float inv_d = 1.f / static_cast<float>(p.hidden);
      if (p.norm == NormKind::kRms) {
        row_mean[i] = 0.f;
        row_scale[i] = rsqrtf(tsq * inv_d + p.eps);
      } else {
        const float mean = tsum * inv_d;
        row_mean[i] = mean;
        row_scale[i] = rsqrtf(fmaxf(tsq * inv_d - mean * mean, 0.f) + p.eps);
      }
    }
    __syncthreads();
  }
  const T* wn = static_cast<const T*>(p.norm_w);
  const T* bn = static_cast<const T*>(p.norm_b);
  for (int64_t d = threadIdx.x; d < p.hidden; d += kBlockThreads) {
    const float w = p.norm == NormKind::kNone ? 1.f : to_float(wn[d]);
    const float bias = p.norm == NormKind::kLayer ? to_float(bn[d]) : 0.f;
    HT* out = h + d * R;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      float v = 0.f;
      if (rows.status[i] != kPad) {
        v = to_float(x[(b0 + i) * p.hidden + d]);
        if (p.norm == NormKind::kRms) v = v * row_scale[i] * w;
        if (p.norm == NormKind::kLayer) v = (v - row_mean[i]) * row_scale[i] * w + bias;
      }
      out[i] = from_float<HT>(v);
    }
  }
  __syncthreads();
}

// The block's state for one row segment: the warps' states (warp_states, from
// attend_cached) and, if it is in the segment, the new token, combined per head in a fixed
// order -> state [head][stride] = (o[DH] scaled to the block max m, m, l).
template <int DH>
__device__ void block_row_state(const AttentionDecodeParams& p, int hpc, const float* qkv,
                                bool has_new, const float* warp_states, float* state,
                                int stride) {
  merge_warp_states_each<DH, kBlockThreads, kBlockWarps, kMaxH>(
      hpc, has_new, p.scale * kLog2e, qkv, warp_states,
      [&](int head, int i, float acc, float mm) {
        float* st = state + head * stride;
        if (i < DH) {
          st[i] = acc;
        } else {
          st[DH] = mm;
          st[DH + 1] = acc;
        }
      },
      [] { __syncthreads(); });
  __syncthreads();  // warp_states and s_new free for the next segment
}

template <typename T, int DH, int MH, int R>
__global__ void __launch_bounds__(kBlockThreads, kTiledMinBlocks<DH, MH, R>)
    attention_decode_tiled_kernel(const AttentionDecodeParams p) {
  using HT = TiledH<T, DH, MH, R>;
  constexpr int CW = kTiledCols<DH, MH, R>, UW = kTiledLoads<DH, MH, R>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ TileRows<R> rows;
  const int hpc = static_cast<int>(p.heads_per_cluster());
  const int n = p.cluster_size;
  const TiledLayout L(p.hidden, R, hpc, DH, n);
  HT* h = reinterpret_cast<HT*>(smem + L.h_off);
  float* states = reinterpret_cast<float*>(smem + L.states_off);
  float* warp_states = reinterpret_cast<float*>(smem + L.warp_off);
  float* attn = reinterpret_cast<float*>(smem + L.attn_off);
  float* coef = reinterpret_cast<float*>(smem + L.coef_off);
  float* slice = reinterpret_cast<float*>(smem + L.slice_off);
  float* qkv = reinterpret_cast<float*>(smem + L.qkv_off);
  float* red = qkv;  // the GEMVs' scratch: q|k|v is not live during either GEMV

  // Cluster -> (tile, KV head g, head chunk), the tile fastest: resident clusters share a
  // KV head's weights in L2.
  const int64_t tiles = p.row_tiles();
  const int64_t cluster = blockIdx.x / n, rest = cluster / tiles;
  Ctx c;  // b: the tile's first row; len unused
  c.rank = static_cast<int>(ptx::cluster_rank());
  c.b = (cluster % tiles) * R;
  c.chunk = rest % p.head_chunks();
  c.g = rest / p.head_chunks();
  c.len = 0;
  const int64_t b0 = c.b;
  if (threadIdx.x == 0) {
    int off = 0;
    for (int i = 0; i < R; ++i) {
      const int len = b0 + i < p.batch ? p.lengths[b0 + i] : -1;
      rows.status[i] = b0 + i >= p.batch ? kPad : len >= 0 && len < p.max_seq ? kValid : kBadLength;
      rows.len[i] = len;
      rows.off[i] = off;
      off += rows.status[i] == kValid ? len + 1 : 0;
    }
    rows.off[R] = off;
  }

  const int first_vec = c.rank * L.vecs_per_blk;
  const int my_vecs = max(0, min(L.vecs_per_blk, L.qkv_vecs - first_vec));
  const int seg = L.vecs_per_blk * 8;  // floats per row of a block's slice
  const T* wqkv = static_cast<const T*>(p.w_qkv);
  const int64_t qkv_ld = (p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim;
  const T* wo = static_cast<const T*>(p.w_o) + (c.g * p.group() + c.chunk * hpc) * DH * p.hidden;
  for (int v = first_vec, end = first_vec + my_vecs; v < end;) {  // as the R = 1 kernel
    const int bound = v < hpc * DH / 8 ? hpc * DH / 8 : v < (hpc + 1) * DH / 8 ? (hpc + 1) * DH / 8
                                                                               : end;
    const int run_end = min(end, bound);
    prefetch_rows(wqkv + qkv_column(p, c, hpc, static_cast<int64_t>(v) * 8), qkv_ld,
                  static_cast<int>(p.hidden), static_cast<int64_t>(run_end - v) * 16);
    v = run_end;
  }
  __syncthreads();  // rows
  normalize_rows<T, R>(p, b0, rows, h);

  // 2. QKV projection of this block's columns for the R rows, then every block pulls the
  // whole q|k|v of the tile.
  const T* qkv_bias = static_cast<const T*>(p.qkv_bias);
  block_gemv_rows<T, R, CW, UW>(
      h, static_cast<int>(p.hidden), wqkv, qkv_ld, my_vecs,
      [&](int j) { return qkv_column(p, c, hpc, static_cast<int64_t>(first_vec + j) * 8); }, red,
      [&](int i, int j, int col, float v) {
        if (p.has_qkv_bias) {
          v += to_float(qkv_bias[qkv_column(p, c, hpc, static_cast<int64_t>(first_vec + j) * 8 + col)]);
        }
        slice[i * seg + j * 8 + col] = v;
      });
  const int total = rows.off[R];
  const int per_block = (total + n - 1) / n;  // tokens of the tile per block
  const int share0 = min(total, c.rank * per_block), share1 = min(total, share0 + per_block);
  // The L2 prefetch of this block's first cached K and V tokens of row i's segment.
  auto prefetch_segment = [&](int i) {
    if (i >= R || rows.status[i] != kValid || threadIdx.x >= 2) return;
    const int lo = max(rows.off[i], share0) - rows.off[i];
    const int hi = min(min(rows.off[i + 1], share1) - rows.off[i], rows.len[i]);
    if (lo >= hi) return;
    const T* cache = static_cast<const T*>(threadIdx.x == 0 ? p.k_cache : p.v_cache);
    const int64_t bytes = static_cast<int64_t>(hi - lo) * DH * sizeof(T);
    ptx::prefetch_l2(cache + (((b0 + i) * p.num_kv_heads + c.g) * p.max_seq + lo) * DH,
                     static_cast<uint32_t>(bytes < kPrefetchBytes ? bytes : kPrefetchBytes));
  };
  int first_row = 0;  // the first row with tokens in this block's share
  while (first_row < R && rows.off[first_row + 1] <= share0) ++first_row;
  prefetch_segment(first_row);
  ptx::cluster_sync();  // every block's slice written

  const int qs = (hpc + 2) * DH;  // floats per row of q|k|v
  const uint32_t slice_addr = ptx::smem_addr(slice);
  for (int e = threadIdx.x; e < R * L.qkv_vecs * 2; e += kBlockThreads) {  // 16-byte halves
    const int i = e / (L.qkv_vecs * 2), v = (e / 2) % L.qkv_vecs, half = e & 1;
    const int owner = v / L.vecs_per_blk;
    const uint32_t src = ptx::map_to_rank(slice_addr, owner) +
                         4u * static_cast<uint32_t>(i * seg + (v - owner * L.vecs_per_blk) * 8 + half * 4);
    *reinterpret_cast<float4*>(qkv + i * qs + v * 8 + half * 4) = ptx::ld_cluster_f32x4(src);
  }
  __syncthreads();

  // 3. RoPE per row, the new k, v rounded to the cache dtype and written.
  for (int i = 0; i < R; ++i) {
    rope_and_round_kv<T>(p, qkv + i * qs, hpc, rows.status[i] == kValid ? rows.len[i] : 0,
                         ThreadGroup::block());
  }
  __syncthreads();
  for (int i = 0; i < R; ++i) {
    if (rows.status[i] != kValid || c.chunk != 0 || i % n != c.rank) continue;
    const int64_t at = (((b0 + i) * p.num_kv_heads + c.g) * p.max_seq + rows.len[i]) * DH;
    for (int e = threadIdx.x; e < DH; e += kBlockThreads) {
      static_cast<T*>(p.k_cache)[at + e] = from_float<T>(qkv[i * qs + hpc * DH + e]);
      static_cast<T*>(p.v_cache)[at + e] = from_float<T>(qkv[i * qs + (hpc + 1) * DH + e]);
    }
  }

  // 4. Attention over this block's share of the tile's tokens, segment by segment.
  for (int i = first_row; i < R; ++i) {
    const int lo = max(rows.off[i], share0), hi = min(rows.off[i + 1], share1);
    if (lo >= hi) {
      if (rows.off[i] >= share1) break;  // past the share
      continue;
    }
    prefetch_segment(i + 1);
    const int t0 = lo - rows.off[i], t1 = hi - rows.off[i], len = rows.len[i];
    Ctx rc = c;
    rc.b = b0 + i;
    rc.len = len;
    attend_cached<T, DH, MH, kTiledTokenSteps<DH, MH, R>>(p, rc, hpc, qkv + i * qs, t0, min(t1, len),
                                                       warp_states);
    block_row_state<DH>(p, hpc, qkv + i * qs, t0 <= len && len < t1, warp_states,
                        states + i * hpc * L.state_stride, L.state_stride);
  }
  const OutputSlice out = output_slice(p, c);
  prefetch_rows(wo + out.first * 8, p.hidden, hpc * DH, static_cast<int64_t>(out.count) * 16);
  ptx::cluster_sync();  // every block's row states written

  // Per row: the states of the blocks whose shares touch it, in rank order.
  const uint32_t states_addr = ptx::smem_addr(states);
  constexpr int kCoef = TiledLayout::kMaxClusterBlocks + 1;  // weights per block, then 1 / l
  for (int e = threadIdx.x; e < R * hpc; e += kBlockThreads) {
    const int i = e / hpc;
    if (rows.status[i] != kValid) continue;
    const int k0 = rows.off[i] / per_block, k1 = (rows.off[i + 1] - 1) / per_block;
    const uint32_t st = states_addr + 4u * static_cast<uint32_t>(e * L.state_stride + DH);
    float m = -INFINITY;
    for (int k = k0; k <= k1; ++k) m = fmaxf(m, ptx::ld_cluster_f32(ptx::map_to_rank(st, k)));
    float l = 0.f;
    for (int k = k0; k <= k1; ++k) {
      const uint32_t at = ptx::map_to_rank(st, k);
      const float mk = ptx::ld_cluster_f32(at);
      const float w = mk == -INFINITY ? 0.f : exp2f(mk - m);
      l += ptx::ld_cluster_f32(at + 4) * w;
      coef[e * kCoef + (k - k0)] = w;
    }
    coef[e * kCoef + TiledLayout::kMaxClusterBlocks] = 1.f / l;
  }
  __syncthreads();
  constexpr int kVecs = DH / 4;  // float4 of a head's o
  for (int e = threadIdx.x; e < R * hpc * kVecs; e += kBlockThreads) {
    const int ih = e / kVecs, d = (e % kVecs) * 4;  // ih = row * hpc + head
    const int i = ih / hpc, head = ih % hpc;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (rows.status[i] == kValid) {
      const int k0 = rows.off[i] / per_block, k1 = (rows.off[i + 1] - 1) / per_block;
      const uint32_t st = states_addr + 4u * static_cast<uint32_t>(ih * L.state_stride + d);
      const float* cf = coef + ih * kCoef;
      for (int k = k0; k <= k1; ++k) {
        const float4 v = ptx::ld_cluster_f32x4(ptx::map_to_rank(st, k));
        const float w = cf[k - k0];
        o.x = fmaf(v.x, w, o.x);
        o.y = fmaf(v.y, w, o.y);
        o.z = fmaf(v.z, w, o.z);
        o.w = fmaf(v.w, w, o.w);
      }
      const float inv_l = cf[TiledLayout::kMaxClusterBlocks];
      o.x *= inv_l;
      o.y *= inv_l;
      o.z *= inv_l;
      o.w *= inv_l;
    }
    float* a = attn + (head * DH + d) * R + i;  // [hpc Dh][R]
    a[0] = o.x;
    a[R] = o.y;
    a[2 * R] = o.z;
    a[3 * R] = o.w;
  }
  ptx::cluster_arrive();  // done reading the peers' shared memory; they may exit after the GEMV
  __syncthreads();

  // 5. Output projection: this block's W_o column tiles for the R rows.
  block_gemv_rows<T, R, CW, UW>(
      attn, hpc * DH, wo, p.hidden, out.count,
      [&](int j) { return static_cast<int64_t>(out.first + j) * 8; }, red,
      [&](int i, int j, int col, float v) {
        if (rows.status[i] == kPad) return;
        float* row = p.partial + (((b0 + i) * p.num_kv_heads + c.g) * p.head_chunks() + c.chunk) * p.hidden;
        row[(out.first + j) * 8 + col] = rows.status[i] == kValid ? v : NAN;
      });
  ptx::cluster_wait();  // no block exits while a peer may still read its slice or states
}

template <typename T, int DH, int MH, int R>
cudaError_t launch_tiled(const AttentionDecodeParams& p, cudaStream_t stream) {
  const TiledLayout L(p.hidden, R, static_cast<int>(p.heads_per_cluster()), DH, p.cluster_size);
  if (L.bytes > kMaxSharedBytesPerBlock - 2048) return cudaErrorInvalidConfiguration;  // static: <= 1.4 KB
  const int64_t clusters = p.row_tiles() * p.num_kv_heads * p.head_chunks();
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_cluster(
      attention_decode_tiled_kernel<T, DH, MH, R>,
      dim3(static_cast<unsigned>(clusters * p.cluster_size)), dim3(kBlockThreads),
      static_cast<size_t>(L.bytes), p.cluster_size, stream, p));
  return launch_combine<T>(p, stream);
}

template <typename T, int DH, int MH>
cudaError_t launch_tiled_rows(const AttentionDecodeParams& p, cudaStream_t stream) {
  switch (p.rows_per_cluster) {
    case 2: return launch_tiled<T, DH, MH, 2>(p, stream);
    case 4: return launch_tiled<T, DH, MH, 4>(p, stream);
    case 8: return launch_tiled<T, DH, MH, 8>(p, stream);
    case 16: return launch_tiled<T, DH, MH, 16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T, int DH>
cudaError_t launch_tiled_heads(const AttentionDecodeParams& p, cudaStream_t stream) {
  const int64_t hpc = p.heads_per_cluster();
  if (hpc == 1) return launch_tiled_rows<T, DH, 1>(p, stream);
  if (hpc == 2) return launch_tiled_rows<T, DH, 2>(p, stream);
  if (hpc <= 4) return launch_tiled_rows<T, DH, 4>(p, stream);
  return launch_tiled_rows<T, DH, 8>(p, stream);
}

template <typename T>
cudaError_t launch_tiled_dh(const AttentionDecodeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_tiled_heads<T, 64>(p, stream);
    case 80: return launch_tiled_heads<T, 80>(p, stream);
    case 96: return launch_tiled_heads<T, 96>(p, stream);
    case 128: return launch_tiled_heads<T, 128>(p, stream);
  }
  return cudaErrorInvalidValue;
}

