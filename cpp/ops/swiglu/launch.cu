// DeepFusionKernel's single deeply fused SwiGLU kernel (SwigluVariant::kFused, see
// params.h): the whole MLP in ONE persistent cluster kernel, A2 never leaving the chip.
//
// Engine, per block of 256 threads (8 warps):
//  * a stage is B = 64 K-rows x 128 columns (two 64-column halves: the [w_gate | w_up]
//    tile for the up GEMMs, two adjacent 64-column chunks of w_down for the down GEMM),
//    plus, for the up GEMMs, A = R rows x 64 K-columns of x; 16-byte cp.async copies into
//    XOR-swizzled shared memory, `stages` deep;
//  * warp w owns columns [16w, 16w + 16) of the stage: per 16-deep K step one
//    ldmatrix.x4.trans of B, one ldmatrix.x4 of A per 16-row tile and two
//    mma.m16n8k16 (fp32 accumulators: row_tiles x 2 x 4 per thread);
//  * the blocks of a cluster split D; their fp32 gate/up partials are combined by a
//    reduce-scatter over distributed shared memory (st.async into per-sender slots, one
//    mbarrier with a transaction count, sums in rank order: deterministic), A2 by an
//    all-gather.
// launch_swiglu (bottom) dispatches every variant.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/activation.cuh"
#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/launch.cuh"
#include "jax_cluster/mma.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/tma.cuh"
#include "jax_cluster/vec.cuh"
#include "jax_cluster/zero_words.cuh"
#include "ops/swiglu/launch.h"

namespace jax_cluster {
namespace {

constexpr int kThreads = 256;
constexpr int kStageB = static_cast<int>(kSwigluStageB);  // bytes of B in a stage
constexpr int kBRowBytes = 256;                           // B stage row: 128 x 16 bit

// ------------------------------------------------------------------ math
__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// Four floats -> four 16-bit values (round to nearest even) in one 8-byte word.
template <typename T>
__device__ __forceinline__ uint2 pack4(float a, float b, float c, float d) {
  return make_uint2(pack2<T>(a, b), pack2<T>(c, d));
}

template <typename T>
__device__ __forceinline__ float4 unpack4(uint2 v) {
  const T* e = reinterpret_cast<const T*>(&v);
  return make_float4(to_float(e[0]), to_float(e[1]), to_float(e[2]), to_float(e[3]));
}

// ------------------------------------------------------------------ tile engine
// One stage of MMAs: warp `warp` multiplies A rows [0, 16 MT) x K [k0, k0 + 64) (A at
// a_base, rows of a_row_bytes, k0 = 64 a_chunk0 / 8) by B stage columns [16 warp, +16).
template <typename T, int MT>
__device__ __forceinline__ void mma_stage(float (&acc)[MT][2][4], uint32_t a_base,
                                          int a_row_bytes, int a_chunk0, uint32_t b_base,
                                          int warp, int lane) {
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;  // row this lane addresses
  const int lchunk = lane >> 4;                          // +0 / +1 chunk (8 elements)
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t b[4];
    ldsm_x4_trans(b, b_base + swz(kk * 16 + lrow, warp * 2 + lchunk, kBRowBytes));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint32_t a[4];
      ldsm_x4(a, a_base + swz(mt * 16 + lrow, a_chunk0 + kk * 2 + lchunk, a_row_bytes));
      mma16816<T>(acc[mt][0], a, b[0], b[1]);
      mma16816<T>(acc[mt][1], a, b[2], b[3]);
    }
  }
}

// Accumulator element (mt, nt, i) sits at row 16 mt + lane/4 (+8 for i >= 2), column
// 16 warp + 8 nt + 2 (lane % 4) + (i & 1) of the warp's stage columns. Writes (kAdd: adds)
// the warp's 16 columns at dst[row * ld + col0 + ...] (fp32).
template <int MT, bool kAdd>
__device__ __forceinline__ void store_acc(float* dst, int ld, int col0,
                                          const float (&acc)[MT][2][4], int lane) {
  const int r = lane >> 2, c = 2 * (lane & 3);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float2* p = reinterpret_cast<float2*>(dst + (mt * 16 + r + 8 * h) * ld + col0 + nt * 8 + c);
        float2 v = make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
        if (kAdd) {
          const float2 o = *p;
          v.x += o.x;
          v.y += o.y;
        }
        *p = v;
      }
    }
  }
}

// Issues one stage: B rows [k0, k0 + 64) of columns [0, 64) from b0 and [64, 128) from b1
// (skipped when b1 is null), and, when a is not null, A rows [0, R) (rows >= a_rows are
// zero-filled) x columns [k0a, k0a + 64).
template <typename T, int MT>
__device__ __forceinline__ void issue_stage(uint32_t stage, const T* b0, const T* b1,
                                            int64_t b_ld, int64_t k0, const T* a, int64_t a_ld,
                                            int64_t a_rows, int64_t k0a, bool hint,
                                            uint64_t policy) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < (64 * 16) / kThreads; ++i) {
    const int v = tid + i * kThreads, row = v >> 4, chunk = v & 15;
    const T* base = chunk < 8 ? b0 : b1;
    if (base != nullptr) {
      cp_async_16_hinted(stage + swz(row, chunk, kBRowBytes),
                         base + (k0 + row) * b_ld + (chunk & 7) * 8, hint, policy);
    }
  }
  if (a != nullptr) {
    constexpr int R = 16 * MT;
    const uint32_t a_stage = stage + kStageB;
#pragma unroll
    for (int i = 0; i < (R * 8 + kThreads - 1) / kThreads; ++i) {
      const int v = tid + i * kThreads;
      if (v < R * 8) {
        const int row = v >> 3, chunk = v & 7;
        const bool ok = row < a_rows;
        cp_async_16(a_stage + swz(row, chunk, 128), ok ? a + row * a_ld + k0a + chunk * 8 : a,
                    ok ? 16u : 0u);
      }
    }
  }
}

// Reduce-scatter of the fp32 partials part[R][ld] over the cluster, rows [0, rows):
// piece j = `nseg` segments of `w` columns at part columns seg_off * s + j w. Every
// block sends piece j to block j's receive slot (one slot per sender, [N][rows][nseg][w]),
// then waits for the N - 1 pieces addressed to it. sum_piece() adds them in rank order.
__device__ __forceinline__ void send_pieces(const float* part, int ld, int seg_off, float* recv,
                                            int rows, int nseg, int w, uint64_t* full,
                                            uint32_t parity, int n, uint32_t rank) {
  const int vw = w / 4, per_row = nseg * vw, per_peer = rows * per_row;
  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(full, static_cast<uint32_t>((n - 1) * per_peer * 16));
  }
  for (int i = threadIdx.x; i < (n - 1) * per_peer; i += kThreads) {
    const int pj = i / per_peer, e = i - pj * per_peer;
    const uint32_t peer = static_cast<uint32_t>(pj) + (static_cast<uint32_t>(pj) >= rank);
    const int row = e / per_row, rem = e - row * per_row, seg = rem / vw, v = rem - seg * vw;
    const uint4 val = *reinterpret_cast<const uint4*>(part + row * ld + seg * seg_off +
                                                      peer * w + 4 * v);
    const float* dst = recv + ((static_cast<int>(rank) * rows + row) * nseg + seg) * w + 4 * v;
    ptx::st_async_16(ptx::map_to_rank(ptx::smem_addr(dst), peer), val,
                     ptx::map_to_rank(ptx::smem_addr(full), peer));
  }
  ptx::mbarrier_wait_cluster_or_trap(full, parity);
}

// Sum over the cluster (rank order) of vector v of segment seg of row `row` of my piece.
__device__ __forceinline__ float4 sum_piece(const float* part, int ld, int seg_off,
                                            const float* recv, int rows, int nseg, int w,
                                            int row, int seg, int v, int n, uint32_t rank) {
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int q = 0; q < n; ++q) {
    const float* src = q == static_cast<int>(rank)
                           ? part + row * ld + seg * seg_off + static_cast<int>(rank) * w + 4 * v
                           : recv + ((q * rows + row) * nseg + seg) * w + 4 * v;
    s = add4(s, *reinterpret_cast<const float4*>(src));
  }
  return s;
}

// ------------------------------------------------------------------ fused kernel
struct FusedArgs {
  const void* x;
  const void* w_gate;
  const void* w_up;
  const void* w_down;
  const void* residual;  // may be null
  void* y;
  unsigned int* counters;  // [16], zeroed before the launch
  float* partial;          // [C][m][D] (C > 1)
  int64_t m, d, f;
  int cluster;
  int clusters;
  int group;   // F tiles per exchange
  int stages;
  int passes;  // ceil(m / R)
  bool hint;
};

// Position in the fixed sequence of stages a block streams:
//   for pass: for group of <= `group` F tiles:
//     up:   for tile s of the group: for K block kb of this rank: [x | w_gate | w_up]
//     down: for column pair q of this rank: for tile s of the group: w_down
struct Cursor {
  int pass;
  int64_t ts;  // first F tile of the group
  int g;       // tiles in the group
  int phase;   // 0 up, 1 down
  int s;
  int64_t kb;
  int q;
  bool done;
};

struct FusedGeometry {
  int passes;
  int64_t t_begin, t_end;  // this cluster's F tiles
  int group;
  int64_t kb0, kb1;  // this rank's 64-blocks of D: K of the up GEMMs, columns of the down GEMM
  int pairs;         // ceil((kb1 - kb0) / 2)
};

__device__ __forceinline__ void cursor_start(Cursor& c, const FusedGeometry& g) {
  c.pass = 0;
  c.ts = g.t_begin;
  c.g = static_cast<int>(min(static_cast<int64_t>(g.group), g.t_end - g.t_begin));
  c.phase = 0;
  c.s = 0;
  c.kb = g.kb0;
  c.q = 0;
  c.done = g.t_begin >= g.t_end || g.passes == 0 || g.kb0 >= g.kb1;
}

__device__ __forceinline__ void cursor_next(Cursor& c, const FusedGeometry& g) {
  if (c.phase == 0) {
    if (++c.kb < g.kb1) return;
    c.kb = g.kb0;
    if (++c.s < c.g) return;
    c.s = 0;
    c.phase = 1;
    c.q = 0;
    return;
  }
  if (++c.s < c.g) return;
  c.s = 0;
  if (++c.q < g.pairs) return;
  c.q = 0;
  c.phase = 0;
  c.ts += c.g;
  if (c.ts >= g.t_end) {
    c.ts = g.t_begin;
    if (++c.pass >= g.passes) {
      c.done = true;
      return;
    }
  }
  c.g = static_cast<int>(min(static_cast<int64_t>(g.group), g.t_end - c.ts));
}

template <typename T, int MT>
__device__ __forceinline__ void fused_issue(const FusedArgs& args, const FusedGeometry& geo,
                                            const Cursor& c, uint32_t stage, int rows_pass,
                                            uint64_t policy) {
  constexpr int R = 16 * MT;
  const int64_t tile = c.ts + c.s;
  if (c.phase == 0) {
    const T* x = static_cast<const T*>(args.x) + static_cast<int64_t>(c.pass) * R * args.d;
    const int rows = static_cast<int>(min(static_cast<int64_t>(rows_pass), args.m - c.pass * R));
    issue_stage<T, MT>(stage, static_cast<const T*>(args.w_gate) + tile * 64,
                       static_cast<const T*>(args.w_up) + tile * 64, args.f, c.kb * 64, x,
                       args.d, rows, c.kb * 64, args.hint, policy);
  } else {
    const int64_t chunk = geo.kb0 + 2 * c.q;
    const T* b0 = static_cast<const T*>(args.w_down) + chunk * 64;
    const T* b1 = chunk + 1 < geo.kb1 ? b0 + 64 : nullptr;
    issue_stage<T, MT>(stage, b0, b1, args.d, tile * 64, static_cast<const T*>(nullptr), 0, 0,
                       0, args.hint, policy);
  }
}

template <typename T, int MT>
__global__ void __launch_bounds__(kThreads, 2) swiglu_fused_kernel(const FusedArgs args) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t full_rs, full_ag;  // reduce-scatter / all-gather arrivals
  __shared__ int last_flag;
  constexpr int R = 16 * MT;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int n = args.cluster;
  const uint32_t rank = n > 1 ? ptx::cluster_rank() : 0;
  const int cid = static_cast<int>(blockIdx.x) / n;
  const int64_t tiles = args.f / 64, dblocks = args.d / 64;

  FusedGeometry geo;
  geo.passes = args.passes;
  geo.t_begin = cid * tiles / args.clusters;
  geo.t_end = (cid + 1) * tiles / args.clusters;
  geo.group = args.group;
  geo.kb0 = rank * dblocks / n;
  geo.kb1 = (rank + 1) * dblocks / n;
  geo.pairs = static_cast<int>((geo.kb1 - geo.kb0 + 1) / 2);
  const int gw = 64 * args.group;                      // widest group, columns
  const int ncols = static_cast<int>((dblocks + n - 1) / n) * 64;  // out_acc row length

  // Shared memory: stages | part [R][2 gw] | recv [N][R][2][w] | a2 [R][gw] | out [R][ncols]
  const int stage_bytes = kStageB + R * 128;
  const uint32_t stages_addr = ptx::smem_addr(smem);
  float* part = reinterpret_cast<float*>(smem + args.stages * stage_bytes);
  float* recv = part + R * 2 * gw;
  T* a2 = reinterpret_cast<T*>(recv + R * 2 * gw);
  float* out_acc = reinterpret_cast<float*>(a2 + R * gw);
  const uint32_t a2_addr = ptx::smem_addr(a2);
  const int a2_row_bytes = gw * 2;
  // Rows of a2 past M are never written by the exchange: zero them once (they only feed
  // output rows that are discarded, but stay finite and initialised).
  for (int i = tid; i < R * gw / 8; i += kThreads) reinterpret_cast<uint4*>(a2)[i] = make_uint4(0, 0, 0, 0);

  if (n > 1) {
    if (tid == 0) {
      ptx::mbarrier_init(&full_rs, 1);
      ptx::mbarrier_init(&full_ag, 1);
      ptx::fence_mbarrier_init_cluster();
    }
    ptx::cluster_arrive();
  }
  bool cluster_waited = false;
  const uint64_t policy = ptx::l2_evict_first();
  const int S = args.stages;

  Cursor prod, cons;
  cursor_start(prod, geo);
  cursor_start(cons, geo);
  for (int s = 0; s < S - 1; ++s) {
    if (!prod.done) {
      const int rp = static_cast<int>(min(static_cast<int64_t>(R), args.m - prod.pass * R));
      fused_issue<T, MT>(args, geo, prod, stages_addr + s * stage_bytes, rp, policy);
      cursor_next(prod, geo);
    }
    cp_async_commit();
  }
  float acc[MT][2][4];
  zero_acc(acc);
  uint32_t exchanges = 0;
  for (int i = 0; !cons.done; ++i) {
    cp_async_wait_dyn(S - 2);
    __syncthreads();
    if (!prod.done) {
      const int rp = static_cast<int>(min(static_cast<int64_t>(R), args.m - prod.pass * R));
      fused_issue<T, MT>(args, geo, prod, stages_addr + ((i + S - 1) % S) * stage_bytes, rp,
                         policy);
      cursor_next(prod, geo);
    }
    cp_async_commit();
    const uint32_t st = stages_addr + (i % S) * stage_bytes;
    const int rows = static_cast<int>(min(static_cast<int64_t>(R), args.m - cons.pass * R));
    if (cons.phase == 0) {
      // ---- gate/up GEMMs over this rank's K blocks, tile cons.s of the group
      if (cons.kb == geo.kb0) zero_acc(acc);
      mma_stage<T, MT>(acc, st + kStageB, 128, 0, st, warp, lane);
      if (cons.kb == geo.kb1 - 1) {
        // warps 0-3 hold gate columns, 4-7 up columns of tile s
        const int col0 = (warp < 4 ? 0 : gw) + cons.s * 64 + (warp & 3) * 16;
        store_acc<MT, false>(part, 2 * gw, col0, acc, lane);
        if (cons.s == cons.g - 1) {
          // ---- group complete: reduce-scatter, SiLU * up on my piece, all-gather A2
          const int w = 64 * cons.g / n, vw = w / 4;
          __syncthreads();
          if (n > 1) {
            if (!cluster_waited) {
              ptx::cluster_wait();
              cluster_waited = true;
            }
            send_pieces(part, 2 * gw, gw, recv, rows, 2, w, &full_rs, exchanges & 1, n, rank);
          }
          for (int e = tid; e < rows * vw; e += kThreads) {
            const int row = e / vw, v = e - row * vw;
            const float4 g = sum_piece(part, 2 * gw, gw, recv, rows, 2, w, row, 0, v, n, rank);
            const float4 u = sum_piece(part, 2 * gw, gw, recv, rows, 2, w, row, 1, v, n, rank);
            const int col = static_cast<int>(rank) * w + 4 * v;
            *reinterpret_cast<uint2*>(reinterpret_cast<uint8_t*>(a2) +
                                      swz(row, col >> 3, a2_row_bytes) + (col & 7) * 2) =
                pack4<T>(silu(g.x) * u.x, silu(g.y) * u.y, silu(g.z) * u.z, silu(g.w) * u.w);
          }
          __syncthreads();  // my piece is in a2; every read of recv / part is done
          if (n > 1) {
            const int per_peer = rows * vw;
            if (tid == 0) {
              ptx::mbarrier_arrive_expect_tx(&full_ag,
                                             static_cast<uint32_t>((n - 1) * per_peer * 8));
            }
            for (int e = tid; e < (n - 1) * per_peer; e += kThreads) {
              const int pj = e / per_peer, r2 = e - pj * per_peer;
              const uint32_t peer =
                  static_cast<uint32_t>(pj) + (static_cast<uint32_t>(pj) >= rank);
              const int row = r2 / vw, v = r2 - row * vw;
              const int col = static_cast<int>(rank) * w + 4 * v;
              const uint32_t off = swz(row, col >> 3, a2_row_bytes) + (col & 7) * 2;
              const uint2 val =
                  *reinterpret_cast<const uint2*>(reinterpret_cast<const uint8_t*>(a2) + off);
              ptx::st_async_8(ptx::map_to_rank(a2_addr + off, peer), val,
                         ptx::map_to_rank(ptx::smem_addr(&full_ag), peer));
            }
            ptx::mbarrier_wait_cluster_or_trap(&full_ag, exchanges & 1);
            __syncthreads();
          }
          ++exchanges;
        }
      }
    } else {
      // ---- down GEMM: A2 [rows, group] x w_down[group rows, column pair q of this rank]
      if (cons.s == 0) zero_acc(acc);
      const int64_t chunk = geo.kb0 + 2 * cons.q;
      const int valid_cols = chunk + 1 < geo.kb1 ? 128 : 64;
      if (warp * 16 < valid_cols) mma_stage<T, MT>(acc, a2_addr, a2_row_bytes, cons.s * 8, st, warp, lane);
      if (cons.s == cons.g - 1) {
        if (warp * 16 < valid_cols) {
          const int col0 = cons.q * 128 + warp * 16;
          if (cons.ts == geo.t_begin) {
            store_acc<MT, false>(out_acc, ncols, col0, acc, lane);
          } else {
            store_acc<MT, true>(out_acc, ncols, col0, acc, lane);
          }
        }
        if (cons.q == geo.pairs - 1 && cons.ts + cons.g >= geo.t_end) {
          // ---- pass complete: this cluster's partial rows -> workspace (or y)
          __syncthreads();
          const int my_cols = static_cast<int>(geo.kb1 - geo.kb0) * 64, vpr = my_cols / 4;
          const int64_t row0 = static_cast<int64_t>(cons.pass) * R;
          for (int e = tid; e < rows * vpr; e += kThreads) {
            const int row = e / vpr, v = e - row * vpr;
            const int64_t m = row0 + row, col = geo.kb0 * 64 + 4 * v;
            float4 val = *reinterpret_cast<const float4*>(out_acc + row * ncols + 4 * v);
            if (args.clusters > 1) {
              *reinterpret_cast<float4*>(args.partial + (cid * args.m + m) * args.d + col) = val;
            } else {
              if (args.residual != nullptr) {
                val = add4(val, unpack4<T>(*reinterpret_cast<const uint2*>(
                                    static_cast<const T*>(args.residual) + m * args.d + col)));
              }
              *reinterpret_cast<uint2*>(static_cast<T*>(args.y) + m * args.d + col) =
                  pack4<T>(val.x, val.y, val.z, val.w);
            }
          }
          __syncthreads();
        }
      }
    }
    cursor_next(cons, geo);
  }
  cp_async_wait<0>();

  if (args.clusters > 1) {
    // ---- the last cluster to finish this rank's columns sums every cluster's partial
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      const unsigned int prev = atomicAdd(args.counters + rank, 1u);
      last_flag = prev == static_cast<unsigned int>(args.clusters - 1);
    }
    __syncthreads();
    if (last_flag) {
      __threadfence();
      const int vpr = static_cast<int>(geo.kb1 - geo.kb0) * 16;
      const int64_t total = args.m * vpr;
      for (int64_t e = tid; e < total; e += kThreads) {
        const int64_t m = e / vpr;
        const int v = static_cast<int>(e - m * vpr);
        const int64_t col = geo.kb0 * 64 + 4 * v;
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int c = 0; c < args.clusters; ++c) {
          s = add4(s, __ldcg(reinterpret_cast<const float4*>(
                          args.partial + (static_cast<int64_t>(c) * args.m + m) * args.d + col)));
        }
        if (args.residual != nullptr) {
          s = add4(s, unpack4<T>(*reinterpret_cast<const uint2*>(
                          static_cast<const T*>(args.residual) + m * args.d + col)));
        }
        *reinterpret_cast<uint2*>(static_cast<T*>(args.y) + m * args.d + col) =
            pack4<T>(s.x, s.y, s.z, s.w);
      }
    }
  }
  if (n > 1) {
    if (!cluster_waited) ptx::cluster_wait();
    ptx::cluster_sync();
  }
}

// The fused kernel: one launch (after the counters' zero kernel when several clusters
// sum their partials).
template <typename T, int MT>
cudaError_t launch_fused(const SwigluParams& p, cudaStream_t stream) {
  const SwigluSmemPlan plan = swiglu_fused_smem(p);
  if (plan.stages == 0) return cudaErrorInvalidValue;
  FusedArgs a;
  a.x = p.x;
  a.w_gate = p.w_gate;
  a.w_up = p.w_up;
  a.w_down = p.w_down;
  a.residual = p.has_residual ? p.residual : nullptr;
  a.y = p.out;
  a.counters = static_cast<unsigned int*>(p.workspace);
  a.partial = reinterpret_cast<float*>(static_cast<uint8_t*>(p.workspace) + kSwigluCounterBytes);
  a.m = p.m;
  a.d = p.d;
  a.f = p.f;
  a.cluster = p.cluster_size;
  a.clusters = p.clusters;
  a.group = p.f_group;
  a.stages = plan.stages;
  a.passes = static_cast<int>(swiglu_ceil_div(p.m, 16 * MT));
  a.hint = a.passes == 1;
  if (a.clusters > 1) {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
        zero_words(static_cast<unsigned int*>(p.workspace), kSwigluCounterBytes / 4, stream));
  }
  const unsigned blocks = static_cast<unsigned>(a.clusters) * static_cast<unsigned>(a.cluster);
  return launch_cluster(swiglu_fused_kernel<T, MT>, dim3(blocks), dim3(kThreads),
                        static_cast<size_t>(plan.bytes), a.cluster, stream, a);
}

}  // namespace

cudaError_t launch_swiglu(const SwigluParams& p, cudaStream_t stream) {
  switch (p.variant) {
    case SwigluVariant::kGemv: return launch_swiglu_gemv(p, stream);
    case SwigluVariant::kTma: return launch_swiglu_tma(p, stream);
    case SwigluVariant::kFused:
      return dispatch_half(p.dtype, [&](auto t) {
        using T = typename decltype(t)::type;
        return dispatch_int<1, 2, 4>(p.row_tiles, [&](auto mt) {
          return launch_fused<T, decltype(mt)::value>(p, stream);
        });
      });
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_cluster
