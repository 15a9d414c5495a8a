// decoder_layer's checks and workspace for Python (jax_cluster._extension.plans()): the
// functions the FFI handlers call, so Python needs no copy of them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>
#include <utility>

#include "ffi/plan_util.h"
#include "ops/decoder_layer/params.h"
#include "ops/decoder_layer/plan.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_cluster {
namespace {

// The kernel's schedule for a grid of `grid` blocks: what the
// tests check against the workspace's bounds (the kernel writes exactly these regions).
nb::dict layout(const DecoderLayerParams& p, int64_t grid) {
  const DecoderLayerPlan pl = plan_decoder_layer(p, grid);
  nb::dict out;
  nb::list gemvs;
  for (int i = 0; i < kLayerGemvs; ++i) {
    const LayerGemv& g = pl.gemv[i];
    nb::dict d;
    d["k"] = g.k;
    d["n"] = g.n;
    d["tile_cols"] = g.tile_cols;
    d["tiles"] = g.tiles;
    d["chunks"] = g.chunks;
    d["chunk_rows"] = g.chunk_rows;
    d["paired"] = g.paired;
    d["partial_off"] = pl.partial_off[i];
    d["tile_counter_off"] = pl.tile_counter_off[i];
    d["tile_ready_off"] = pl.tile_ready_off[i];
    gemvs.append(d);
  }
  out["gemvs"] = gemvs;
  out["splits"] = pl.splits;
  const std::pair<const char*, int64_t> regions[] = {
      {"counters", pl.counters}, {"partials", pl.partials}, {"qkv", pl.qkv}, {"attn_partial", pl.attn_partial},
      {"attn", pl.attn}, {"h", pl.h}, {"h_stats", pl.h_stats}, {"act", pl.act}, {"timeline", pl.timeline},
      {"floats", pl.floats}};
  for (const auto& [name, off] : regions) out[name] = off;
  out["counter_words"] = pl.counter_words;
  out["splits_done_off"] = pl.splits_done_off;
  out["merged_off"] = pl.merged_off;
  out["stage_floats"] = kLayerStageFloats;
  out["staged_rows"] = layer_staged_rows(p.batch);
  out["max_chunks"] = kLayerMaxChunks;
  out["max_splits"] = kLayerMaxSplits;
  return out;
}

nb::dict plan(int64_t batch, int64_t hidden, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t max_seq, int64_t inter, int64_t mlp, bool parallel_residual, const std::string& dtype,
              int64_t grid) {
  DecoderLayerParams p{};
  const bool known_dtype = dtype_from_name(dtype, &p.dtype);
  p.batch = batch;
  p.hidden = hidden;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.max_seq = max_seq;
  p.inter = inter;
  p.rotary_dim = 0;
  p.norm = NormKind::kRms;
  p.mlp = static_cast<MlpKind>(mlp);
  p.parallel_residual = parallel_residual;
  const std::string error = decoder_layer_check(p);
  nb::dict out;
  out["error"] = error;
  out["cuda_error"] = known_dtype ? decoder_layer_cuda_check(p) : std::string("dtype must be float16 or bfloat16");
  out["workspace_floats"] = error.empty() ? decoder_layer_workspace_floats(p) : int64_t{0};
  out["timeline_offset"] = error.empty() ? plan_decoder_layer(p, 1).timeline : int64_t{0};
  out["timeline_marks"] = kLayerTimelineMarks;
  if (error.empty() && grid > 0) out["layout"] = layout(p, grid);
  return out;
}

}  // namespace
}  // namespace jax_cluster

void bind_decoder_layer_plan(nb::module_& m) {
  m.def("decoder_layer", &jax_cluster::plan, "batch"_a, "hidden"_a, "num_q_heads"_a, "num_kv_heads"_a,
        "head_dim"_a, "max_seq"_a, "inter"_a, "mlp"_a, "parallel_residual"_a, "dtype"_a, "grid"_a = 0,
        "decoder_layer's checks for one call: 'error' (sizes out of range, '' if valid), 'cuda_error' (why "
        "the one-launch kernel cannot run it), the workspace, and with grid > 0 the kernel's 'layout' for a "
        "grid of that many blocks");
}
