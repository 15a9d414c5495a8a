// Fused decode attention block (ClusterFusion Alg. 3, SplitToken dataflow) with the TMA
// pipeline (pipeline="tma"); attention_decode_registers.cuh has the register pipeline (the
// faster one so far) and attention_decode_split_head.cuh the SplitHead dataflow; the launch
// dispatch is at the end of this file. Measured on H100 (session 7, same run): 112 vs 111 us
// for the register pipeline at Llama-2-7B b1 ctx4K, 89 vs 80 us at Llama-3-8B. At b1 each SM
// runs one block, so per-SM throughput decides: these CUDA-core consumers (~1,300 warp
// instructions per 16 KB stage, 7 warps) are no faster than register streaming. (Session 11:
// 32 clusters of 3, all resident at once, ran as fast as 32 clusters of 4, of which only 31
// fit at one block per SM: the doubled SMs were not what held b1 back.) The next step is
// tensor-core consumers (ldmatrix on 128B-swizzled boxes), for which this staging is the
// prerequisite.
//
// One cluster of N blocks per (batch row b, KV head g, chunk of <= 8 query heads of that
// group): the KV of a group is read once for all its heads. Each block is warp-
// specialised: one producer thread streams EVERY byte the block reads (its W_qkv rows,
// its K/V tokens, its W_o columns) through a ring of 16 KB shared-memory stages with the
// bulk copy engine (TMA boxes / bulk copies completing on mbarriers), in the order the
// 7 consumer warps use them. (8 warps in all: Hopper places a block's warps round-robin
// on the SM's 4 register-file quarters, so a 9th warp would cut every warp's registers to
// 168 at one block per SM, 96 at two.) The producer runs ahead across phases, so the cluster
// exchanges (QKV reduce, state gather) happen while the next phase's data is already landing:
// memory never waits for compute.
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
//      and writes an fp32 partial; a second small kernel sums the partials of all clusters
//      of a row in a fixed order (+ bias, + residual). No floating-point atomics: results
//      are bitwise reproducible.
// Both kernels are launched programmatically (PDL): the main kernel may start while the
// previous kernel of the stream finishes (it waits in cluster_ctx before touching any
// input), and the combine kernel is scheduled while the main kernel runs and waits for
// its partials. Measured on H100 (session 12, Llama-2-7B b1 ctx4K, cluster 3): the step
// went from 84 to 81 us; the combine now ends 2.6 us after the main kernel (was 3.9).
// The combine kernel in turn lets the next step's main kernel launch once the partials
// are in (session 15: 1.5-2 us less per step, every configuration measured).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "jax_cluster/cluster_collectives.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/thread_group.cuh"
#include "jax_cluster/tma.cuh"
#include "ops/attention_block/launch.h"
#include "jax_cluster/launch.cuh"
#include "jax_cluster/tma_host.h"

namespace jax_cluster {
namespace {

#include "ops/attention_block/kernel_common.cuh"  // NOLINT(build/include)

constexpr int kConsumerWarps = 7;
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kStreamThreads = kConsumerThreads + 32;  // + the producer warp
constexpr int kProducerWarp = kConsumerWarps;
constexpr int kStageBytes = 16 * 1024;
constexpr int kMaxStages = 8;
constexpr int kQkvBoxRows = 64;  // W_qkv rows per box; D is a multiple of 64
constexpr uint32_t kConsumerBarrier = 1;

__device__ __forceinline__ ThreadGroup consumers() { return {kConsumerThreads, kConsumerBarrier}; }

// K and V tokens per stage: both fit 16 KB; a multiple of 8.
template <int DH>
constexpr int kKvTokens = (kStageBytes / (4 * DH)) & ~7;

// Blocks per SM the kernel is built for: 2 where ptxas fits it without spills (lets
// clusters of 8 and 16 find enough SMs: at one block per SM an H100 keeps only 7 clusters
// of 16 resident), else 1.
template <int DH, int MH>
constexpr int kTmaMinBlocks = MH <= 4 && DH % 64 == 0 ? 2 : 1;

// Kernel arguments beside the op's params: the tensor maps (encoded per launch on the
// host) and the launch-time geometry.
struct StreamArgs {
  CUtensorMap qkv;  // W_qkv [D, (Hq + 2 Hkv) Dh], boxes [64 rows, Dh]
  CUtensorMap out;  // W_o [Hq Dh, D], boxes [out_box_rows, 64]
  int out_box_rows;
  int stages;
};

// Shared memory carve-up (host and device). Stages first (TMA destinations, aligned);
// then the collectives' buffers; then scratch that phase 2 (h, row-group partials) and
// phases 3-4 (warp states, W_o partials) use in turn (local data only: never a buffer
// that a peer writes into).
struct StreamLayout {
  int qkv_floats, state_floats, groups;
  int64_t qkv_off, qkv_recv_off, states_off;
  int64_t h_off, red_off, warp_off, ored_off, attn_off, fixed, bytes;

  __host__ __device__ StreamLayout(int hidden, int hpc, int dh, int mh, int n, int stages) {
    const int rounds = cluster_exchange_slots(n);  // receive slots of the collectives
    qkv_floats = (hpc + 2) * dh;
    state_floats = BlockStateLayout(hpc, dh).floats;
    groups = kConsumerThreads / (dh / 8);  // row groups of the QKV GEMV
    int64_t off = static_cast<int64_t>(stages) * kStageBytes;
    auto take = [&](int64_t bytes) {
      const int64_t at = off;
      off += (bytes + 127) / 128 * 128;
      return at;
    };
    qkv_off = take(4LL * qkv_floats);
    qkv_recv_off = take(4LL * qkv_floats * rounds);
    states_off = take(4LL * state_floats * n);  // every block's attention state (gathered)
    const int64_t local = off;
    h_off = take(4LL * hidden);
    red_off = take(4LL * groups * dh);
    const int64_t phase2_end = off;
    off = local;
    warp_off = take(4LL * kConsumerWarps * mh * (dh + 2));
    ored_off = take(4LL * 2 * kConsumerWarps * kOutTileCols);
    attn_off = take(4LL * hpc * dh);
    off = off > phase2_end ? off : phase2_end;
    bytes = off;
    fixed = bytes - static_cast<int64_t>(stages) * kStageBytes;
  }
};

// What one block streams, in order (producer and consumers derive it identically).
struct BlockWork {
  int qkv_chunk0, qkv_chunks;  // 64-row chunks of W_qkv
  int t0, tokens;              // cached tokens [t0, t0 + tokens)
  int t1;                      // end of the block's token slice (the new token may sit there)
  int out_tile0, out_tiles;    // 64-column tiles of W_o
  int out_boxes;               // row boxes per W_o tile
};

__device__ __forceinline__ BlockWork block_work(const AttentionDecodeParams& p, const Ctx& c,
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
__device__ __forceinline__ int qkv_box_column(const AttentionDecodeParams& p, const Ctx& c,
                                              int hpc, int hb) {
  const int local = hb == 0 ? hpc : hb == 1 ? hpc + 1 : hb - 2;  // [Q heads | K | V] index
  return static_cast<int>(qkv_column(p, c, hpc, static_cast<int64_t>(local) * p.head_dim));
}

// The producer thread: every load of the block, in consumption order.
template <typename T, int DH>
__device__ void produce(const AttentionDecodeParams& p, const StreamArgs& a, const Ctx& c,
                        int hpc, const BlockWork& w, Ring<kMaxStages>& ring,
                        unsigned char* stages) {
  ptx::prefetch_tensor_map(&a.qkv);
  ptx::prefetch_tensor_map(&a.out);
  const uint64_t policy = ptx::l2_evict_normal();
  RingCursor cur;
  auto stage = [&] { return stages + static_cast<int64_t>(cur.stage) * kStageBytes; };
  constexpr uint32_t kQkvBox = kQkvBoxRows * DH * sizeof(T);
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
__device__ void attend_streamed(const AttentionDecodeParams& p, int hpc, const float* qkv,
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
#pragma unroll
  for (int h = 0; h < MH; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      q[h][i] = (h < hpc && active) ? qkv[h * DH + dv * 8 + i] * p.scale * kLog2e : 0.f;
    }
  }
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
constexpr int kMaxOutBoxRows = kStageBytes / (kOutTileCols * 2);

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
    attention_decode_tma_kernel(const __grid_constant__ AttentionDecodeParams p,
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
    for (int e = threadIdx.x; e < L.qkv_floats; e += kConsumerThreads) {
      qkv[e] += to_float(bias[qkv_column(p, c, hpc, e)]);
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

// The other kernels: textual parts of this file (same anonymous namespace, helpers).
#include "ops/attention_block/kernel_registers.cuh"   // NOLINT(build/include)
#include "ops/attention_block/kernel_split_head.cuh"  // NOLINT(build/include)

// W_o rows per box: the largest multiple of 8 that divides the chunk's hpc*Dh rows and
// keeps a [rows, 64] box within a stage.
inline int out_box_rows(int rows) {
  for (int r = kMaxOutBoxRows; r >= 8; r -= 8) {
    if (rows % r == 0) return r;
  }
  return 8;
}

template <typename T, int DH, int MH>
cudaError_t launch_tma(const AttentionDecodeParams& p, cudaStream_t stream) {
  const int hpc = static_cast<int>(p.heads_per_cluster());
  StreamArgs a{};
  a.out_box_rows = out_box_rows(hpc * DH);
  const int64_t qkv_cols = (p.num_q_heads + 2 * p.num_kv_heads) * DH;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(encode_matrix_map(&a.qkv, p.dtype, p.w_qkv, p.hidden, qkv_cols,
                                                     kQkvBoxRows, DH));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(encode_matrix_map(&a.out, p.dtype, p.w_o, p.num_q_heads * DH,
                                                     p.hidden, a.out_box_rows, kOutTileCols));
  // As many stages as this many blocks per SM leave room for (1 KB for the static part).
  constexpr int kBlocks = kTmaMinBlocks<DH, MH>;
  const int64_t budget = (kMaxSharedBytesPerBlock + 1024) / kBlocks - 2048;
  const StreamLayout none(static_cast<int>(p.hidden), hpc, DH, MH, p.cluster_size, 0);
  a.stages = static_cast<int>(std::min<int64_t>(kMaxStages, (budget - none.fixed) / kStageBytes));
  if (a.stages < 2) return cudaErrorInvalidConfiguration;  // hidden too large for this kernel
  const StreamLayout L(static_cast<int>(p.hidden), hpc, DH, MH, p.cluster_size, a.stages);
  const int64_t clusters = p.batch * p.num_kv_heads * p.head_chunks();
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(launch_cluster_programmatic(
      attention_decode_tma_kernel<T, DH, MH>, dim3(static_cast<unsigned>(clusters * p.cluster_size)),
      dim3(kStreamThreads), static_cast<size_t>(L.bytes), p.cluster_size, stream, p, a));
  return cudaSuccess;
}

// MH: register arrays sized for the heads a cluster serves (1, 2, 4 or 8).
template <typename T, int DH, int MH>
cudaError_t launch_typed(const AttentionDecodeParams& p, cudaStream_t stream) {
  if (p.dataflow == AttnDataflow::kSplitHead) {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR((launch_split_head_typed<T, DH, MH>(p, stream)));
  } else if (p.pipeline == AttnPipeline::kTma) {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR((launch_tma<T, DH, MH>(p, stream)));
  } else {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR((launch_registers<T, DH, MH>(p, stream)));
  }
  return launch_combine<T>(p, stream);
}

template <typename T, int DH>
cudaError_t launch_heads(const AttentionDecodeParams& p, cudaStream_t stream) {
  const int64_t hpc = p.heads_per_cluster();
  if (hpc == 1) return launch_typed<T, DH, 1>(p, stream);
  if (hpc == 2) return launch_typed<T, DH, 2>(p, stream);
  if (hpc <= 4) return launch_typed<T, DH, 4>(p, stream);
  return launch_typed<T, DH, 8>(p, stream);
}

template <typename T>
cudaError_t launch_dh(const AttentionDecodeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_heads<T, 64>(p, stream);
    case 80: return launch_heads<T, 80>(p, stream);
    case 96: return launch_heads<T, 96>(p, stream);
    case 128: return launch_heads<T, 128>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_attention_decode(const AttentionDecodeParams& p, cudaStream_t stream) {
  if (p.rows_per_cluster > 1) {  // the batch-tiled register kernel
    if (p.dataflow != AttnDataflow::kSplitToken || p.pipeline != AttnPipeline::kRegisters) {
      return cudaErrorInvalidValue;  // the FFI layer rejects these with a message first
    }
    if (p.dtype == DType::kF16) return launch_attention_decode_tiled_f16(p, stream);
    if (p.dtype == DType::kBF16) return launch_attention_decode_tiled_bf16(p, stream);
    return cudaErrorInvalidValue;
  }
  if (p.dtype == DType::kF16) return launch_dh<__half>(p, stream);
  if (p.dtype == DType::kBF16) return launch_dh<__nv_bfloat16>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace jax_cluster
