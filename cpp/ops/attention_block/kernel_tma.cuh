// The SplitToken kernel with the TMA pipeline: one cluster of N blocks per (batch row b,
// KV head g, chunk of <= 8 query heads of that group), so the KV of a group is read once
// for all its heads. Each block is warp-specialised: one producer thread streams EVERY
// byte the block reads (its W_qkv rows, its K/V tokens, its W_o columns) through a ring of
// 16 KB shared-memory stages with the bulk copy engine (TMA boxes / bulk copies completing
// on mbarriers), in the order the 7 consumer warps use them. The producer runs ahead across
// phases, so the cluster exchanges (QKV reduce, state gather) happen while the next
// phase's data is already landing: memory never waits for compute.
//   1. consumers normalise x[b] into shared memory (fp32);
//   2. QKV projection split over the cluster by ROWS of W_qkv (64-row boxes of each of the
//      group's head column blocks: K, V, then the Q heads), fp32 partials; ClusterReduce
//      (sum) gives every block the whole q|k|v (butterfly: bitwise the same everywhere);
//      + bias, RoPE at position lengths[b]; block 0 of chunk 0 writes the new k, v;
//   3. block r attends over its slice of the cached tokens (online softmax in the exp2
//      domain); the warps' states and the new token combine in a fixed order;
//      ClusterGather gives every block every block's (o, l, m), merged in rank order
//      (merge_block_states: one exchange where a max and a sum reduce took two);
//   4. block r multiplies the normalised attention output by its 64-column tiles of W_o
//      and writes an fp32 partial; the combine kernel sums the partials of all clusters
//      of a row in a fixed order (+ bias, + residual). No floating-point atomics: results
//      are bitwise reproducible.
// At batch 1 each SM runs one block, so per-SM throughput decides: these CUDA-core
// consumers are about as fast as register streaming, slower at most shapes
// (docs/attention_block.md); the staging is the prerequisite for tensor-core consumers.
#pragma once

#include "jax_cluster/cluster_collectives.cuh"
#include "jax_cluster/tma.cuh"
#include "ops/attention_block/kernel_common.cuh"

namespace jax_cluster {

constexpr int kProducerWarp = kConsumerWarps;
constexpr uint32_t kConsumerBarrier = 1;

__device__ __forceinline__ ThreadGroup consumers() { return {kConsumerThreads, kConsumerBarrier}; }

// K and V tokens per stage: both fit 16 KB; a multiple of 8.
template <int DH>
constexpr int kKvTokens = (kStageBytes / (4 * DH)) & ~7;

// Blocks per SM the kernel is built for (attention_min_blocks_per_sm).
template <int DH, int MH>
constexpr int kTmaMinBlocks = attention_min_blocks_per_sm(DH, MH);

// Kernel arguments beside the op's params: the tensor maps (encoded per launch on the
// host) and the launch-time geometry.
struct StreamArgs {
  CUtensorMap qkv;  // W_qkv [D, (Hq + 2 Hkv) Dh], boxes [64 rows, Dh]
  CUtensorMap out;  // W_o [Hq Dh, D], boxes [out_box_rows, 64]
  int out_box_rows;
  int stages;
};

// What one block streams, in order (producer and consumers derive it identically).
struct BlockWork {
  int qkv_chunk0, qkv_chunks;  // 64-row chunks of W_qkv
  int t0, tokens;              // cached tokens [t0, t0 + tokens)
  int t1;                      // end of the block's token slice (the new token may sit there)
  int out_tile0, out_tiles;    // 64-column tiles of W_o
  int out_boxes;               // row boxes per W_o tile
};

__device__ __forceinline__ BlockWork block_work(const AttentionBlockParams& p, const Ctx& c,
                                                int hpc, int out_box_rows) {
  BlockWork w;
  const int n = p.cluster_size;
  const int chunks = static_cast<int>(p.hidden / kQkvBoxRows);
  const int per_chunk = (chunks + n - 1) / n;
  w.qkv_chunk0 = min(chunks, c.rank * per_chunk);
  w.qkv_chunks = min(chunks, w.qkv_chunk0 + per_chunk) - w.qkv_chunk0;
  const int total = c.len + 1;  // the cached tokens and the new one
  const int per_block = (total + n - 1) / n;
  w.t0 = min(total, c.rank * per_block);
  w.t1 = min(total, w.t0 + per_block);
  w.tokens = max(0, min(w.t1, c.len) - w.t0);
  const OutputSlice out = output_slice(p, c);
  w.out_tile0 = out.first / (kOutTileCols / 8);
  w.out_tiles = out.count / (kOutTileCols / 8);
  w.out_boxes = hpc * static_cast<int>(p.head_dim) / out_box_rows;
  return w;
}

// Column of the head block `hb` of the group (stream order: K, V, then the Q heads).
__device__ __forceinline__ int qkv_box_column(const AttentionBlockParams& p, const Ctx& c,
                                              int hpc, int hb) {
  const int local = hb == 0 ? hpc : hb == 1 ? hpc + 1 : hb - 2;  // [Q heads | K | V] index
  return static_cast<int>(qkv_column(p, c, hpc, static_cast<int64_t>(local) * p.head_dim));
}

// The producer thread: every load of the block, in consumption order.
template <typename T, int DH>
__device__ void produce(const AttentionBlockParams& p, const StreamArgs& a, const Ctx& c,
                        int hpc, const BlockWork& w, Ring<kMaxStages>& ring,
                        unsigned char* stages) {
  ptx::prefetch_tensor_map(&a.qkv);
  ptx::prefetch_tensor_map(&a.out);
  const uint64_t policy = ptx::l2_evict_normal();
  RingCursor cur;
  auto stage = [&] { return stages + static_cast<int64_t>(cur.stage) * kStageBytes; };
  constexpr uint32_t kQkvBox = kQkvBoxRows * DH * sizeof(T);
  static_assert(kQkvBox <= kStageBytes, "a W_qkv box is one stage's load");
  for (int ch = 0; ch < w.qkv_chunks; ++ch) {
    const int row = (w.qkv_chunk0 + ch) * kQkvBoxRows;
    for (int hb = 0; hb < hpc + 2; ++hb) {
      uint64_t* bar = ring_acquire(ring, cur, kQkvBox);
      ptx::tma_load_2d(stage(), &a.qkv, qkv_box_column(p, c, hpc, hb), row, bar, policy);
      cur.advance(a.stages);
    }
  }
  constexpr int TK = kKvTokens<DH>;
  const int64_t kv_row0 = (c.b * p.num_kv_heads + c.g) * p.max_seq;
  const T* K = static_cast<const T*>(p.k_cache) + (kv_row0 + w.t0) * DH;
  const T* V = static_cast<const T*>(p.v_cache) + (kv_row0 + w.t0) * DH;
  for (int t = 0; t < w.tokens; t += TK) {
    const uint32_t bytes = static_cast<uint32_t>(min(TK, w.tokens - t) * DH * sizeof(T));
    uint64_t* bar = ring_acquire(ring, cur, 2 * bytes);
    ptx::bulk_load(stage(), K + static_cast<int64_t>(t) * DH, bytes, bar, policy);
    ptx::bulk_load(stage() + TK * DH * sizeof(T), V + static_cast<int64_t>(t) * DH, bytes, bar,
                   policy);
    cur.advance(a.stages);
  }
  const uint32_t out_box = static_cast<uint32_t>(a.out_box_rows) * kOutTileCols * sizeof(T);
  const int row0 = static_cast<int>((c.g * p.group() + c.chunk * hpc) * DH);
  for (int tile = 0; tile < w.out_tiles; ++tile) {
    for (int rb = 0; rb < w.out_boxes; ++rb) {
      uint64_t* bar = ring_acquire(ring, cur, out_box);
      ptx::tma_load_2d(stage(), &a.out, (w.out_tile0 + tile) * kOutTileCols,
                       row0 + rb * a.out_box_rows, bar, policy);
      cur.advance(a.stages);
    }
  }
}

// Phase 2 (consumers): this block's rows of the QKV projection, fp32, into qkv in
// [Q heads | K | V] order. Thread = (row group, 8-column vector of a head block). With only
// 7 warps per SM, latency is hidden by ILP alone: each thread issues all its shared loads
// of a stage before any math, with clamped (branch-free) indices.
template <typename T, int DH, int MH>
__device__ void project_qkv_rows(const BlockWork& w, int hpc, const float* h, float* red,
                                 float* qkv, Ring<kMaxStages>& ring, RingCursor& cur,
                                 const unsigned char* stages, int num_stages) {
  constexpr int NV = DH / 8, kGroups = kConsumerThreads / NV;
  constexpr int kRows = (kQkvBoxRows + kGroups - 1) / kGroups;  // rows per thread and box
  const int cv = threadIdx.x % NV, rg = threadIdx.x / NV;
  float acc[MH + 2][8];
#pragma unroll
  for (int hb = 0; hb < MH + 2; ++hb)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[hb][i] = 0.f;
  int row_off[kRows];  // element offset of the thread's row k in a box
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int r = rg + k * kGroups;
    row_off[k] = (rg < kGroups && r < kQkvBoxRows ? r : 0) * DH + cv * 8;
  }
  for (int ch = 0; ch < w.qkv_chunks; ++ch) {
    float hs[kRows];  // h of the thread's rows: 0 for rows it does not own
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const int r = rg + k * kGroups;
      hs[k] = rg < kGroups && r < kQkvBoxRows ? h[(w.qkv_chunk0 + ch) * kQkvBoxRows + r] : 0.f;
    }
#pragma unroll
    for (int hb = 0; hb < MH + 2; ++hb) {  // static index: acc stays in registers
      if (hb >= hpc + 2) break;
      ring_wait(ring, cur);
      const T* tile = reinterpret_cast<const T*>(stages + static_cast<int64_t>(cur.stage) * kStageBytes);
      uint4 wv[kRows];
#pragma unroll
      for (int k = 0; k < kRows; ++k) wv[k] = ptx::lds128(tile + row_off[k]);
      ring_release(ring, cur);
      cur.advance(num_stages);
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        float f[8];
        unpack<T>(wv[k], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[hb][i] = fmaf(hs[k], f[i], acc[hb][i]);
      }
    }
  }
  // Row groups -> one sum per column, in a fixed order; head block by head block.
#pragma unroll
  for (int hb = 0; hb < MH + 2; ++hb) {
    if (hb >= hpc + 2) break;
    if (rg < kGroups) {
#pragma unroll
      for (int i = 0; i < 8; ++i) red[rg * DH + cv * 8 + i] = acc[hb][i];
    }
    consumers().sync();
    const int dst = (hb == 0 ? hpc : hb == 1 ? hpc + 1 : hb - 2) * DH;
    for (int e = threadIdx.x; e < DH; e += kConsumerThreads) {
      float s = 0.f;
      for (int g = 0; g < kGroups; ++g) s += red[g * DH + e];
      qkv[dst + e] = s;
    }
    consumers().sync();
  }
}

// Phase 3 (consumers): attention of the block's queries over the streamed cached tokens;
// each warp's (m, l, o) per head into warp_states [warp][head][DH + 2] = (o..., m, l).
template <typename T, int DH, int MH>
__device__ void attend_streamed(const AttentionBlockParams& p, int hpc, const float* qkv,
                                const BlockWork& w, float* warp_states, Ring<kMaxStages>& ring,
                                RingCursor& cur, const unsigned char* stages, int num_stages) {
  constexpr int NV = DH / 8;               // 16-byte vectors per row
  constexpr int LPT = NV <= 8 ? 8 : 16;    // lanes per token (power of two)
  constexpr int TPW = 32 / LPT;            // tokens per warp step
  constexpr int TK = kKvTokens<DH>;        // tokens per stage
  constexpr int U = (TK + kConsumerWarps * TPW - 1) / (kConsumerWarps * TPW);  // warp steps per stage
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int dv = lane % LPT, slot = lane / LPT;
  const bool active = dv < NV;

  float q[MH][8];
  load_lane_queries<DH>(q, p, qkv, hpc, dv, active);
  SoftmaxState<MH> st;
  st.init();
  const int dv_c = active ? dv : 0;  // inactive lanes read a valid vector; their q is 0
  // Token steps whose K and V vectors are loaded together before any math: all of the
  // stage's, except where a cluster serves 4+ heads (the registers go to q and o).
  constexpr int UB = MH >= 4 ? 1 : U;
  for (int t = 0; t < w.tokens; t += TK) {
    const int count = min(TK, w.tokens - t);
    ring_wait(ring, cur);
    const T* Ks = reinterpret_cast<const T*>(stages + static_cast<int64_t>(cur.stage) * kStageBytes);
    const T* Vs = Ks + TK * DH;
#pragma unroll
    for (int u0 = 0; u0 < U; u0 += UB) {
      // (tokens past `count` read token count-1 and are masked by their -inf score)
      uint4 kr[UB], vr[UB];
      bool ok[UB];
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int tl = ((u0 + u) * kConsumerWarps + warp) * TPW + slot;
        ok[u] = tl < count;
        const int off = (ok[u] ? tl : count - 1) * DH + dv_c * 8;
        kr[u] = ptx::lds128(Ks + off);
        vr[u] = ptx::lds128(Vs + off);
      }
      if (u0 + UB >= U) {  // the stage's last reads issued (values land in registers)
        ring_release(ring, cur);
        cur.advance(num_stages);
      }
      float s[UB][MH];
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        float kf[8];
        unpack<T>(kr[u], kf);
#pragma unroll
        for (int h = 0; h < MH; ++h) {
          float d0 = 0.f, d1 = 0.f;  // two chains: half the dependent FMA latency
#pragma unroll
          for (int i = 0; i < 8; i += 2) {
            d0 = fmaf(q[h][i], kf[i], d0);
            d1 = fmaf(q[h][i + 1], kf[i + 1], d1);
          }
          s[u][h] = d0 + d1;
        }
      }
#pragma unroll
      for (int off = LPT / 2; off > 0; off >>= 1) {
#pragma unroll
        for (int u = 0; u < UB; ++u)
#pragma unroll
          for (int h = 0; h < MH; ++h) s[u][h] += __shfl_xor_sync(0xffffffffu, s[u][h], off);
      }
#pragma unroll
      for (int u = 0; u < UB; ++u)
#pragma unroll
        for (int h = 0; h < MH; ++h) s[u][h] = ok[u] ? s[u][h] : -INFINITY;
      st.template add_tokens<T>(s, vr, hpc);
    }
  }
  // Warp state -> shared: [warp][head][DH + 2] = (o..., m, l).
  st.template merge_lanes<LPT>();
  if (slot == 0) st.template store<DH>(warp_states + warp * MH * (DH + 2), hpc, dv, active, lane);
  consumers().sync();
}

// Phase 4 (consumers): attn [hpc*DH] times the block's W_o tiles -> the fp32 partial row.
// Thread = (row group, 8-column vector of the 64-column tile): 4 row groups per warp; loads
// first, branch-free, as in phase 2.

template <typename T>
__device__ void project_output(const BlockWork& w, int out_box_rows, const float* attn,
                               float* ored, float* partial_row, Ring<kMaxStages>& ring,
                               RingCursor& cur, const unsigned char* stages, int num_stages) {
  constexpr int kTileVecs = kOutTileCols / 8;
  constexpr int kRowGroups = kConsumerThreads / kTileVecs;
  constexpr int kRows = (kMaxOutBoxRows + kRowGroups - 1) / kRowGroups;
  const int cv = threadIdx.x % kTileVecs, rg = threadIdx.x / kTileVecs;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  int row_off[kRows];
  bool own[kRows];
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int r = rg + k * kRowGroups;
    own[k] = r < out_box_rows;
    row_off[k] = (own[k] ? r : 0) * kOutTileCols + cv * 8;
  }
  for (int tile = 0; tile < w.out_tiles; ++tile) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int rb = 0; rb < w.out_boxes; ++rb) {
      ring_wait(ring, cur);
      const T* box = reinterpret_cast<const T*>(stages + static_cast<int64_t>(cur.stage) * kStageBytes);
      uint4 wv[kRows];
#pragma unroll
      for (int k = 0; k < kRows; ++k) wv[k] = ptx::lds128(box + row_off[k]);
      ring_release(ring, cur);
      cur.advance(num_stages);
      const float* a = attn + rb * out_box_rows + rg;
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const float s = own[k] ? a[k * kRowGroups] : 0.f;
        float f[8];
        unpack<T>(wv[k], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(s, f[i], acc[i]);
      }
    }
    // The warp's 4 row groups (lanes 8 apart), then the warps in order (double-buffered:
    // one barrier per tile).
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 8);
      acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 16);
    }
    float* red = ored + (tile & 1) * kConsumerWarps * kOutTileCols;
    if (lane < kTileVecs) {
#pragma unroll
      for (int i = 0; i < 8; ++i) red[warp * kOutTileCols + lane * 8 + i] = acc[i];
    }
    consumers().sync();
    if (threadIdx.x < kOutTileCols) {
      float s = 0.f;
      for (int wp = 0; wp < kConsumerWarps; ++wp) s += red[wp * kOutTileCols + threadIdx.x];
      partial_row[(w.out_tile0 + tile) * kOutTileCols + threadIdx.x] = s;
    }
  }
}

template <typename T, int DH, int MH>
__global__ void __launch_bounds__(kStreamThreads, kTmaMinBlocks<DH, MH>)
    attention_block_tma_kernel(const __grid_constant__ AttentionBlockParams p,
                            const __grid_constant__ StreamArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ ClusterCollectiveBarriers qkv_bars, state_bars;
  __shared__ Ring<kMaxStages> ring;
  const int hpc = static_cast<int>(p.heads_per_cluster());
  const int n = p.cluster_size;
  const StreamLayout L(static_cast<int>(p.hidden), hpc, DH, MH, n, a.stages);
  float* qkv = reinterpret_cast<float*>(smem + L.qkv_off);
  float* states = reinterpret_cast<float*>(smem + L.states_off);
  float* attn = reinterpret_cast<float*>(smem + L.attn_off);
  float* h = reinterpret_cast<float*>(smem + L.h_off);
  float* red = reinterpret_cast<float*>(smem + L.red_off);
  float* warp_states = reinterpret_cast<float*>(smem + L.warp_off);
  float* ored = reinterpret_cast<float*>(smem + L.ored_off);

  const Ctx c = cluster_ctx(p);
  ptx::griddep_launch_dependents();  // the combine kernel may be scheduled now
  const BlockWork w = block_work(p, c, hpc, a.out_box_rows);
  const ThreadGroup group = consumers();
  ClusterReduce<float, ReduceOp::kSum> reduce_qkv(
      &qkv_bars, reinterpret_cast<uint4*>(smem + L.qkv_recv_off), L.qkv_floats / 4, group);
  ClusterGather<float> gather_states(&state_bars, reinterpret_cast<uint4*>(states),
                                     L.state_floats / 4, group);
  reduce_qkv.init();
  gather_states.init();
  if (threadIdx.x == 0) {
    ring.init(kConsumerWarps);
    ptx::fence_mbarrier_init_cluster();
  }
  __syncthreads();        // the ring's barriers, for the producer
  ptx::cluster_arrive();  // the collectives' barriers, for the peers

  const bool bad_length = length_out_of_range(p, c);
  if (threadIdx.x / 32 == kProducerWarp) {
    ptx::cluster_wait();
    if ((threadIdx.x & 31) == 0 && !bad_length) produce<T, DH>(p, a, c, hpc, w, ring, smem);
    return;  // the consumers wait for every stage: the block outlives its copies
  }
  const OutputSlice out = output_slice(p, c);
  if (bad_length) {
    write_nan_slice(out, group);
    ptx::cluster_wait();
    return;
  }
  normalize_input<T>(p, c.b, h, group);
  ptx::cluster_wait();

  // 2. QKV projection over this block's rows, summed over the cluster; bias, RoPE.
  RingCursor cur;
  project_qkv_rows<T, DH, MH>(w, hpc, h, red, qkv, ring, cur, smem, a.stages);
  reduce_qkv(reinterpret_cast<uint4*>(qkv));
  if (p.has_qkv_bias) {
    const T* bias = static_cast<const T*>(p.qkv_bias);
    constexpr int kBatch = 4;  // a thread's biases loaded together, ahead of its adds
    for (int e0 = threadIdx.x; e0 < L.qkv_floats; e0 += kBatch * kConsumerThreads) {
      T raw[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = min(e0 + u * kConsumerThreads, L.qkv_floats - 1);  // clamped: in bounds
        raw[u] = bias[qkv_column(p, c, hpc, e)];
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kConsumerThreads;
        if (e < L.qkv_floats) qkv[e] += to_float(raw[u]);
      }
    }
    group.sync();
  }
  rope_and_round_kv<T>(p, qkv, hpc, c.len, group);
  group.sync();
  const int64_t kv_row0 = (c.b * p.num_kv_heads + c.g) * p.max_seq;
  write_new_kv<T>(p, c, qkv, hpc, kv_row0, group);

  // 3. Attention over this block's cached tokens; then the new token; cluster combine.
  attend_streamed<T, DH, MH>(p, hpc, qkv, w, warp_states, ring, cur, smem, a.stages);
  const BlockStateLayout S(hpc, DH);
  float* mine = states + c.rank * S.floats;
  merge_warp_states<DH, kConsumerThreads, kConsumerWarps, MH>(
      hpc, w.t0 <= c.len && c.len < w.t1, p.scale * kLog2e, qkv, warp_states, mine + S.m_off,
      mine, S.m_off, [] { consumers().sync(); });
  gather_states();  // starts with a consumer barrier
  merge_block_states<DH>(S, hpc, n, states, attn, kConsumerThreads);
  group.sync();

  // 4. Output projection: this block's W_o column tiles.
  project_output<T>(w, a.out_box_rows, attn, ored, out.row, ring, cur, smem, a.stages);

  reduce_qkv.finish();  // no block leaves while a peer may still write into it
}

}  // namespace jax_cluster
