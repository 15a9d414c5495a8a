// The one-launch decoder layer's schedule: which phases run, how each GEMV of the layer is
// cut into units (column tile x K chunk), how many token splits the attention takes, and
// where everything lives in the workspace. Plain data computed on the host from the shapes
// and the grid (blocks resident at once); the kernel (kernel.cuh) only walks it.
//
// Phases, in the order every block walks them:
//   sequential:  up_front (QKV)          -> attention [-> merge] -> o-proj (h = x + a)
//                -> MLP up (Norm'(h))    -> MLP down (y = h + m)
//   parallel:    up_front (QKV, MLP up on Norm'(x)) -> attention [-> merge]
//                -> out (y = x + a + m: o-proj and MLP down as one GEMV over [attn | act])
// No grid barrier between them: each item waits only for the items of earlier phases whose
// results it reads (counters in the workspace: a GEMV tile's readiness, a (row, KV head)'s
// splits and merge). Every wait points at an earlier phase and every block walks the phases
// in order, so with all blocks resident every wait ends.
// A GEMV unit multiplies a K chunk of its B input rows by a tile of 256 columns;
// with several chunks per tile the units write fp32 partials and the last one to arrive
// (a per-tile counter) sums them in chunk order: no float atomics, bitwise reproducible.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "jax_cluster/types.h"
#include "ops/decoder_layer/params.h"

namespace jax_cluster {

inline constexpr int kLayerThreads = 256;
#ifndef JAX_CLUSTER_LAYER_BLOCKS_PER_SM
#define JAX_CLUSTER_LAYER_BLOCKS_PER_SM 2
#endif
// Blocks of kLayerThreads per SM (the kernel's launch bounds): two give the GEMV phases 16
// warps per SM to keep HBM busy, at 128 registers per thread, which the attention phase
// meets with its lean forms (docs/decoder_layer.md). A probe build may set 1 (255 registers).
inline constexpr int kLayerBlocksPerSm = JAX_CLUSTER_LAYER_BLOCKS_PER_SM;
inline constexpr int kLayerTileCols = 256;           // GEMV tiles (a warp's 32 lanes x 8 columns)
inline constexpr int kLayerMaxChunks = 32;           // K chunks per tile
inline constexpr int kLayerStageFloats = 8192;       // staged input of a unit: B x chunk rows
inline constexpr int kLayerMaxSplits = 64;           // attention token splits per (row, KV head)
inline constexpr int kLayerMinSplitTokens = 256;     // cache slots per split at least

// One GEMV of the layer: out[b, n] = sum_k in[b, k] W[k, n], split into tiles x chunks units.
// Paired (SwiGLU's gate and up): a tile is tile_cols / 2 columns of w_gate and the same
// ones of w_up. A tile's row is 512 contiguous bytes (64-column tiles streamed at ~45% of
// HBM; 512- to 2048-column ones balanced the grid worse and were no faster).
struct LayerGemv {
  int64_t k, n;        // input width, output columns (paired: F, read as 2F virtual columns)
  int64_t tile_cols, tiles, chunks, chunk_rows;  // chunk_rows: a multiple of 32
  bool paired;
  JAX_CLUSTER_HOST_DEVICE int64_t units() const { return tiles * chunks; }
};

enum LayerGemvId : int { kGemvQkv = 0, kGemvUp = 1, kGemvO = 2, kGemvDown = 3, kLayerGemvs = 4 };

struct DecoderLayerPlan {
  int64_t grid;                    // blocks, all resident
  LayerGemv gemv[kLayerGemvs];     // parallel residual: kGemvO is [attn | act] x [W_o ; W_out]
  int64_t splits;                  // attention token splits
  // Workspace offsets in floats (counters first: zeroed before every launch). Each GEMV has
  // its own partials: phases overlap in time.
  int64_t counters, partials, qkv, attn_partial, attn, h, h_stats, act, timeline, floats;
  // Counter words: per GEMV, its tiles' arrived chunks and their readiness (the epilogue
  // ran); per (row, KV head), its finished splits and its merged output.
  int64_t counter_words;
  int64_t partial_off[kLayerGemvs], tile_counter_off[kLayerGemvs], tile_ready_off[kLayerGemvs];
  int64_t splits_done_off, merged_off;
};

// The per-phase timeline every launch leaves in the workspace (docs/decoder_layer.md):
// u64 [0] = blocks, then per block kLayerTimelineMarks globaltimer stamps (ns).
inline constexpr int kLayerTimelineMarks = 7;
inline constexpr int64_t kLayerTimelineMaxBlocks = 1024;

#ifndef JAX_CLUSTER_LAYER_UNIT_FIXED_BYTES
#define JAX_CLUSTER_LAYER_UNIT_FIXED_BYTES 65536.0
#endif
#ifndef JAX_CLUSTER_LAYER_SPLIT_BYTES
#define JAX_CLUSTER_LAYER_SPLIT_BYTES 32768.0
#endif
// The plan's cost model: a unit's fixed cost (pipeline fill, staging, reduction) in bytes of
// weights, and what splitting K adds (the partials' round trip). A probe build may set others.
inline constexpr double kLayerUnitFixedBytes = JAX_CLUSTER_LAYER_UNIT_FIXED_BYTES;
inline constexpr double kLayerSplitBytes = JAX_CLUSTER_LAYER_SPLIT_BYTES;

// K chunks for a GEMV of `tiles` tiles over k rows: the split that balances tiles x chunks
// units over the grid best (a unit's time ~ its rows), within the staging limit of `batch`
// staged rows (layer_staged_rows: the kernel stages all of its NB rows, zeros past the batch).
inline void plan_gemv(LayerGemv& g, int64_t batch, int64_t grid, int64_t extra_units) {
  const int64_t min_chunks = std::max<int64_t>(1, (batch * g.k + kLayerStageFloats - 1) / kLayerStageFloats);
  double best = 1e30;
  for (int64_t c = min_chunks; c <= std::max<int64_t>(min_chunks, kLayerMaxChunks); ++c) {
    const int64_t rows = ((g.k + c - 1) / c + 31) / 32 * 32;
    if (batch * rows > kLayerStageFloats) continue;
    const int64_t waves = (g.tiles * c + extra_units + grid - 1) / grid;
    // A unit's time ~ its bytes plus a fixed cost (pipeline fill, staging, reduction) worth
    // ~64 KB of weights; splitting K adds the partials' round trip.
    const double unit = static_cast<double>(rows) * g.tile_cols * 2 + kLayerUnitFixedBytes;
    const double cost = static_cast<double>(waves) * unit + (c > 1 ? kLayerSplitBytes : 0.0);
    if (cost < best) {
      best = cost;
      g.chunks = c;
      g.chunk_rows = rows;
    }
  }
  g.chunks = (g.k + g.chunk_rows - 1) / g.chunk_rows;  // no empty chunk
}

// The most any block streams when GEMVs a then b (chunked as given) are handed out
// block-strided over `grid` blocks: units counted per block by ranges of equal units.
inline double layer_max_block_load(const LayerGemv& a, const LayerGemv& b, int64_t grid, double* loads) {
  for (int64_t i = 0; i < grid; ++i) loads[i] = 0.0;
  int64_t at = 0;
  // count of i in [s, e) with i % grid == blk, added `bytes` each
  auto add = [&](int64_t units, double bytes) {
    const int64_t s = at, e = at + units;
    for (int64_t blk = 0; blk < grid; ++blk) {
      const int64_t first = s + ((blk - s % grid) % grid + grid) % grid;  // first i >= s on blk
      if (first < e) loads[blk] += static_cast<double>((e - 1 - first) / grid + 1) * bytes;
    }
    at = e;
  };
  for (const LayerGemv* g : {&a, &b}) {
    const int64_t last_rows = g->k - (g->chunks - 1) * g->chunk_rows;
    add(g->tiles * (g->chunks - 1), static_cast<double>(g->chunk_rows) * g->tile_cols * 2 + kLayerUnitFixedBytes);
    add(g->tiles, static_cast<double>(last_rows) * g->tile_cols * 2 + kLayerUnitFixedBytes);
  }
  double most = 0.0;
  for (int64_t i = 0; i < grid; ++i) most = most > loads[i] ? most : loads[i];
  return most;
}

// The parallel residual's first phase hands QKV's units and then MLP up's to the blocks in
// one block-strided sequence. Planned apart, each GEMV balances its own waves, and the two
// together can leave some blocks a unit more than others; this picks both chunk counts for
// the least weight any block streams, plus each unit's fixed cost (fewer units on a tie),
// searched over up to 16 chunks each from the separate plans. Memoised per shape and grid:
// the search is ~0.1 ms, and the plan is made at every call.
inline void plan_parallel_up_front(LayerGemv& qkv, LayerGemv& up, int64_t batch, int64_t grid) {
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool, int64_t>;
  static std::mutex mutex;
  static std::map<Key, std::pair<int64_t, int64_t>> memo;  // chunk_rows of QKV, MLP up
  const Key key{batch, qkv.k, qkv.n, up.k, up.n, up.paired, grid};
  auto chunked = [](LayerGemv g, int64_t rows) {
    g.chunk_rows = rows;
    g.chunks = (g.k + rows - 1) / rows;
    return g;
  };
  std::lock_guard<std::mutex> lock(mutex);
  auto found = memo.find(key);
  if (found == memo.end()) {
    std::vector<double> loads(static_cast<size_t>(grid));
    double best = layer_max_block_load(qkv, up, grid, loads.data());
    int64_t best_units = qkv.units() + up.units();
    std::pair<int64_t, int64_t> pick{qkv.chunk_rows, up.chunk_rows};
    for (int64_t c1 = 1; c1 <= 16; ++c1) {
      const int64_t r1 = ((qkv.k + c1 - 1) / c1 + 31) / 32 * 32;
      if (batch * r1 > kLayerStageFloats) continue;
      for (int64_t c2 = 1; c2 <= 16; ++c2) {
        const int64_t r2 = ((up.k + c2 - 1) / c2 + 31) / 32 * 32;
        if (batch * r2 > kLayerStageFloats) continue;
        const LayerGemv a = chunked(qkv, r1), b = chunked(up, r2);
        const double load = layer_max_block_load(a, b, grid, loads.data());
        const int64_t units = a.units() + b.units();
        if (load < best || (load == best && units < best_units)) {
          best = load;
          best_units = units;
          pick = {r1, r2};
        }
      }
    }
    found = memo.emplace(key, pick).first;
  }
  qkv = chunked(qkv, found->second.first);
  up = chunked(up, found->second.second);
}

static_assert(kLayerMaxChunks * kLayerStageFloats == kDecoderLayerMaxStagedInputs,
              "decoder_layer_cuda_check bounds the staged inputs by the plan's chunks x staging");

inline DecoderLayerPlan plan_decoder_layer(const DecoderLayerParams& p, int64_t grid) {
  DecoderLayerPlan pl{};
  pl.grid = grid;
  const int64_t b = p.batch, d = p.hidden, f = p.inter, dh = p.head_dim;
  const int64_t hq = p.num_q_heads, hkv = p.num_kv_heads, cols = (hq + 2 * hkv) * dh;
  const bool swiglu = p.mlp == MlpKind::kSwiglu;
  auto gemv = [&](int64_t k, int64_t n, bool paired) {
    const int64_t virt = paired ? 2 * n : n;
    LayerGemv g{};
    g.k = k;
    g.n = n;
    g.paired = paired;
    g.tile_cols = kLayerTileCols;
    g.tiles = (virt + g.tile_cols - 1) / g.tile_cols;
    g.chunks = 1;
    return g;
  };
  pl.gemv[kGemvQkv] = gemv(d, cols, false);
  pl.gemv[kGemvUp] = gemv(d, f, swiglu);
  pl.gemv[kGemvO] = gemv(hq * dh + (p.parallel_residual ? f : 0), d, false);
  pl.gemv[kGemvDown] = gemv(f, d, false);
  if (p.parallel_residual) {  // QKV and MLP up share the first phase
    plan_gemv(pl.gemv[kGemvQkv], layer_staged_rows(b), grid, 0);
    plan_gemv(pl.gemv[kGemvUp], layer_staged_rows(b), grid, pl.gemv[kGemvQkv].units());
    plan_parallel_up_front(pl.gemv[kGemvQkv], pl.gemv[kGemvUp], layer_staged_rows(b), grid);  // from these
    pl.gemv[kGemvDown] = {};
  } else {
    plan_gemv(pl.gemv[kGemvQkv], layer_staged_rows(b), grid, 0);
    plan_gemv(pl.gemv[kGemvUp], layer_staged_rows(b), grid, 0);
    plan_gemv(pl.gemv[kGemvDown], layer_staged_rows(b), grid, 0);
  }
  plan_gemv(pl.gemv[kGemvO], layer_staged_rows(b), grid, 0);
  const int64_t items = b * hkv;
  const int64_t by_grid = std::max<int64_t>(1, grid / items);
  const int64_t by_len = std::max<int64_t>(1, (p.max_seq + kLayerMinSplitTokens - 1) / kLayerMinSplitTokens);
  pl.splits = std::min({by_grid, by_len, static_cast<int64_t>(kLayerMaxSplits)});

  int64_t at = 0;
  auto take = [&](int64_t floats) {
    const int64_t off = at;
    at += (floats + 31) / 32 * 32;  // 128-byte aligned regions
    return off;
  };
  // Regions sized by bounds (the most chunks and splits), not by this grid's values: the op
  // declares its workspace from the shapes alone (decoder_layer_workspace_floats).
  auto max_tiles = [&](int i) {
    const LayerGemv& g = pl.gemv[i];
    return ((g.paired ? 2 * g.n : g.n) + kLayerTileCols - 1) / kLayerTileCols;
  };
  pl.counter_words = 0;
  for (int i = 0; i < kLayerGemvs; ++i) {
    pl.tile_counter_off[i] = pl.counter_words;
    pl.tile_ready_off[i] = pl.counter_words + max_tiles(i);
    pl.counter_words += 2 * max_tiles(i);
  }
  pl.splits_done_off = pl.counter_words;
  pl.merged_off = pl.splits_done_off + b * hkv;
  pl.counter_words = pl.merged_off + b * hkv;
  pl.counters = take(pl.counter_words);
  int64_t partial = 0;
  for (int i = 0; i < kLayerGemvs; ++i) {
    const LayerGemv& g = pl.gemv[i];
    pl.partial_off[i] = partial;
    partial += kLayerMaxChunks * b * ((g.paired ? 2 * g.n : g.n) + kLayerTileCols);
  }
  pl.partials = take(partial);
  pl.qkv = take(b * cols);
  pl.attn_partial = take(b * hkv * kLayerMaxSplits * (hq / hkv) * (dh + 2) + b * hkv * 2 * dh);
  pl.attn = take(b * hq * dh);
  pl.h = take(b * d);
  pl.h_stats = take(max_tiles(kGemvO) * b * 2);
  pl.act = take(b * f);
  pl.timeline = take(2 * (1 + kLayerTimelineMaxBlocks * kLayerTimelineMarks));
  pl.floats = at;
  return pl;
}

// The workspace the op declares (the same for every grid).
inline int64_t decoder_layer_workspace_floats(const DecoderLayerParams& p) {
  return plan_decoder_layer(p, 1).floats;
}

}  // namespace jax_cluster
