// SplitHead dataflow (ClusterFusion Appendix B.2, Algorithm 5), the alternative to the
// SplitToken kernels: the blocks of a cluster split the HEAD DIMENSION, not the tokens.
//   1-3. as SplitToken: norm, QKV projection (columns split, ClusterGather), RoPE, cache
//        write; block r then keeps dims [r w, (r + 1) w) of every head (w = Dh / N).
//   4.   per chunk of T tokens: partial scores over the block's dims, ClusterReduce(sum)
//        of the [heads x T] scores (the traffic that grows with the context: the paper's
//        reason this dataflow loses), online softmax (identical in every block: the
//        butterfly reduce gives bitwise-identical sums), P x V over the block's dims;
//   5.   the block's dims of the attention output times the matching rows of W_o give a
//        partial [D] row; ClusterReduce(sum) in 1024-float pieces; block r writes its
//        share of the columns to the workspace; the combine kernel adds the clusters.
// Its loads are plain 16-byte global loads (it keeps the paper's structure for the
// comparison); every thread of the block computes. Its measured cost against SplitToken:
// docs/attention_block.md.
#pragma once

#include "jax_cluster/cluster_collectives.cuh"
#include "ops/attention_block/kernel_common.cuh"

namespace jax_cluster {

// Token t's 8 values at column `col` of one head's cache rows: the new token (t == len)
// from shared memory, as other clusters of the KV head do not wait for its write; the
// others from the cache.
template <typename T, int DH>
__device__ __forceinline__ void token_values(const T* cache, const float* fresh, int t, int len,
                                             int col, float (&f)[8]) {
  if (t == len) {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = fresh[col + i];
  } else {
    unpack<T>(ptx::ldg_stream(cache + static_cast<int64_t>(t) * DH + col), f);
  }
}

template <typename T, int DH, int MH>
__global__ void __launch_bounds__(kBlockThreads, 1)
    attention_block_split_head_kernel(const AttentionBlockParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ ClusterCollectiveBarriers gather_bars, reduce_bars;
  const int hpc = static_cast<int>(p.heads_per_cluster());
  const int n = p.cluster_size;
  const SplitHeadLayout L(static_cast<int>(p.hidden), hpc, DH, n, MH);
  float* h = reinterpret_cast<float*>(smem + L.h_off);
  float* qkv = reinterpret_cast<float*>(smem + L.qkv_off);
  float* red = reinterpret_cast<float*>(smem + L.red_off);
  float* scores = reinterpret_cast<float*>(smem + L.scores_off);
  float* stats = reinterpret_cast<float*>(smem + L.stats_off);
  float* run_max = stats;
  float* run_sum = stats + kMaxH;
  float* rescale = stats + 2 * kMaxH;
  float* attn = reinterpret_cast<float*>(smem + L.attn_off);

  const Ctx c = cluster_ctx(p);
  ptx::griddep_launch_dependents();  // the combine kernel may be scheduled now

  ClusterGather<float> gather(&gather_bars, reinterpret_cast<uint4*>(qkv), 2 * L.vecs_per_blk);
  ClusterReduce<float, ReduceOp::kSum> reduce(&reduce_bars, reinterpret_cast<uint4*>(smem + L.recv_off),
                                              kSplitHeadReduceFloats / 4);
  gather.init();
  reduce.init();
  ptx::cluster_arrive();

  const OutputSlice out = output_slice(p, c);
  float* partial_row = out.row;
  const int o_first = out.first, o_count = out.count;
  if (finish_out_of_range_row(p, c, out)) return;
  normalize_input<T>(p, c.b, h, ThreadGroup::block());
  ptx::cluster_wait();

  // 2-3. QKV projection (columns split, gathered), RoPE, cache write: as SplitToken.
  const int first_vec = c.rank * L.vecs_per_blk;
  const int my_vecs = max(0, min(L.vecs_per_blk, L.qkv_vecs - first_vec));
  project_qkv_slice<T>(p, c, hpc, h, red, qkv, first_vec, my_vecs, L.vecs_per_blk);
  gather();
  rope_and_round_kv<T>(p, qkv, hpc, c.len, ThreadGroup::block());
  const float qscale = p.scale * kLog2e;
  for (int e = threadIdx.x; e < hpc * DH; e += kBlockThreads) qkv[e] *= qscale;  // exp2-domain scores
  if (threadIdx.x < kMaxH) {
    run_max[threadIdx.x] = -INFINITY;
    run_sum[threadIdx.x] = 0.f;
  }
  __syncthreads();
  const int64_t kv_row0 = (c.b * p.num_kv_heads + c.g) * p.max_seq;
  write_new_kv<T>(p, c, qkv, hpc, kv_row0, ThreadGroup::block());

  // 4. Attention over all tokens, this block's dims d0 + [0, w). The new token (index
  // len) comes from shared memory: other clusters of this KV head do not wait for the write.
  const int d0 = c.rank * L.w, wv = L.wv, T_ = L.tokens;
  const T* K = static_cast<const T*>(p.k_cache) + kv_row0 * DH + d0;
  const T* V = static_cast<const T*>(p.v_cache) + kv_row0 * DH + d0;
  const float* k_new = qkv + hpc * DH + d0;
  const float* v_new = qkv + (hpc + 1) * DH + d0;
  const int groups = kBlockThreads / wv;  // P x V: thread = (vector j of the dims, token group)
  const int pv_j = threadIdx.x % wv, pv_g = threadIdx.x / wv;
  float o[MH][8];
#pragma unroll
  for (int hh = 0; hh < MH; ++hh)
#pragma unroll
    for (int i = 0; i < 8; ++i) o[hh][i] = 0.f;

  const int total = c.len + 1;
  for (int t0 = 0; t0 < total; t0 += T_) {
    const int count = min(T_, total - t0);
    // partial scores [head][token] over the block's dims; one token per thread
    for (int tl = threadIdx.x; tl < T_; tl += kBlockThreads) {
      float acc[MH];
#pragma unroll
      for (int hh = 0; hh < MH; ++hh) acc[hh] = 0.f;
      const int t = t0 + tl;
      if (tl < count) {
        for (int j = 0; j < wv; ++j) {
          float kf[8];
          token_values<T, DH>(K, k_new, t, c.len, j * 8, kf);
#pragma unroll
          for (int hh = 0; hh < MH; ++hh) {
            if (hh >= hpc) break;
            const float* q = qkv + hh * DH + d0 + j * 8;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[hh] = fmaf(q[i], kf[i], acc[hh]);
          }
        }
      }
#pragma unroll
      for (int hh = 0; hh < MH; ++hh) scores[hh * T_ + tl] = acc[hh];
    }
    reduce(reinterpret_cast<uint4*>(scores));  // full scores in every block (barriers inside)

    // online softmax per head (warp hh), fixed-order reductions
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    if (warp < hpc) {
      float mx = -INFINITY;
      for (int tl = lane; tl < count; tl += 32) mx = fmaxf(mx, scores[warp * T_ + tl]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(run_max[warp], mx);
      float sum = 0.f;
      for (int tl = lane; tl < T_; tl += 32) {
        const float pr = tl < count ? exp2f(scores[warp * T_ + tl] - m_new) : 0.f;
        scores[warp * T_ + tl] = pr;
        sum += pr;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (lane == 0) {
        const float a = run_max[warp] == -INFINITY ? 0.f : exp2f(run_max[warp] - m_new);
        rescale[warp] = a;
        run_sum[warp] = run_sum[warp] * a + sum;
        run_max[warp] = m_new;
      }
    }
    __syncthreads();
    // P x V over the block's dims
    if (pv_g < groups) {
#pragma unroll
      for (int hh = 0; hh < MH; ++hh) {
        const float a = hh < hpc ? rescale[hh] : 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) o[hh][i] *= a;
      }
      for (int tl = pv_g; tl < count; tl += groups) {
        const int t = t0 + tl;
        float vf[8];
        token_values<T, DH>(V, v_new, t, c.len, pv_j * 8, vf);
#pragma unroll
        for (int hh = 0; hh < MH; ++hh) {
          const float pr = scores[hh * T_ + tl];
#pragma unroll
          for (int i = 0; i < 8; ++i) o[hh][i] = fmaf(pr, vf[i], o[hh][i]);
        }
      }
    }
    __syncthreads();  // scores reused by the next chunk
  }
  // token groups -> this block's dims of each head's output, normalised (fixed order)
#pragma unroll
  for (int hh = 0; hh < MH; ++hh) {  // static head index: o stays in registers
    if (hh >= hpc) break;              // uniform over the block
    if (pv_g < groups) {
#pragma unroll
      for (int i = 0; i < 8; ++i) red[(pv_g * wv + pv_j) * 8 + i] = o[hh][i];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < L.w; e += kBlockThreads) {
      float s = 0.f;
      for (int g2 = 0; g2 < groups; ++g2) s += red[g2 * L.w + e];
      attn[hh * L.w + e] = s / run_sum[hh];
    }
    __syncthreads();
  }

  // 5. Output projection of the block's dims: partial [D] row (in h), reduced over the
  // cluster in pieces; block r writes its share of the columns.
  const int64_t head0 = c.g * p.group() + c.chunk * hpc;
  const int ovecs = static_cast<int>(p.hidden / 8);
  for (int hh = 0; hh < hpc; ++hh) {
    const T* wo = static_cast<const T*>(p.w_o) + ((head0 + hh) * DH + d0) * p.hidden;
    block_gemv<T>(
        attn + hh * L.w, L.w, wo, p.hidden, ovecs, [&](int j) { return static_cast<int64_t>(j) * 8; },
        red, [&](int j, int i, float v) { h[j * 8 + i] = hh == 0 ? v : h[j * 8 + i] + v; });
  }
  for (int64_t c0 = 0; c0 < p.hidden; c0 += kSplitHeadReduceFloats) {
    const int64_t left = p.hidden - c0;
    const int piece = left < kSplitHeadReduceFloats ? static_cast<int>(left) : kSplitHeadReduceFloats;
    for (int e = threadIdx.x; e < kSplitHeadReduceFloats; e += kBlockThreads) {
      scores[e] = e < piece ? h[c0 + e] : 0.f;
    }
    reduce(reinterpret_cast<uint4*>(scores));
    for (int e = threadIdx.x; e < piece; e += kBlockThreads) {
      const int64_t col = c0 + e;
      if (col >= o_first * 8 && col < (o_first + o_count) * 8) partial_row[col] = scores[e];
    }
  }
  gather.finish();
}

}  // namespace jax_cluster
