// SwiGLU's weight-streaming variant (SwigluVariant::kTma, params.h): each GEMM (up:
// x @ [w_gate | w_up] -> SiLU * mul -> A2; down: A2 @ w_down + residual -> y) is ONE
// persistent stream-K kernel whose blocks stream their weights with the bulk tensor copy
// engine. The down GEMM is also the linear projection's engine (tma_gemm.h).
//
// Work: the flat sequence of units (work tile, 64-row K block), work tiles in column
// order (a weight tile's row groups side by side), K fastest; block b of G owns units
// [b U / G, (b + 1) U / G) (equal shares: no partial last wave, no idle SM). Not a queue
// of smaller work items taken from a counter: each more item end is one more partial and
// tile-counter round trip under the weight stream (slower at every M; docs/swiglu.md).
//  * up: a work tile is 128 columns of w_gate AND the same 128 columns of w_up (plus one
//    row group of x); down: 256 columns of w_down. Every weight row segment a block reads
//    is 256 (up) or 512 (down) contiguous bytes: narrower segments, read by neighbouring
//    blocks at other K offsets, stream slower from DRAM.
//  * a unit = four 64 x 64 weight boxes (8 KB each, 128-byte rows, 128B-swizzled) plus the
//    A box (x or A2: 16 MT rows x 64 K, rows past M zero-filled by the copy engine).
//
// Block = 1 producer warp + 8 consumer warps (288 threads), one per SM, a Ring of
// S stages (2, ~80 KB; 3 for an up grid that leaves a third of the SMs idle):
//  * the producer (one thread) waits for a free stage, announces its bytes and issues the
//    five boxes (weights with an L2 evict-first hint when read once), running up to
//    S units ahead, across tile boundaries and through the consumers' epilogues;
//  * the consumers multiply each stage on mma.sync (MmaSyncTile);
//  * at the end of a work tile's K range a block that owned the whole tile writes the
//    output directly; otherwise it writes its fp32 partial to slot (b + tile) of the
//    workspace and bumps the tile's integer counter. A split tile is summed, in block
//    order (deterministic), by the blocks whose ranges end in it, once its counter says
//    every partial is in: they all end at the kernel's end, together, so they share the
//    sum instead of leaving it to the last block to arrive while the others idle. The
//    blocks wait on each other: the launcher never starts more blocks than the GPU holds
//    at once, and two such grids must not share the GPU from different streams (each
//    could hold SMs the other's waiting blocks need).
//
// The down GEMM with one row group (M <= 64) and few column tiles (D / 256 <= SMs / 5)
// runs in clusters instead: a cluster of c blocks owns one tile, and its partials are
// summed over DSMEM at the end, no slots, counters or waits (reduce_tile_in_cluster).
//
// Programmatic dependent launch (SwigluParams::pdl): the up kernel lets the down kernel
// launch at once; a down block issues its first S units' weight boxes (independent
// of the up kernel) as soon as it is resident, then waits for the up grid
// (griddepcontrol.wait) before it loads A2 or touches the counters and slots.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "jax_cluster/activation.cuh"
#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/launch.cuh"
#include "jax_cluster/mma.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/thread_group.cuh"
#include "jax_cluster/tma.cuh"
#include "jax_cluster/tma_host.h"
#include "jax_cluster/vec.cuh"
#include "jax_cluster/zero_words.cuh"
#include "ops/swiglu/launch.h"
#include "ops/swiglu/tma_gemm.h"

namespace jax_cluster {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = 32 * kConsumerWarps;
constexpr int kThreads = kConsumers + 32;  // + the producer warp
constexpr int kKRows = 64;                 // K rows per unit
constexpr int kBoxCols = 64;               // columns per weight box: 128-byte rows
constexpr int kBoxes = 4;                  // weight boxes per unit
constexpr uint32_t kBoxBytes = kKRows * kBoxCols * 2;
constexpr uint32_t kConsumerBarrier = 1;   // named barrier of the consumer warps
constexpr int kSlotCols = static_cast<int>(kSwigluTmaSlotCols);
constexpr int kStagedPitch = 272;  // bytes per row of an up tile staged for the copy engine
// floats per row of a down partial in shared memory: 8 rows of a warp's float2 stores
// 8 banks apart (two wavefronts, the least for 256 bytes)
constexpr int kPartialPitch = 264;

// Stages per block: 2 (~70-80 KB in flight per SM). Deeper rings (~200 KB per SM) queue
// the memory system microseconds deep: every L2 round trip of a tile end (fence, counter,
// partial sums) then costs microseconds, and blocks with equal shares of the stream end
// far apart. An up grid that leaves a third of the SMs idle has a third fewer bytes in
// flight at 2 stages; 3 stages bring them back (slower on fuller grids). Measurements:
// docs/swiglu.md.
constexpr int kStages = 2;
constexpr int kStagesFewBlocks = 3;
template <int MT>
constexpr uint32_t kStageBytes = kBoxes * kBoxBytes + MT * 16 * 128;  // multiple of 1024
template <int MT, int S>
constexpr size_t kSmemBytes = 1024 + static_cast<size_t>(S) * kStageBytes<MT>;
static_assert(kSmemBytes<4, kStagesFewBlocks> <= kMaxSharedBytesPerBlock, "shared memory");

struct TmaGemmArgs {  // aligned as CUtensorMap
  CUtensorMap a_map;     // A [m, K] (x or A2), box {64 K, 16 MT rows}
  CUtensorMap b0_map;    // w_gate (up) or w_down (down) [K, N], box {64, 64}: boxes 0, 1
  CUtensorMap b1_map;    // w_up (up) or w_down (down): boxes 2, 3
  const void* residual;  // down only; may be null
  void* out;             // A2 [m, F] (up) or y [m, D] (down)
  bool out_f32;          // down: y in fp32 (the linear projection's option), else in T
  unsigned int* counters;  // [work tiles], zero before the up kernel
  float* slots;            // fp32 partials [segments][slot_rows][256]
  int64_t m, out_cols, k_blocks, col_tiles, row_groups, slot_rows;
  int tile_cols;  // weight columns of a work tile: 128 (up: of each matrix) or 256 (down)
  int b1_off;     // first column of boxes 2, 3 relative to box 0: 0 (up) or 128 (down)
  bool up;
  bool hint;        // each weight byte is read once: L2 evict-first
  bool wait_prior;  // PDL: A (A2), counters and slots come from the previous grid
  bool trigger;     // PDL: let the next kernel launch now
  int cluster;      // down, > 1: each work tile owned by a cluster of this many blocks,
                    // its partials summed over DSMEM (reduce_tile_in_cluster)
};

// The block (of `blocks`, block b owning units [b U / G, (b + 1) U / G)) owning unit u.
__device__ __forceinline__ int64_t owner(int64_t u, int64_t units, int64_t blocks) {
  return ((u + 1) * blocks - 1) / units;
}

// ------------------------------------------------------------------ producer
// Units past the ring's stages whose weights a programmatically launched (down) kernel
// pulls into L2 before it waits for the previous grid: fewer at 64 rows, where more bytes
// than the wait leaves idle time for gained nothing (docs/swiglu.md).
template <int MT>
constexpr int kPrefetchUnits = MT == 4 ? 4 : 8;

template <int MT, int S>
__device__ __forceinline__ void produce(const TmaGemmArgs& g, Ring<S>& ring, uint8_t* stages,
                                        int64_t u0, int n) {
  constexpr int R = 16 * MT;
  ptx::prefetch_tensor_map(&g.a_map);
  ptx::prefetch_tensor_map(&g.b0_map);
  ptx::prefetch_tensor_map(&g.b1_map);
  const uint64_t w_policy = g.hint ? ptx::l2_evict_first() : ptx::l2_evict_normal();
  const uint64_t a_policy = ptx::l2_evict_last();
  const int64_t K = g.k_blocks;
  // unit -> (K element, weight column of box 0, A row)
  auto where = [&](int64_t u, int32_t& k, int32_t& col, int32_t& row) {
    const int64_t w = u / K, tile = w / g.row_groups;
    k = static_cast<int32_t>((u - w * K) * kKRows);
    col = static_cast<int32_t>(tile * g.tile_cols);
    row = static_cast<int32_t>((w - tile * g.row_groups) * R);
  };
  auto issue_b = [&](int64_t u, uint8_t* st, uint64_t* bar) {
    int32_t k, col, row;
    where(u, k, col, row);
    ptx::tma_load_2d(st, &g.b0_map, col, k, bar, w_policy);
    ptx::tma_load_2d(st + kBoxBytes, &g.b0_map, col + kBoxCols, k, bar, w_policy);
    ptx::tma_load_2d(st + 2 * kBoxBytes, &g.b1_map, col + g.b1_off, k, bar, w_policy);
    ptx::tma_load_2d(st + 3 * kBoxBytes, &g.b1_map, col + g.b1_off + kBoxCols, k, bar,
                     w_policy);
  };
  auto issue_a = [&](int64_t u, uint8_t* st, uint64_t* bar) {
    int32_t k, col, row;
    where(u, k, col, row);
    ptx::tma_load_2d(st + kBoxes * kBoxBytes, &g.a_map, k, row, bar, a_policy);
  };
  // Into L2 only: the weight boxes of unit u.
  auto prefetch_b = [&](int64_t u) {
    int32_t k, col, row;
    where(u, k, col, row);
    ptx::tma_prefetch_2d(&g.b0_map, col, k);
    ptx::tma_prefetch_2d(&g.b0_map, col + kBoxCols, k);
    ptx::tma_prefetch_2d(&g.b1_map, col + g.b1_off, k);
    ptx::tma_prefetch_2d(&g.b1_map, col + g.b1_off + kBoxCols, k);
  };
  // PDL: the first S stages' weights go out before the wait for the previous grid; their
  // A boxes (A2, written by it) after it. The stages' barriers already expect them. The
  // next kPrefetchUnits units' weights are pulled into L2 then too: HBM is otherwise idle
  // while the up grid sums its split tiles and drains. (Prefetched by the up
  // kernel instead, they delayed its grid's completion, which the wait includes.)
  const int pro = g.wait_prior ? min(n, S) : 0;
  RingCursor cur;
  for (int i = 0; i < n; ++i) {
    if (i == pro && pro > 0) {
      for (int j = pro; j < min(n, pro + kPrefetchUnits<MT>); ++j) prefetch_b(u0 + j);
      ptx::griddep_wait();
      for (int j = 0; j < pro; ++j) issue_a(u0 + j, stages + j * kStageBytes<MT>, &ring.full[j]);
    }
    uint64_t* bar = ring_acquire(ring, cur, kStageBytes<MT>);
    uint8_t* st = stages + cur.stage * kStageBytes<MT>;
    issue_b(u0 + i, st, bar);
    if (i >= pro) issue_a(u0 + i, st, bar);
    cur.advance<S>();
  }
  if (pro == n && pro > 0) {
    ptx::griddep_wait();
    for (int j = 0; j < pro; ++j) issue_a(u0 + j, stages + j * kStageBytes<MT>, &ring.full[j]);
  }
}

// ------------------------------------------------------------------ consumers
// A consumer tile (MmaSyncTile: 8 warps x mma.sync over ldmatrix fragments, MT = 1, 2, 4)
// holds one thread's accumulators of a work tile's 16 MT rows and knows their layout:
// mma() adds one stage, slot_store() stores the fp32 partial (slot row of 256: up
// [gate 128 | up 128], down the tile's 256 output columns; reduce_tile() sums them),
// emit() writes A2 or y of a tile the block held whole.

// The residual's two adjacent elements at (base + col), 0 without a residual. Callers load
// every pair they will store before the first store: a load issued after a store to y
// (which may alias the residual) waits for that store's value to be computed, so one at a
// time each pair was an L2 round trip of its own.
template <typename T>
__device__ __forceinline__ uint32_t residual_pair(const TmaGemmArgs& g, int64_t base, int64_t col) {
  const T* res = static_cast<const T*>(g.residual);
  return res != nullptr ? *reinterpret_cast<const uint32_t*>(res + base + col) : 0u;
}

// y = acc (+ the residual pair r2 of residual_pair) of two adjacent output columns, or
// A2 = SiLU(gate) * up.
template <typename T>
__device__ __forceinline__ void store_down(const TmaGemmArgs& g, int64_t base, int64_t col,
                                           float v0, float v1, uint32_t r2) {
  if (g.residual != nullptr) {
    const T* e = reinterpret_cast<const T*>(&r2);
    v0 += to_float(e[0]);
    v1 += to_float(e[1]);
  }
  if (g.out_f32) {
    *reinterpret_cast<float2*>(static_cast<float*>(g.out) + base + col) = make_float2(v0, v1);
  } else {
    *reinterpret_cast<uint32_t*>(static_cast<T*>(g.out) + base + col) = pack2<T>(v0, v1);
  }
}

template <typename T>
__device__ __forceinline__ void store_up(const TmaGemmArgs& g, int64_t base, int64_t col, float g0,
                                         float g1, float u0, float u1) {
  *reinterpret_cast<uint32_t*>(static_cast<T*>(g.out) + base + col) =
      pack2<T>(silu(g0) * u0, silu(g1) * u1);
}

__device__ __forceinline__ void slot_pair(float* p, float v0, float v1) {
  *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
}

// Warp w of 8 owns two 16-column groups P, Q of the stage for all 16 MT rows: up: gate
// columns [16 w, 16 w + 16) and the same up columns (so SiLU * mul happens in registers);
// down: columns [32 w, 32 w + 32). Per 16-deep K step: two ldmatrix.x4.trans (the chunks
// of 8 consecutive rows land in 8 different 16-byte bank groups under the 128B swizzle:
// conflict-free), one ldmatrix.x4 of A per 16-row tile, four mma.m16n8k16.
template <typename T, int MT>
struct MmaSyncTile {
  float acc[MT][4][4];
  uint32_t p_box, q_box;  // byte offsets of the boxes in a stage
  int p_chunk, q_chunk;   // first 16-byte chunk of P, Q in them
  int warp, lane;

  __device__ MmaSyncTile(bool up, int warp_, int lane_) : warp(warp_), lane(lane_) {
    if (up) {  // gate box warp / 4, up box 2 + warp / 4, same chunks
      p_box = (warp >> 2) * kBoxBytes;
      q_box = (2 + (warp >> 2)) * kBoxBytes;
      p_chunk = q_chunk = (warp & 3) * 2;
    } else {  // columns [32 warp, 32 warp + 32): box warp / 2
      p_box = q_box = (warp >> 1) * kBoxBytes;
      p_chunk = (warp & 1) * 4;
      q_chunk = p_chunk + 2;
    }
  }
  __device__ void zero() { zero_acc(acc); }

  __device__ void mma(uint32_t st, bool /*up*/) {
    const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;  // row this lane addresses
    const int lchunk = lane >> 4;                          // +0 / +1 chunk (8 elements)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t b0[4], b1[4];
      ldsm_x4_trans(b0, st + p_box + swz(kk * 16 + lrow, p_chunk + lchunk, 128));
      ldsm_x4_trans(b1, st + q_box + swz(kk * 16 + lrow, q_chunk + lchunk, 128));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t a[4];
        ldsm_x4(a, st + kBoxes * kBoxBytes + swz(mt * 16 + lrow, kk * 2 + lchunk, 128));
        mma16816<T>(acc[mt][0], a, b0[0], b0[1]);
        mma16816<T>(acc[mt][1], a, b0[2], b0[3]);
        mma16816<T>(acc[mt][2], a, b1[0], b1[1]);
        mma16816<T>(acc[mt][3], a, b1[2], b1[3]);
      }
    }
  }

  // Fragment (mt, nt, 2 h + e): row 16 mt + lane / 4 + 8 h, slot column below (+ e).
  __device__ int col(bool up, int nt) const {
    return up ? (nt >> 1) * 128 + warp * 16 + (nt & 1) * 8 + 2 * (lane & 3)
              : warp * 32 + nt * 8 + 2 * (lane & 3);
  }

  // f(mt, h, row) for each accumulator row of this thread below `rows`.
  template <typename F>
  __device__ void for_rows(int rows, F&& f) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mt * 16 + (lane >> 2) + 8 * h;
        if (row < rows) f(mt, h, row);
      }
  }

  __device__ void slot_store(float* slot, int rows, bool up, int pitch = kSlotCols) const {
    for_rows(rows, [&](int mt, int h, int row) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        slot_pair(slot + row * pitch + col(up, nt), acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
      }
    });
  }

  // A2 of a whole up tile into shared memory, [rows][kStagedPitch bytes]: a warp's 32
  // 4-byte pieces (rows lane / 4, columns 2 (lane % 4) + const) fall in 32 different banks.
  __device__ void stage_up(uint8_t* smem, int rows) const {
    for_rows(rows, [&](int mt, int h, int row) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        *reinterpret_cast<uint32_t*>(smem + row * kStagedPitch + 2 * col(true, nt)) =
            pack2<T>(silu(acc[mt][nt][2 * h]) * acc[mt][nt + 2][2 * h],
                     silu(acc[mt][nt][2 * h + 1]) * acc[mt][nt + 2][2 * h + 1]);
      }
    });
  }

  __device__ void emit(const TmaGemmArgs& g, int64_t tile, int64_t row0, int rows) const {
    uint32_t res[MT][2][4] = {};  // down: the residual pairs, all loaded before any store
    if (!g.up && g.residual != nullptr) {
      for_rows(rows, [&](int mt, int h, int row) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int64_t c = tile * g.tile_cols + col(false, nt);
          if (c < g.out_cols) res[mt][h][nt] = residual_pair<T>(g, (row0 + row) * g.out_cols, c);
        }
      });
    }
    for_rows(rows, [&](int mt, int h, int row) {
      const int64_t base = (row0 + row) * g.out_cols;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        if (g.up && nt >= 2) break;  // nt + 2 are the up columns of gate nt
        const int64_t c = tile * g.tile_cols + col(g.up, nt);
        if (c >= g.out_cols) continue;  // columns past F / D of a last tile
        if (g.up) {
          store_up<T>(g, base, c, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1],
                      acc[mt][nt + 2][2 * h], acc[mt][nt + 2][2 * h + 1]);
        } else {
          store_down<T>(g, base, c, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1], res[mt][h][nt]);
        }
      }
    });
  }
};

// Sums the `count` partial slots of a split tile in block order (deterministic) and
// writes A2 = SiLU(gate) * up or y (+ residual) for share `part` of `parts` of the tile's
// (row, 4-column group) elements. Every block whose range ends in the tile sums a share
// once all partials are in (they end together), rather than one block summing a whole
// tile while the others idle. The sum is latency-bound: each consumer thread loads kSlots
// slots of kElems elements per L2 round trip (16 float4 loads in flight).
template <typename T, bool kUp>
__device__ __forceinline__ void reduce_tile(const TmaGemmArgs& g, const float* slot0, int count,
                                            int64_t tile, int64_t row0, int rows, int part,
                                            int parts, int tid) {
  constexpr int kElems = 4, kSlots = kUp ? 2 : 4;
  constexpr int kQuads = kUp ? kSlotCols / 8 : kSlotCols / 4;  // output columns / 4
  const int64_t slot_floats = g.slot_rows * kSlotCols;
  const int total = rows * kQuads;
  const int lo = total * part / parts, hi = total * (part + 1) / parts;
  for (int e0 = lo + tid; e0 < hi; e0 += kElems * kConsumers) {
    float4 a[kElems], b[kElems];  // up: gate, up; down: y
    const float* src[kElems];
    uint32_t res[kElems][2] = {};  // down: the residual pairs, loaded with the first slots
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      a[j] = b[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      const int e = min(e0 + j * kConsumers, hi - 1);  // past hi: a duplicate, not stored
      src[j] = slot0 + (e / kQuads) * kSlotCols + 4 * (e % kQuads);
      const int64_t col = tile * g.tile_cols + 4 * (e % kQuads);
      if (!kUp && col < g.out_cols) {
        const int64_t base = (row0 + e / kQuads) * g.out_cols;
        res[j][0] = residual_pair<T>(g, base, col);
        res[j][1] = residual_pair<T>(g, base, col + 2);
      }
    }
    for (int i0 = 0; i0 < count; i0 += kSlots) {
      float4 va[kSlots][kElems], vb[kSlots][kElems];
#pragma unroll
      for (int s = 0; s < kSlots; ++s)
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          if (i0 + s >= count) break;
          const float* p = src[j] + (i0 + s) * slot_floats;
          va[s][j] = __ldcg(reinterpret_cast<const float4*>(p));
          if (kUp) vb[s][j] = __ldcg(reinterpret_cast<const float4*>(p + kSlotCols / 2));
        }
#pragma unroll
      for (int s = 0; s < kSlots; ++s)  // in slot order
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          if (i0 + s >= count) break;
          a[j].x += va[s][j].x, a[j].y += va[s][j].y, a[j].z += va[s][j].z, a[j].w += va[s][j].w;
          if (kUp) {
            b[j].x += vb[s][j].x, b[j].y += vb[s][j].y, b[j].z += vb[s][j].z, b[j].w += vb[s][j].w;
          }
        }
    }
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      const int e = e0 + j * kConsumers;
      if (e >= hi) break;
      const int row = e / kQuads, q = e % kQuads;
      const int64_t col = tile * g.tile_cols + 4 * q;
      if (col >= g.out_cols) continue;  // columns past F / D of a last tile
      const int64_t base = (row0 + row) * g.out_cols;
      if (kUp) {
        store_up<T>(g, base, col, a[j].x, a[j].y, b[j].x, b[j].y);
        store_up<T>(g, base, col + 2, a[j].z, a[j].w, b[j].z, b[j].w);
      } else {
        store_down<T>(g, base, col, a[j].x, a[j].y, res[j][0]);
        store_down<T>(g, base, col + 2, a[j].z, a[j].w, res[j][1]);
      }
    }
  }
}

// A down tile owned by a cluster of c blocks (one K range each, the tile's only row group),
// every block's fp32 partial in its own shared memory: block `rank` sums its 1/c of the
// tile's 4-column groups over all c partials, read over DSMEM in rank order
// (deterministic), adds the residual and writes y. Replaces the global slots, the counter
// and its wait, and the L2 round trips of reduce_tile.
template <typename T>
__device__ __forceinline__ void reduce_tile_in_cluster(const TmaGemmArgs& g, const float* partial,
                                                       int64_t tile, int rows, int rank,
                                                       int tid) {
  constexpr int kQuads = kSlotCols / 4;  // 4-column groups of a tile row
  const int q0 = kQuads * rank / g.cluster, quads = kQuads * (rank + 1) / g.cluster - q0;
  const uint32_t local = ptx::smem_addr(partial);
  for (int e = tid; e < rows * quads; e += kConsumers) {
    const int row = e / quads, c = 4 * (q0 + e % quads);
    const int64_t col = tile * g.tile_cols + c;
    if (col >= g.out_cols) continue;  // columns past D of a last tile
    const uint32_t at = local + 4u * static_cast<uint32_t>(row * kPartialPitch + c);
    const int64_t base = static_cast<int64_t>(row) * g.out_cols;
    const uint32_t r0 = residual_pair<T>(g, base, col), r1 = residual_pair<T>(g, base, col + 2);
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q = 0; q < g.cluster; ++q) {
      const float4 v = ptx::ld_cluster_f32x4(ptx::map_to_rank(at, q));
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    store_down<T>(g, base, col, sum.x, sum.y, r0);
    store_down<T>(g, base, col + 2, sum.z, sum.w, r1);
  }
}

// The final whole tile of a 64-row up kernel: A2 staged in the free ring, then one bulk
// copy per row, instead of 16 4-byte stores per thread (faster at 64 rows, no gain at
// 16-32; docs/swiglu.md). Returns whether it wrote the tile.
template <typename T, int MT>
__device__ __forceinline__ bool emit_up_through_copy_engine(
    const TmaGemmArgs& g, const MmaSyncTile<T, MT>& tile_acc, uint8_t* stages,
    const ThreadGroup& group_sync, int64_t tile, int64_t row0, int rows, int tid) {
  if constexpr (MT != 4) {
    return false;
  } else {
    if (!g.up) return false;
    static_assert(16 * MT * kStagedPitch <= kStageBytes<MT>, "the staged tile fits a stage");
    group_sync.sync();  // every consumer is done with the last stage
    tile_acc.stage_up(stages, rows);
    ptx::fence_proxy_async_shared();
    group_sync.sync();
    if (tid < rows) {
      const int64_t c0 = tile * g.tile_cols;
      const int64_t cols = min(static_cast<int64_t>(g.tile_cols), g.out_cols - c0);
      ptx::bulk_store(static_cast<T*>(g.out) + (row0 + tid) * g.out_cols + c0,
                      stages + tid * kStagedPitch, static_cast<uint32_t>(2 * cols));
      ptx::bulk_store_wait();  // the copies are done before the block exits
    }
    return true;
  }
}

template <typename T, int MT, int S>
__global__ void __launch_bounds__(kThreads, 1)
    swiglu_tma_kernel(const __grid_constant__ TmaGemmArgs g) {
  constexpr int R = 16 * MT;
  extern __shared__ uint8_t smem_raw[];
  __shared__ Ring<S> ring;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // 128B-swizzled boxes need 1024-byte aligned destinations
  uint8_t* stages = smem_raw + ((1024u - (ptx::smem_addr(smem_raw) & 1023u)) & 1023u);
  const int64_t K = g.k_blocks, units = g.col_tiles * g.row_groups * K;
  const int64_t blocks = gridDim.x, b = blockIdx.x;
  const int64_t u0 = b * units / blocks;
  const int n = static_cast<int>((b + 1) * units / blocks - u0);
  if (g.trigger) ptx::griddep_launch_dependents();
  if (tid == 0) {
    ring.init(kConsumerWarps);
    ptx::fence_mbarrier_init_cluster();  // visible to the copy engine (async proxy)
  }
  __syncthreads();
  if (warp == kConsumerWarps) {
    if (lane == 0) produce<MT, S>(g, ring, stages, u0, n);
    if (g.cluster > 1) {  // every thread of the cluster takes part in its barriers
      __syncwarp();
      ptx::cluster_sync();
      ptx::cluster_sync();
    }
    return;
  }

  // ---- consumers
  const ThreadGroup group_sync{kConsumers, kConsumerBarrier};
  if (g.wait_prior) ptx::griddep_wait();  // slots and counters are the previous grid's too
  const uint32_t stages_addr = ptx::smem_addr(stages);
  const int64_t slot_floats = g.slot_rows * kSlotCols;
  MmaSyncTile<T, MT> tile_acc(g.up, warp, lane);
  tile_acc.zero();
  // Where work tile w ends its K range: rows, and the blocks owning its first and last unit.
  auto tile_end = [&](int64_t w, int64_t& tile, int64_t& row0, int& rows, int64_t& first,
                      int64_t& last) {
    tile = w / g.row_groups;
    row0 = (w - tile * g.row_groups) * R;
    rows = static_cast<int>(min(static_cast<int64_t>(R), g.m - row0));
    first = owner(w * K, units, blocks);
    last = owner(w * K + K - 1, units, blocks);
  };
  // A split tile this block ended mid-range (only ever its first tile, of which it is the
  // `last` owner): its partial is stored at once, its counter bumped with the final tile's,
  // so the stream does not stall on a fence and an atomic round trip (long under load).
  int64_t pending = -1;
  RingCursor cur;
  for (int i = 0; i < n; ++i) {
    ring_wait(ring, cur);
    tile_acc.mma(stages_addr + cur.stage * kStageBytes<MT>, g.up);
    ring_release(ring, cur);
    cur.advance<S>();
    const int64_t u = u0 + i, w = u / K;
    if (i == n - 1 || u - w * K != K - 1) continue;  // the final tile end is after the loop
    int64_t tile, row0, first, last;
    int rows;
    tile_end(w, tile, row0, rows, first, last);
    if (first == last) {
      tile_acc.emit(g, tile, row0, rows);
    } else {
      tile_acc.slot_store(g.slots + (b + w) * slot_floats, rows, g.up);
      pending = w;
    }
    tile_acc.zero();
  }

  // ---- the final tile end (tile w): a whole tile is written directly. A split one waits
  // for every block's partial; then the blocks whose ranges end in it (all but `last`
  // when its range runs on into the next tile) sum a share each. No block waits before
  // its own increments, so the waits cannot form a cycle (the launcher keeps every block
  // resident).
  const int64_t w = (u0 + n - 1) / K;
  int64_t tile, row0, first, last;
  int rows;
  tile_end(w, tile, row0, rows, first, last);
  if (g.cluster > 1) {  // a cluster's tile (row0 = 0): its partials meet in shared memory
    static_assert(16 * MT * kPartialPitch * 4 <= S * kStageBytes<MT>, "a partial fits the ring");
    float* partial = reinterpret_cast<float*>(stages);
    group_sync.sync();  // every consumer is done with the last stage
    tile_acc.slot_store(partial, rows, false, kPartialPitch);
    ptx::cluster_sync();
    reduce_tile_in_cluster<T>(g, partial, tile, rows, static_cast<int>(ptx::cluster_rank()),
                              tid);
    ptx::cluster_sync();  // no block leaves while the others read its shared memory
    return;
  }
  const int count = static_cast<int>(last - first + 1);
  const bool split = count > 1;
  if (split) {
    tile_acc.slot_store(g.slots + (b + w) * slot_floats, rows, g.up);
  } else if (!emit_up_through_copy_engine<T, MT>(g, tile_acc, stages, group_sync, tile,
                                                         row0, rows, tid)) {
    tile_acc.emit(g, tile, row0, rows);
  }
  if (split || pending >= 0) {
    __threadfence();  // the partials are visible before the counters say they are there
    group_sync.sync();
    if (tid == 0) {
      if (pending >= 0) atomicAdd(g.counters + pending, 1u);
      if (split) {
        atomicAdd(g.counters + w, 1u);
        ptx::wait_counter_at_least(g.counters + w, static_cast<unsigned int>(count));
      }
    }
    if (split) {
      group_sync.sync();
      const float* slot0 = g.slots + (first + w) * slot_floats;
      const bool last_sums = (last + 1) * units / blocks == (w + 1) * K;
      const int part = static_cast<int>(b - first), parts = last_sums ? count : count - 1;
      if (g.up) {
        reduce_tile<T, true>(g, slot0, count, tile, row0, rows, part, parts, tid);
      } else {
        reduce_tile<T, false>(g, slot0, count, tile, row0, rows, part, parts, tid);
      }
    }
  }
}

// ------------------------------------------------------------------ launcher
// The up GEMM's grid. When its work tiles fit on the GPU: tiles x k blocks, k the largest
// power of two with tiles x k <= cap that divides the tile's K blocks, so every block owns
// one whole tile or exactly 1/k of one, and ends together with the tile's other blocks
// (faster, though fewer SMs stream; docs/swiglu.md). The down GEMM keeps every SM.
int64_t up_blocks(int64_t tiles, int64_t k_blocks, int64_t cap) {
  if (tiles > cap) return cap;
  int64_t k = 1;
  while (tiles * k * 2 <= cap && k_blocks % (k * 2) == 0) k *= 2;
  return tiles * k;
}

// One GEMM's grid: at most one block per unit (every block owns >= 1 unit: the kernel
// counts on it), at most the blocks the GPU holds at once (they wait on each other's
// partials), the up GEMM's rule on top.
template <typename T, int MT, int S>
cudaError_t grid_blocks(const TmaGemmArgs& a, int64_t max_blocks, int64_t* blocks) {
  const int64_t units = a.col_tiles * a.row_groups * a.k_blocks;
  int resident = 0;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
      resident_blocks(reinterpret_cast<const void*>(swiglu_tma_kernel<T, MT, S>), kThreads,
                      kSmemBytes<MT, S>, &resident));
  *blocks = std::min<int64_t>({max_blocks, units, resident});
  if (a.up) *blocks = up_blocks(a.col_tiles * a.row_groups, a.k_blocks, *blocks);
  return cudaSuccess;
}

// Launches `blocks` (at most grid_blocks of this S) blocks of S stages; in clusters of
// a.cluster blocks when it is > 1.
template <typename T, int MT, int S>
cudaError_t launch_gemm(const TmaGemmArgs& a, int64_t blocks, cudaStream_t stream) {
  int64_t most = 0;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR((grid_blocks<T, MT, S>(a, blocks, &most)));
  if (most < blocks) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks));
  if (a.cluster > 1) {
    if (!a.wait_prior) {
      return launch_cluster(swiglu_tma_kernel<T, MT, S>, grid, dim3(kThreads), kSmemBytes<MT, S>,
                            a.cluster, stream, a);
    }
    return launch_cluster_programmatic(swiglu_tma_kernel<T, MT, S>, grid, dim3(kThreads),
                                       kSmemBytes<MT, S>, a.cluster, stream, a);
  }
  return launch_programmatic(swiglu_tma_kernel<T, MT, S>, grid, dim3(kThreads),
                             kSmemBytes<MT, S>, a.wait_prior, stream, a);
}

// The down GEMM's clusters: with one row group, each 256-column tile is owned by a
// cluster of c blocks, which sums its partials over DSMEM at the end: the largest c in
// 5..8 with tiles x c within the grid, at most one block per K block, and every cluster
// resident at once (so the tiles end together; the GPU's GPCs decide, not its SM count:
// an H100 holds 15 clusters of 8, not 16, and a 16th would run as a second wave).
// 1: the stream-K grid with partials in global slots. Below 5 blocks per tile the slot
// sums are shallow enough that the slots were faster (docs/swiglu.md).
template <typename T, int MT, int S>
cudaError_t down_cluster_size(const TmaGemmArgs& a, int64_t grid, int* size) {
  *size = 1;
  if (a.up || a.row_groups != 1) return cudaSuccess;
  for (int c = 8; c >= 5; --c) {
    if (a.col_tiles * c > grid || c > a.k_blocks) continue;
    int clusters = 0;
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(resident_clusters(
        reinterpret_cast<const void*>(swiglu_tma_kernel<T, MT, S>), kThreads, kSmemBytes<MT, S>,
        c, &clusters));
    if (clusters >= a.col_tiles) {
      *size = c;
      return cudaSuccess;
    }
  }
  return cudaSuccess;
}

// One GEMM of `a` on at most max_blocks blocks: the grid (blocks resident at once), the
// ring depth, and clusters for a down GEMM where they apply. Zeroes `counters` tile
// counters first when the grid sums split tiles through them (0: already zero).
template <typename T, int MT>
cudaError_t launch_one(TmaGemmArgs& a, int64_t max_blocks, int64_t counters, cudaStream_t stream) {
  int64_t blocks = 0;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR((grid_blocks<T, MT, kStages>(a, max_blocks, &blocks)));
  int sms = 0, device = 0;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const bool few_blocks = a.up && 3 * blocks <= 2 * static_cast<int64_t>(sms);
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR((down_cluster_size<T, MT, kStages>(a, blocks, &a.cluster)));
  if (a.cluster > 1) {
    blocks = a.col_tiles * a.cluster;
  } else if (counters > 0) {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(zero_words(a.counters, static_cast<int>(counters), stream));
  }
  return few_blocks ? launch_gemm<T, MT, kStagesFewBlocks>(a, blocks, stream)
                    : launch_gemm<T, MT, kStages>(a, blocks, stream);
}

// A down-type GEMM (y = a @ w (+ residual), 256-column work tiles): swiglu's down stage
// and the linear projection.
template <typename T, int MT>
cudaError_t launch_down(const TmaGemm& g, cudaStream_t stream) {
  constexpr int R = 16 * MT;
  if (g.row_tiles != MT || g.max_blocks < 1) return cudaErrorInvalidValue;
  constexpr auto kSwizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  // Weight boxes have 128-byte rows whose neighbours belong to other tiles (streamed by
  // other blocks at other times): fetch exactly those rows.
  constexpr auto kWeights = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  TmaGemmArgs a;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(encode_matrix_map(&a.a_map, g.dtype, g.a, g.m, g.k, R, kBoxCols, kSwizzle));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
      encode_matrix_map(&a.b0_map, g.dtype, g.w, g.k, g.n, kKRows, kBoxCols, kSwizzle, kWeights));
  a.b1_map = a.b0_map;
  a.up = false;
  a.m = g.m;
  a.row_groups = swiglu_ceil_div(g.m, R);
  a.hint = a.row_groups == 1;
  a.out_cols = g.n;
  a.k_blocks = g.k / kKRows;
  a.col_tiles = swiglu_ceil_div(g.n, kSwigluTmaDownCols);
  a.tile_cols = static_cast<int>(kSwigluTmaDownCols);
  a.b1_off = 128;
  a.slot_rows = std::min<int64_t>(g.m, R);
  a.counters = g.counters;
  a.slots = g.slots;
  a.residual = g.residual;
  a.out = g.out;
  a.out_f32 = g.out_f32;
  a.wait_prior = g.wait_prior;
  a.trigger = g.trigger;
  return launch_one<T, MT>(a, g.max_blocks, g.zero_counters, stream);
}

template <typename T, int MT>
cudaError_t launch_rows(const SwigluParams& p, cudaStream_t stream) {
  constexpr int R = 16 * MT;
  if (p.row_tiles != MT || p.blocks < 1) return cudaErrorInvalidValue;
  const SwigluTmaLayout l = swiglu_tma_layout(p);
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  unsigned int* counters = reinterpret_cast<unsigned int*>(ws + l.counters);
  float* slots = reinterpret_cast<float*>(ws + l.slots);
  // Up: x @ [w_gate | w_up] -> A2 (into the workspace when the down GEMM follows).
  TmaGemmArgs up;
  constexpr auto kSwizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  constexpr auto kWeights = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(encode_matrix_map(&up.a_map, p.dtype, p.x, p.m, p.d, R, kBoxCols, kSwizzle));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
      encode_matrix_map(&up.b0_map, p.dtype, p.w_gate, p.d, p.f, kKRows, kBoxCols, kSwizzle, kWeights));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
      encode_matrix_map(&up.b1_map, p.dtype, p.w_up, p.d, p.f, kKRows, kBoxCols, kSwizzle, kWeights));
  up.up = true;
  up.m = p.m;
  up.row_groups = swiglu_ceil_div(p.m, R);
  up.hint = up.row_groups == 1;
  up.slot_rows = l.slot_rows;
  up.slots = slots;
  up.counters = counters;
  up.residual = nullptr;
  up.out = p.has_down ? static_cast<void*>(ws) : p.out;
  up.out_cols = p.f;
  up.out_f32 = false;
  up.k_blocks = p.d / kKRows;
  up.col_tiles = swiglu_ceil_div(p.f, kSwigluTmaUpCols);
  up.tile_cols = static_cast<int>(kSwigluTmaUpCols);
  up.b1_off = 0;
  up.wait_prior = false;
  up.trigger = p.has_down && p.pdl;
  // Both GEMMs' counters are zeroed here, before the up kernel: zeroing the down kernel's
  // between the two would hold the down kernel back from its early start.
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
      zero_words(counters, static_cast<int>(l.tiles_up + l.tiles_down), stream));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR((launch_one<T, MT>(up, p.blocks, 0, stream)));
  if (!p.has_down) return cudaSuccess;
  // Down: A2 @ w_down (+ residual) -> y.
  TmaGemm down;
  down.dtype = p.dtype;
  down.m = p.m;
  down.k = p.f;
  down.n = p.d;
  down.row_tiles = MT;
  down.max_blocks = p.blocks;
  down.a = ws;
  down.w = p.w_down;
  down.residual = p.has_residual ? p.residual : nullptr;
  down.out = p.out;
  down.out_f32 = false;
  down.counters = counters + l.tiles_up;
  down.slots = slots;
  down.zero_counters = 0;
  down.wait_prior = p.pdl;
  down.trigger = false;
  return launch_down<T, MT>(down, stream);
}

}  // namespace

cudaError_t launch_swiglu_tma(const SwigluParams& p, cudaStream_t stream) {
  return dispatch_half(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return dispatch_int<1, 2, 4>(p.row_tiles, [&](auto mt) {
      return launch_rows<T, decltype(mt)::value>(p, stream);
    });
  });
}

cudaError_t launch_tma_gemm(const TmaGemm& g, cudaStream_t stream) {
  return dispatch_half(g.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return dispatch_int<1, 2, 4>(g.row_tiles, [&](auto mt) {
      return launch_down<T, decltype(mt)::value>(g, stream);
    });
  });
}

}  // namespace jax_cluster
