// The SplitToken kernel with weights and KV streamed straight into registers
// (pipeline registers), the alternative to the TMA ring of kernel_tma.cuh.
//
// One cluster of N blocks of 256 threads per (batch row, KV head, chunk of <= 8 query
// heads); every thread computes and loads:
//   1. every block normalises x[b] into shared memory (fp32);
//   2. block r computes its share of the group's Q|K|V COLUMNS (GEMV, 16-byte weight
//      loads, 16 in flight per thread); ClusterGather gives every block all of them;
//   3. RoPE on q and k at position lengths[b]; block 0 of chunk 0 writes the new k, v;
//   4. block r attends over its slice of the tokens (K/V loads straight into registers,
//      several token steps in flight); ClusterGather gives every block every block's
//      (o, l, m), which it merges in rank order (one collective instead of a max and a sum
//      reduce);
//   5. block r multiplies the attention output by its W_o column tiles -> fp32 partial row
//      (the combine kernel sums the clusters' partials in a fixed order).
// Each phase's first 32 KB is prefetched into L2 while the previous phase finishes (more
// was slower, except for W_o: docs/attention_block.md). Launched programmatically (PDL):
// the QKV prefetch is issued while the previous kernel of the stream still runs.
// attend_cached is also decode_attention's CUDA-core token loop.
#pragma once

#include "jax_cluster/cluster_collectives.cuh"
#include "ops/attention_block/kernel_common.cuh"

namespace jax_cluster {

constexpr uint32_t kPrefetchBytes = 32 * 1024;  // per block, per stream, ahead of a phase
// W_o's, issued before the attention combine (the one stream where more ahead was faster).
constexpr uint32_t kWoPrefetchBytes = 128 * 1024;

// The first `budget` bytes of `rows` row segments of `seg_bytes` each, `ld` elements
// apart, into L2: one bulk prefetch per row, one row per thread.
template <typename T>
__device__ void prefetch_rows(const T* first, int64_t ld, int rows, int64_t seg_bytes,
                              uint32_t budget = kPrefetchBytes) {
  if (seg_bytes <= 0) return;
  const int64_t fit = static_cast<int64_t>(budget) / seg_bytes;
  const int n = static_cast<int>(fit < 1 ? 1 : fit < rows ? fit : rows);
  for (int r = threadIdx.x; r < n; r += kBlockThreads) {
    ptx::prefetch_l2(first + r * ld, static_cast<uint32_t>(seg_bytes));
  }
}

// Blocks per SM the kernel is built for (attention_min_blocks_per_sm).
template <int DH, int MH>
constexpr int kRegistersMinBlocks = attention_min_blocks_per_sm(DH, MH);
// Token steps per warp in flight in attention: as many as the registers allow.
template <int DH, int MH>
constexpr int kRegistersTokenSteps = MH <= 2 ? 8 : MH == 4 && kRegistersMinBlocks<DH, MH> == 2 ? 2 : 4;

// Attention of the block's queries over cached tokens [t0, t1) but `skip` (a rolling
// buffer's slot whose token the step replaces; -1: none); U token steps per warp in flight
// (the batch-tiled kernel, built for one block per SM, passes its own).
template <typename T, int DH, int MH, int U = kRegistersTokenSteps<DH, MH>>
__device__ void attend_cached(const AttentionBlockParams& p, const Ctx& c, int hpc,
                              const float* qkv, int t0, int t1, float* warp_states, int skip = -1) {
  constexpr int NV = DH / 8;                   // 16-byte vectors per row
  constexpr int LPT = NV <= 8 ? 8 : NV <= 16 ? 16 : 32;  // lanes per token (power of two)
  static_assert(NV <= 32, "a token's row is at most one warp's 16-byte loads");
  constexpr int TPW = 32 / LPT;                // tokens per warp step
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int dv = lane % LPT, slot = lane / LPT;
  const bool active = dv < NV;

  float q[MH][8];
  load_lane_queries<DH>(q, p, qkv, hpc, dv, active);
  const int64_t row0 = (c.b * p.num_kv_heads + c.g) * p.max_seq;
  const T* K = static_cast<const T*>(p.k_cache) + row0 * DH + dv * 8;
  const T* V = static_cast<const T*>(p.v_cache) + row0 * DH + dv * 8;

  SoftmaxState<MH> st;
  st.init();
  for (int first = t0 + warp * TPW * U; first < t1; first += kBlockWarps * TPW * U) {
    uint4 kr[U], vr[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = first + u * TPW + slot;
      ok[u] = t < t1 && t != skip;
      if (ok[u] && active) {
        kr[u] = ptx::ldg_stream(K + static_cast<int64_t>(t) * DH);
        vr[u] = ptx::ldg_stream(V + static_cast<int64_t>(t) * DH);
      } else {
        kr[u] = make_uint4(0, 0, 0, 0);
        vr[u] = make_uint4(0, 0, 0, 0);
      }
    }
    float s[U][MH];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      unpack<T>(kr[u], kf);
#pragma unroll
      for (int h = 0; h < MH; ++h) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) d = fmaf(q[h][i], kf[i], d);
#pragma unroll
        for (int off = LPT / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
        s[u][h] = ok[u] ? d : -INFINITY;
      }
    }
    st.template add_tokens<T>(s, vr, hpc);
  }
  st.template merge_lanes<LPT>();
  // Warp state -> shared: [warp][head][DH + 2] = (o..., m, l).
  if (slot == 0) st.template store<DH>(warp_states + warp * kMaxH * (DH + 2), hpc, dv, active, lane);
  __syncthreads();
}

template <typename T, int DH, int MH>
__global__ void __launch_bounds__(kBlockThreads, kRegistersMinBlocks<DH, MH>)
    attention_block_kernel(const AttentionBlockParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ ClusterCollectiveBarriers gather_bars, state_bars;
  const int hpc = static_cast<int>(p.heads_per_cluster());
  const int n = p.cluster_size;
  const RegistersLayout L(static_cast<int>(p.hidden), hpc, DH, n);
  float* h = reinterpret_cast<float*>(smem + L.h_off);
  float* states = reinterpret_cast<float*>(smem + L.states_off);
  float* qkv = reinterpret_cast<float*>(smem + L.qkv_off);
  float* red = reinterpret_cast<float*>(smem + L.red_off);
  float* warp_states = reinterpret_cast<float*>(smem + L.warp_off);
  float* attn = reinterpret_cast<float*>(smem + L.attn_off);

  Ctx c = cluster_coords(p);

  ClusterGather<float> gather(&gather_bars, reinterpret_cast<uint4*>(qkv), 2 * L.vecs_per_blk);
  ClusterGather<float> gather_states(&state_bars, reinterpret_cast<uint4*>(states),
                                     L.state_floats / 4);
  gather.init();
  gather_states.init();
  ptx::cluster_arrive();  // barrier init visible to peers; overlap the wait with the norm

  // This block's share of each phase: QKV column vectors, tokens, W_o columns.
  const int first_vec = c.rank * L.vecs_per_blk;
  const int my_vecs = max(0, min(L.vecs_per_blk, L.qkv_vecs - first_vec));
  const T* wqkv = static_cast<const T*>(p.w_qkv);
  const int64_t qkv_ld = (p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim;
  const T* wo = static_cast<const T*>(p.w_o) + (c.g * p.group() + c.chunk * hpc) * DH * p.hidden;

  // Each phase's first bytes are requested ahead (L2 prefetch) so no phase starts with an
  // empty memory pipeline: here the QKV rows (per contiguous run: Q, K or V columns),
  // while the previous kernel of the stream may still run (PDL: weights are no output
  // of it, and a prefetch is only a hint).
  for (int v = first_vec, end = first_vec + my_vecs; v < end;) {
    const int bound = v < hpc * DH / 8 ? hpc * DH / 8 : v < (hpc + 1) * DH / 8 ? (hpc + 1) * DH / 8
                                                                               : end;
    const int run_end = min(end, bound);
    prefetch_rows(wqkv + qkv_column(p, c, hpc, static_cast<int64_t>(v) * 8), qkv_ld,
                  static_cast<int>(p.hidden), static_cast<int64_t>(run_end - v) * 16);
    v = run_end;
  }
  c.len = wait_for_inputs(p, c);
  ptx::griddep_launch_dependents();  // the combine kernel may be scheduled now

  const OutputSlice out = output_slice(p, c);
  float* partial_row = out.row;
  const int o_first = out.first, o_count = out.count;
  if (finish_out_of_range_row(p, c, out)) return;
  const int total = c.len + 1;
  const int per_block = (total + n - 1) / n;
  const int t0 = min(total, c.rank * per_block), t1 = min(total, t0 + per_block);
  normalize_input<T>(p, c.b, h, ThreadGroup::block());
  ptx::cluster_wait();

  // 2. QKV projection: this block's column vectors, then gather.
  project_qkv_slice<T>(p, c, hpc, h, red, qkv, first_vec, my_vecs, L.vecs_per_blk);
  const int64_t kv_row0 = (c.b * p.num_kv_heads + c.g) * p.max_seq;
  if (threadIdx.x < 2 && t0 < c.len) {  // this block's first cached K and V tokens
    const T* cache = static_cast<const T*>(threadIdx.x == 0 ? p.k_cache : p.v_cache);
    const int64_t bytes = static_cast<int64_t>(min(t1, c.len) - t0) * DH * sizeof(T);
    const int64_t ahead = bytes < kPrefetchBytes ? bytes : kPrefetchBytes;
    ptx::prefetch_l2(cache + (kv_row0 + t0) * DH, static_cast<uint32_t>(ahead));
  }
  gather();

  // 3. RoPE, the new k, v rounded to the cache dtype and written.
  rope_and_round_kv<T>(p, qkv, hpc, c.len, ThreadGroup::block());
  __syncthreads();
  write_new_kv<T>(p, c, qkv, hpc, kv_row0, ThreadGroup::block());

  // 4. Attention over this block's token slice; the new token comes from smem.
  attend_cached<T, DH, MH>(p, c, hpc, qkv, t0, min(t1, c.len), warp_states);
  prefetch_rows(wo + o_first * 8, p.hidden, hpc * DH, static_cast<int64_t>(o_count) * 16,
                kWoPrefetchBytes);

  // Combine the warps (fixed order), then the new token, per head, into this block's
  // state; every block gets all of them and merges them in rank order.
  const BlockStateLayout S(hpc, DH);
  float* mine = states + c.rank * S.floats;
  merge_warp_states<DH, kBlockThreads, kBlockWarps, kMaxH>(
      hpc, t0 <= c.len && c.len < t1, p.scale * kLog2e, qkv, warp_states, mine + S.m_off, mine,
      S.m_off, [] { __syncthreads(); });
  gather_states();  // starts with a block barrier
  merge_block_states<DH>(S, hpc, n, states, attn, kBlockThreads);
  __syncthreads();

  // 5. Output projection: this block's output columns of the group's W_o rows.
  block_gemv<T>(
      attn, hpc * DH, wo, p.hidden, o_count,
      [&](int j) { return static_cast<int64_t>(o_first + j) * 8; }, red,
      [&](int j, int i, float v) { partial_row[(o_first + j) * 8 + i] = v; });

  gather.finish();
}

}  // namespace jax_cluster
