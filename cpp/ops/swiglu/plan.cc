// swiglu's launch plan for Python (jax_cluster._extension.plans().swiglu*): the defaults of
// every launch field (row tiles, grid, K splits, fused cluster shape), the checks the FFI
// decoder applies (swiglu_launch_error) and the workspace size, computed here once.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "ffi/plan_util.h"
#include "ops/swiglu/params.h"

namespace nb = nanobind;

namespace jax_cluster {
namespace {

int64_t pow2_floor(int64_t v) {
  int64_t p = 1;
  while (p * 2 <= v) p *= 2;
  return p;
}

// Gemv K chunks: `want`, or as many as keep every block resident at once (`slots`
// resident blocks on the GPU: one wave, no tail); raised until a chunk's x fits shared
// memory, at most K / 16.
int64_t gemv_splits(int64_t k, int64_t tiles, int64_t m, int64_t slots, int64_t want) {
  int64_t s = want > 0 ? want : std::max<int64_t>(1, slots / tiles);
  while (swiglu_gemv_chunk(k, s) * swiglu_gemv_x_row_bytes(m) > kSwigluGemvXBytes) ++s;
  return std::max<int64_t>(1, std::min(s, k / 16));
}

// Fused: the fewest clusters that keep the most-loaded cluster's F-tile count minimal.
int64_t balanced_clusters(int64_t tiles, int64_t max_clusters) {
  const int64_t c = std::max<int64_t>(1, std::min(max_clusters, tiles));
  return swiglu_ceil_div(tiles, swiglu_ceil_div(tiles, c));
}

DType dtype_of(const std::string& name) {
  DType dtype;
  if (dtype_from_name(name, &dtype) && dtype != DType::kF32) return dtype;
  throw nb::value_error(("swiglu: dtype must be float16 or bfloat16, got " + name).c_str());
}

SwigluVariant variant_of(const std::string& name) {
  if (name == "tma") return SwigluVariant::kTma;
  if (name == "gemv") return SwigluVariant::kGemv;
  if (name == "fused") return SwigluVariant::kFused;
  throw nb::value_error(("swiglu: variant must be 'tma', 'gemv' or 'fused', got '" + name + "'").c_str());
}

// The launch of one call of `m` rows (0 fields: the default). Unused fields of a variant
// are 1 (pdl false for the fused kernel).
SwigluParams resolve(const std::string& variant, int64_t m, int64_t d, int64_t f,
                     const std::string& dtype, bool has_down, int64_t sms, int64_t row_tiles,
                     int64_t blocks, int64_t clusters, int64_t cluster_size, int64_t f_group,
                     int64_t k_splits_up, int64_t k_splits_down, bool pdl) {
  SwigluParams p{};
  p.dtype = dtype_of(dtype);
  p.variant = variant_of(variant);
  p.m = m;
  p.d = d;
  p.f = f;
  p.has_down = has_down;
  p.row_tiles = p.blocks = p.clusters = p.cluster_size = p.f_group = 1;
  p.k_splits_up = p.k_splits_down = 1;
  p.pdl = pdl;
  switch (p.variant) {
    case SwigluVariant::kTma:
      p.row_tiles = static_cast<int>(row_tiles ? row_tiles : swiglu_default_row_tiles(std::min<int64_t>(m, 64)));
      p.blocks = static_cast<int>(blocks ? blocks : sms);
      break;
    case SwigluVariant::kGemv: {
      if (m > kSwigluGemvMaxRows) break;  // swiglu_launch_error says why
      const int64_t slots = 2 * sms;       // the kernels' __launch_bounds__: 2 blocks per SM
      p.k_splits_up = static_cast<int>(
          gemv_splits(d, swiglu_ceil_div(f, kSwigluGemvCols), m, slots, k_splits_up));
      if (has_down) {
        p.k_splits_down = static_cast<int>(
            gemv_splits(f, swiglu_ceil_div(d, kSwigluGemvCols), m, slots, k_splits_down));
      }
      break;
    }
    case SwigluVariant::kFused: {
      p.pdl = false;
      const int64_t fblk = f / 64;
      p.cluster_size = static_cast<int>(std::min<int64_t>(cluster_size ? cluster_size : 8, pow2_floor(d / 64)));
      p.f_group = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(f_group ? f_group : 2, fblk)));
      p.row_tiles = static_cast<int>(row_tiles ? row_tiles : swiglu_default_row_tiles(std::min<int64_t>(m, 64)));
      // Too much shared memory: fewer rows per pass (unless pinned), then narrower groups.
      while (swiglu_fused_smem(p).stages == 0 && (p.row_tiles > 1 || p.f_group > 1)) {
        if (p.row_tiles > 1 && row_tiles == 0) {
          p.row_tiles /= 2;
        } else if (p.f_group > 1) {
          --p.f_group;
        } else {
          break;
        }
      }
      const SwigluSmemPlan plan = swiglu_fused_smem(p);
      const int64_t per_sm = plan.bytes <= kSwigluSmemBudget2 ? 2 : 1;
      const int64_t max_clusters = std::max<int64_t>(1, per_sm * sms / p.cluster_size);
      p.clusters = static_cast<int>(clusters ? std::min(clusters, fblk) : balanced_clusters(fblk, max_clusters));
      break;
    }
  }
  return p;
}

nb::dict launch_attrs(const SwigluParams& p) {
  nb::dict out;
  out["variant"] = static_cast<int64_t>(p.variant);
  out["row_tiles"] = int64_t{p.row_tiles};
  out["blocks"] = int64_t{p.blocks};
  out["clusters"] = int64_t{p.clusters};
  out["cluster_size"] = int64_t{p.cluster_size};
  out["f_group"] = int64_t{p.f_group};
  out["k_splits_up"] = int64_t{p.k_splits_up};
  out["k_splits_down"] = int64_t{p.k_splits_down};
  out["pdl"] = p.pdl;
  return out;
}

}  // namespace
}  // namespace jax_cluster

void bind_swiglu_plan(nb::module_& m) {
  using namespace jax_cluster;
  m.attr("SWIGLU_GEMV_MAX_ROWS") = kSwigluGemvMaxRows;
  m.attr("SWIGLU_FUSED_MAX_ROWS") = kSwigluFusedMaxRows;
  m.attr("SWIGLU_ALIGN") = kSwigluAlign;
  m.def(
      "swiglu",
      [](const std::string& variant, int64_t m, int64_t d, int64_t f, const std::string& dtype,
         bool has_down, int64_t sms, int64_t row_tiles, int64_t blocks, int64_t clusters,
         int64_t cluster_size, int64_t f_group, int64_t k_splits_up, int64_t k_splits_down,
         bool pdl) {
        if (m < 1 || d < 1 || f < 1 || d % kSwigluAlign || f % kSwigluAlign || sms < 1) {
          throw nb::value_error("swiglu: the plan needs M >= 1, D and F positive multiples of 64");
        }
        const SwigluParams p = resolve(variant, m, d, f, dtype, has_down, sms, row_tiles, blocks,
                                       clusters, cluster_size, f_group, k_splits_up,
                                       k_splits_down, pdl);
        if (const std::string why = swiglu_launch_error(p); !why.empty()) {
          throw nb::value_error(("swiglu: " + why).c_str());
        }
        nb::dict out = launch_attrs(p);
        out["workspace_bytes"] = swiglu_workspace_bytes(p);
        return out;
      },
      nb::arg("variant"), nb::arg("m"), nb::arg("d"), nb::arg("f"), nb::arg("dtype"),
      nb::arg("has_down"), nb::arg("sms"), nb::arg("row_tiles") = 0, nb::arg("blocks") = 0,
      nb::arg("clusters") = 0, nb::arg("cluster_size") = 0, nb::arg("f_group") = 0,
      nb::arg("k_splits_up") = 0, nb::arg("k_splits_down") = 0, nb::arg("pdl") = true,
      "The launch attributes of one swiglu call of M rows (0: the default) and its workspace "
      "bytes; ValueError when the kernels cannot run it.");
  m.def(
      "swiglu_workspace_bytes",
      [](int64_t variant, int64_t m, int64_t d, int64_t f, const std::string& dtype,
         bool has_down, int64_t row_tiles, int64_t blocks, int64_t clusters,
         int64_t cluster_size, int64_t f_group, int64_t k_splits_up, int64_t k_splits_down) {
        // A launch plan's knobs (swiglu(...) returns them) are all >= 1, and some are divisors
        // below. Other values size no workspace: the FFI handler then rejects the call with
        // its own message, never a division by zero here.
        for (int64_t knob : {row_tiles, blocks, clusters, cluster_size, f_group, k_splits_up, k_splits_down}) {
          if (knob < 1) return int64_t{0};
        }
        SwigluParams p{};
        p.dtype = dtype_of(dtype);
        p.variant = static_cast<SwigluVariant>(variant);
        p.m = m;
        p.d = d;
        p.f = f;
        p.has_down = has_down;
        p.row_tiles = static_cast<int>(row_tiles);
        p.blocks = static_cast<int>(blocks);
        p.clusters = static_cast<int>(clusters);
        p.cluster_size = static_cast<int>(cluster_size);
        p.f_group = static_cast<int>(f_group);
        p.k_splits_up = static_cast<int>(k_splits_up);
        p.k_splits_down = static_cast<int>(k_splits_down);
        return swiglu_workspace_bytes(p);
      },
      nb::arg("variant"), nb::arg("m"), nb::arg("d"), nb::arg("f"), nb::arg("dtype"),
      nb::arg("has_down"), nb::arg("row_tiles"), nb::arg("blocks"), nb::arg("clusters"),
      nb::arg("cluster_size"), nb::arg("f_group"), nb::arg("k_splits_up"),
      nb::arg("k_splits_down"),
      "Workspace bytes of a call of M rows with these launch attributes (plans().swiglu's).");
}
