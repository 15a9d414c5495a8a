// The MoE decode expert GEMVs (params.h has the algorithm; launch.cu launches them).
//
// GEMV block = (column tile of `cols` columns, grid row), 256 threads. Grid row j < min(E,
// N k) is the j-th chosen expert (nth_chosen_expert: the distinct ids as a bit set; none:
// the block exits), whose (row, slot) pairs the block lists (scan_pairs: a ballot per warp
// and a prefix over the warps, in pair order); the rows after them are the shared experts'
// chunks (params.h), chosen by every row. Then, per pass of up to MR pairs, the weight
// tile is streamed once (one pass whenever the expert has at most MR pairs: every row of a
// batch of <= 8, and the typical expert of a larger batch):
//   tensor cores (16-bit weights, tiles of 64 or 128 columns; moe_mma_pass): the pairs'
//     input rows (x for gate/up, h for down) staged as 16-bit [pair][K]; warp = (matrix,
//     64-column half, K row group), weights straight into registers (3 16-row steps in
//     flight), byte-permuted into mma A fragments (jax_cluster/gemv_mma.cuh); the K groups
//     summed in group order;
//   CUDA cores (fp32 weights, 32-column tiles): the input rows staged as fp32 [K row][pair]
//     in chunks; each thread owns 8 columns (one 16-byte weight load per matrix per K row)
//     and a K slice (K rows ks, ks + S, ...; S = 256 / (cols / 8) slices) and accumulates
//     every pair in fp32 registers; K slices summed in a fixed order: a shuffle tree
//     inside the warp, then the 8 warps in index order through shared memory.
//   gate/up: two matrices; h = round(silu(g) * u) to T, written to h [pair][I].
//   down:    one matrix; the fp32 sums written to y_e [pair][H].
//   Down is a PDL launch: its blocks scan the ids and issue their first weight steps before
//   they wait for gate/up's h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "jax_cluster/activation.cuh"
#include "jax_cluster/gemv_mma.cuh"
#include "jax_cluster/mma.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "ops/moe_decode/params.h"

namespace jax_cluster {
namespace moe {

constexpr int kThreads = kMoeDecodeThreads;
constexpr int kWarps = kThreads / 32;

struct GemvArgs {
  const void* a;         // input rows: x [N, H] (gate/up) or h [pairs, I] (down)
  const void* w0;        // w_gate (gate/up) or w_down (down): [E][K][cols_total]
  const void* w1;        // w_up (gate/up) or null
  const int32_t* ids;    // [pairs]
  void* out;             // h [pairs][I] (T, gate/up) or y_e [pairs][H] (fp32, down)
  int64_t pairs;         // N * k
  int64_t row_div;       // input row of pair p: p / row_div (k for gate/up, 1 for down)
  int64_t k;             // K: H (gate/up) or I (down)
  int64_t n;             // output columns: I (gate/up) or H (down)
  int experts;           // E
  int routed_rows;       // grid rows of routed experts: min(E, pairs); then the shared chunks
  int64_t rows;          // N
  int64_t inter;         // I (a shared chunk's width)
  int64_t shared_width;  // Is (0: no shared experts)
  const void* s0;        // s_gate (gate/up) or s_down (down)
  const void* s1;        // s_up (gate/up) or null
  int cols;              // column tile: 32, 64 or 128
  bool wait_prior;       // PDL: wait for the previous kernel before reading `a`
};

// Ranks [first, first + MR) of the pairs whose id is `expert` (in pair order) -> list;
// returns how many pairs chose the expert. Called by every thread of the block (barriers
// inside; list is complete when it returns).
template <int MR>
__device__ __forceinline__ int scan_pairs(const int32_t* ids, int64_t pairs, int expert, int first, int* list,
                          int* warp_counts) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int base = 0;
  for (int64_t c0 = 0; c0 < pairs; c0 += kThreads) {
    const int64_t p = c0 + tid;
    const bool hit = p < pairs && __ldg(ids + p) == expert;
    const unsigned ballot = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = base, chunk = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = warp_counts[w];
      before += w < warp ? c : 0;
      chunk += c;
    }
    before += __popc(ballot & ((1u << lane) - 1u));
    if (hit && before >= first && before < first + MR) list[before - first] = static_cast<int>(p);
    base += chunk;
    __syncthreads();  // warp_counts is rewritten by the next chunk
  }
  return base;
}

// The j-th smallest expert id some pair chose, or -1 when fewer than j + 1 distinct
// experts were chosen. The grid's y dimension counts chosen experts, not all E: a block
// whose expert nobody chose would still be scheduled (and at batch 1, 58 of V2-Lite's 64
// experts' blocks queued ahead of the working ones). `bits` holds ceil(E / 32) words of
// shared memory; ids outside [0, E) choose nothing. Called by every thread of the block.
inline __device__ int nth_chosen_expert(const int32_t* ids, int64_t pairs, int experts, int j, unsigned* bits,
                                 int* warp_counts) {
  __shared__ int found;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int words = (experts + 31) / 32;
  for (int w = tid; w < words; w += kThreads) bits[w] = 0u;
  if (tid == 0) found = -1;
  __syncthreads();
  for (int64_t p = tid; p < pairs; p += kThreads) {
    const int id = __ldg(ids + p);
    if (id >= 0 && id < experts) atomicOr(bits + (id >> 5), 1u << (id & 31));  // order-free: a set
  }
  __syncthreads();
  // Thread t counts the chosen experts of its words [w0, w1); an exclusive prefix over the
  // threads gives the rank of its first one.
  const int per = (words + kThreads - 1) / kThreads, w0 = min(words, tid * per), w1 = min(words, w0 + per);
  int count = 0;
  for (int w = w0; w < w1; ++w) count += __popc(bits[w]);
  int incl = count;
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) warp_counts[warp] = incl;
  __syncthreads();
  int before = incl - count;
  for (int w = 0; w < warp; ++w) before += warp_counts[w];
  if (j >= before && j < before + count) {
    int r = j - before;
    for (int w = w0; w < w1; ++w) {
      unsigned m = bits[w];
      const int c = __popc(m);
      if (r < c) {
        for (; r > 0; --r) m &= m - 1u;  // drop the r lowest chosen
        found = w * 32 + __ffs(m) - 1;
        break;
      }
      r -= c;
    }
  }
  __syncthreads();
  return found;
}

// The MR staged inputs of K row r (fp32 [r][MR] in shared memory).
template <int MR>
__device__ __forceinline__ void load_rows(const float* xs, float (&v)[MR]) {
  if constexpr (MR % 4 == 0) {
#pragma unroll
    for (int j = 0; j < MR; j += 4) {
      const float4 q = *reinterpret_cast<const float4*>(xs + j);
      v[j] = q.x, v[j + 1] = q.y, v[j + 2] = q.z, v[j + 3] = q.w;
    }
  } else if constexpr (MR == 2) {
    const float2 q = *reinterpret_cast<const float2*>(xs);
    v[0] = q.x, v[1] = q.y;
  } else {
    v[0] = xs[0];
  }
}

// 16-row steps in flight per warp on the tensor-core path (4 loads of 16 bytes per lane each).
constexpr int kMmaStepsInFlight = 3;
// 16-byte vectors of a pass's staged inputs each thread loads at once.
constexpr int kStageBatch = 2;

// One pass of the tensor-core path (16-bit weights, tiles of 64 or 128 columns): the
// pass's `count` input rows times this block's weight tile over all K, summed into
// red[(group * kMat + matrix) * MR + pair][cols] (group = the warp's K row group).
// Warp = (matrix, 64-column half, K row group); weights go straight into registers and
// through jax_cluster/gemv_mma.cuh, the staged inputs ([pair][K] 16-bit) are the B fragments.
template <typename T, int MR, bool kUp>
__device__ void moe_mma_pass(const GemvArgs& a, const T* w0, const T* w1, int64_t ld, int64_t ncols, int64_t krows,
                             int count, int first, bool shared, const int* list, float* smem, bool wait_prior) {
  constexpr int kMat = kUp ? 2 : 1, U = kMmaStepsInFlight;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  const int halves = a.cols / 64, groups = kWarps / kMat / halves;
  const int m = kUp ? warp / (kWarps / 2) : 0, rest = kUp ? warp % (kWarps / 2) : warp;
  const int half = rest % halves, rg = rest / halves;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * a.cols + half * 64 + 8 * g;
  const bool col_ok = col < ncols;  // widths % 8 == 0: a lane's 8 columns are all in or all out
  const T* w = (m ? w1 : w0) + col;
  const T* in = static_cast<const T*>(a.a);
  T* xs = reinterpret_cast<T*>(smem);
  const int64_t chunk_rows = moe_decode_chunk_rows(MR), stride = moe_decode_mma_stride(min(krows, chunk_rows));
  float acc[4][4];
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[q][j] = 0.f;
  for (int64_t r0 = 0; r0 < krows; r0 += chunk_rows) {
    const int rows = static_cast<int>(min(chunk_rows, krows - r0)), steps = (rows + 15) / 16;
    auto load = [&](uint4 (&v)[4], int s) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = 16 * s + 4 * c + i;
        v[i] = col_ok && s < steps && r < rows ? ptx::ldg_stream(w + (r0 + r) * ld) : make_uint4(0u, 0u, 0u, 0u);
      }
    };
    // The input rows, staged [pair][K] 16-bit with rows past `rows` (to the last 16-row step)
    // and pairs past `count` zero, as 8-element vectors: the first kStageBatch per thread are
    // loaded before the weights (so they do not queue behind them), the rest a batch at a
    // time, each batch's loads issued together.
    const int vecs_row = 2 * steps, vecs = MR * vecs_row;
    auto load_inputs = [&](uint4 (&xv)[kStageBatch], int e0) {
#pragma unroll
      for (int u = 0; u < kStageBatch; ++u) {
        const int e = e0 + u * kThreads, j = e / vecs_row, q = 8 * (e - j * vecs_row);
        xv[u] = make_uint4(0u, 0u, 0u, 0u);
        if (e < vecs && j < count && q < rows) {
          const int64_t in_row = kUp && shared ? first + j : list[j] / a.row_div;
          xv[u] = *reinterpret_cast<const uint4*>(in + in_row * a.k + r0 + q);  // k, r0, q: multiples of 8
        }
      }
    };
    auto store_inputs = [&](const uint4 (&xv)[kStageBatch], int e0) {
#pragma unroll
      for (int u = 0; u < kStageBatch; ++u) {
        const int e = e0 + u * kThreads, j = e / vecs_row, q = 8 * (e - j * vecs_row);
        if (e < vecs) *reinterpret_cast<uint4*>(xs + j * stride + q) = xv[u];  // stride % 16 == 0
      }
    };
    // wait_prior (the first chunk of a PDL launch's first pass): the weights, which depend on
    // nothing, are asked for before the wait for the previous kernel's inputs.
    const bool wait = wait_prior && r0 == 0;
    uint4 xv[kStageBatch];
    if (!wait) load_inputs(xv, tid);
    uint4 wv[U][4];
#pragma unroll
    for (int u = 0; u < U; ++u) load(wv[u], rg + u * groups);
    if (wait) {
      ptx::griddep_wait();
      load_inputs(xv, tid);
    }
    __syncthreads();  // the previous chunk's (or pass's) readers are done
    store_inputs(xv, tid);
    for (int e0 = tid + kStageBatch * kThreads; e0 < vecs; e0 += kStageBatch * kThreads) {
      load_inputs(xv, e0);
      store_inputs(xv, e0);
    }
    __syncthreads();
    gemv_mma_stream(wv, rg, groups, steps, [&](const uint4 (&w4)[4], int ss) {
      uint2 b = make_uint2(0u, 0u);
      if (g < MR) b = *reinterpret_cast<const uint2*>(xs + g * stride + 16 * ss + 4 * c);
      gemv_mma_step<T>(w4, b.x, b.y, acc);
    }, load);
  }
  __syncthreads();  // the staged inputs are dead: `red` overlays them
  // acc[q] = {(col, pair), (col, pair + 1), (col + 1, pair), (col + 1, pair + 1)}, col = 8g + 2q
  // of the half, pair = 2c.
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int pair = 2 * c + (j & 1), cc = half * 64 + 8 * g + 2 * q + (j >> 1);
      if (pair < MR) smem[((rg * kMat + m) * MR + pair) * a.cols + cc] = acc[q][j];
    }
  __syncthreads();
}

// kMma: the tensor-core path (16-bit weights, tiles of 64 or 128 columns), a kernel of its
// own so that its lighter registers allow two blocks per SM.
template <typename T, int MR, bool kUp, bool kMma>
__global__ void __launch_bounds__(kThreads, kMma ? 2 : 1) moe_gemv_kernel(const GemvArgs a) {
  constexpr int kMat = kUp ? 2 : 1;
  // K rows in flight per thread (16-byte loads per matrix each): more where fewer
  // accumulators leave registers for them.
  constexpr int kUnroll = MR * kMat <= 4 ? 8 : 4;
  extern __shared__ __align__(16) float smem[];  // staged inputs, later the warps' partials
  __shared__ int scan_smem[kWarps + MR];  // warp_counts, then list: one array, disjoint ranges
  int* const warp_counts = scan_smem;
  int* const list = scan_smem + kWarps;
  ptx::griddep_launch_dependents();  // the next kernel may launch; it waits for our results

  // This block's weights: a routed expert's [K][n] tile, or a shared chunk c: columns
  // [c I, c I + I) of s_gate / s_up (row stride Is), or rows [c I, c I + I) of s_down.
  const int row = blockIdx.y;
  const bool shared = row >= a.routed_rows;
  const int chunk = row - a.routed_rows;
  int expert = -1, total = a.rows;  // a shared chunk: every row once
  int64_t ld = a.n, ncols = a.n, krows = a.k;
  const T *w0, *w1 = nullptr;
  if (!shared) {
    expert = nth_chosen_expert(a.ids, a.pairs, a.experts, row, reinterpret_cast<unsigned*>(smem), warp_counts);
    if (expert < 0) return;  // fewer experts chosen than the grid has rows
    total = scan_pairs<MR>(a.ids, a.pairs, expert, 0, list, warp_counts);
    if (total == 0) return;
    const int64_t off = static_cast<int64_t>(expert) * a.k * a.n;
    w0 = static_cast<const T*>(a.w0) + off;
    if constexpr (kUp) w1 = static_cast<const T*>(a.w1) + off;
  } else {
    const int64_t c0 = static_cast<int64_t>(chunk) * a.inter, width = min(a.inter, a.shared_width - c0);
    if constexpr (kUp) {
      ld = a.shared_width;
      ncols = width;
      w0 = static_cast<const T*>(a.s0) + c0;
      w1 = static_cast<const T*>(a.s1) + c0;
    } else {
      krows = width;
      w0 = static_cast<const T*>(a.s0) + c0 * a.n;
    }
  }
  // The tensor-core pass waits inside, after its first weight loads.
  if (a.wait_prior && !kMma) ptx::griddep_wait();
  // 16-bit weights in tiles of 64 or 128 columns run on the tensor cores (moe_mma_pass);
  // fp32 weights and 32-column tiles on the CUDA cores below.
  static_assert(!kMma || !std::is_same_v<T, float>, "the tensor cores take 16-bit weights");
  const T* const tile0 = w0;
  const T* const tile1 = w1;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int groups = a.cols / 8;             // 8-column groups of the tile
  const int rows_per_warp = 32 / groups;     // K rows a warp covers per step
  const int slices = kWarps * rows_per_warp;  // K rows the block covers per step
  const int cg = lane % groups, ks = warp * rows_per_warp + lane / groups;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * a.cols + cg * 8;
  const bool col_ok = col < ncols;  // widths % 8 == 0: a group is all in or all out
  w0 += col;
  if constexpr (kUp) w1 += col;
  const T* in = static_cast<const T*>(a.a);
  const int64_t chunk_rows = moe_decode_chunk_rows(MR);
  // A shared chunk's pairs: a.pairs + chunk N + n; its gate/up input row is n.
  const int64_t shared_base = a.pairs + static_cast<int64_t>(chunk) * a.rows;

  for (int first = 0; first < total; first += MR) {
    if (shared) {
      __syncthreads();  // the previous pass's readers of `list` are done
      if (tid < MR) list[tid] = static_cast<int>(shared_base + first + tid);
      __syncthreads();  // (as scan_pairs ends) the pass reads `list` before its next barrier
    } else if (first > 0) {
      scan_pairs<MR>(a.ids, a.pairs, expert, first, list, warp_counts);
    }
    const int count = min(MR, total - first);
    if constexpr (kMma) {
      moe_mma_pass<T, MR, kUp>(a, tile0, tile1, ld, ncols, krows, count, first, shared, list, smem,
                               a.wait_prior && first == 0);
    } else {
      float acc[kMat][MR][8];
      zero_acc(acc);
      for (int64_t r0 = 0; r0 < krows; r0 += chunk_rows) {
        const int rows = static_cast<int>(min(chunk_rows, krows - r0));
        __syncthreads();  // the previous chunk's (or pass's) readers are done
        for (int e = tid; e < MR * rows; e += kThreads) {
          const int j = e / rows, q = e - j * rows;
          float v = 0.f;
          if (j < count) {
            const int64_t pair = list[j];
            const int64_t in_row = kUp && shared ? first + j : pair / a.row_div;
            v = to_float(in[in_row * a.k + r0 + q]);
          }
          smem[q * MR + j] = v;
        }
        __syncthreads();
        for (int r = ks; r < rows; r += slices * kUnroll) {
          uint4 v0[kUnroll], v1[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int rr = r + u * slices;
            const bool ok = col_ok && rr < rows;
            const int64_t off = (r0 + rr) * ld;
            v0[u] = ok ? ptx::ldg_stream(w0 + off) : make_uint4(0, 0, 0, 0);
            if constexpr (kUp) v1[u] = ok ? ptx::ldg_stream(w1 + off) : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int rr = r + u * slices;
            if (rr < rows) {
              float xv[MR];
              load_rows<MR>(smem + rr * MR, xv);
              float wf[8];
              unpack<T>(v0[u], wf);
#pragma unroll
              for (int j = 0; j < MR; ++j)
#pragma unroll
                for (int c = 0; c < 8; ++c) acc[0][j][c] = fmaf(xv[j], wf[c], acc[0][j][c]);
              if constexpr (kUp) {
                unpack<T>(v1[u], wf);
#pragma unroll
                for (int j = 0; j < MR; ++j)
#pragma unroll
                  for (int c = 0; c < 8; ++c) acc[1][j][c] = fmaf(xv[j], wf[c], acc[1][j][c]);
              }
            }
          }
        }
      }
      // K slices: the warp's lanes of one column group (a fixed shuffle tree), then the warps
      // in order through shared memory (overlaying the staged inputs).
#pragma unroll
      for (int m = 0; m < kMat; ++m)
#pragma unroll
        for (int j = 0; j < MR; ++j)
#pragma unroll
          for (int c = 0; c < 8; ++c)
            for (int off = groups; off < 32; off *= 2) acc[m][j][c] += __shfl_xor_sync(0xffffffffu, acc[m][j][c], off);
      __syncthreads();
      if (lane < groups) {
#pragma unroll
        for (int m = 0; m < kMat; ++m)
#pragma unroll
          for (int j = 0; j < MR; ++j) {
            float* dst = smem + ((warp * kMat + m) * MR + j) * a.cols + cg * 8;
            *reinterpret_cast<float4*>(dst) = make_float4(acc[m][j][0], acc[m][j][1], acc[m][j][2], acc[m][j][3]);
            *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[m][j][4], acc[m][j][5], acc[m][j][6], acc[m][j][7]);
          }
      }
      __syncthreads();
    }
    // the K groups' partials, summed in group order
    const int partials = kMma ? kWarps / kMat / (a.cols / 64) : kWarps;
    for (int e = tid; e < count * a.cols; e += kThreads) {
      const int j = e / a.cols, c = e - j * a.cols;
      const int64_t out_col = static_cast<int64_t>(blockIdx.x) * a.cols + c;
      if (out_col >= ncols) continue;
      float s0 = 0.f, s1 = 0.f;
      for (int w = 0; w < partials; ++w) {
        s0 += smem[((w * kMat) * MR + j) * a.cols + c];
        if constexpr (kUp) s1 += smem[((w * kMat + 1) * MR + j) * a.cols + c];
      }
      const int64_t dst = static_cast<int64_t>(list[j]) * a.n + out_col;
      if constexpr (kUp) {
        static_cast<T*>(a.out)[dst] = from_float<T>(silu(s0) * s1);
      } else {
        static_cast<float*>(a.out)[dst] = s0;
      }
    }
    // the next pass's scan rewrites `list` only after a barrier; its staging after another
  }
}


// The GEMV kernel for tiles of `cols` columns: on the tensor cores where it can run.
template <typename T, int MR, bool kUp>
auto gemv_kernel(int cols) {
  if constexpr (std::is_same_v<T, float>) {
    return moe_gemv_kernel<T, MR, kUp, false>;
  } else {
    return cols >= 64 ? moe_gemv_kernel<T, MR, kUp, true> : moe_gemv_kernel<T, MR, kUp, false>;
  }
}

}  // namespace moe
}  // namespace jax_cluster
