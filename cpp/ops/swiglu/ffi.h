// Decodes and validates swiglu's FFI arguments into one SwigluParams, shared by the CPU
// and CUDA handlers. The Python wrapper (jax_cluster/ops/swiglu.py) checks the same
// things first with friendlier messages; this is the last line of defence.
#pragma once

#include <string>
#include <tuple>
#include <utility>

#include "ffi/common.h"
#include "ops/swiglu/params.h"

namespace jax_cluster {

namespace ffi = xla::ffi;

inline ffi::ErrorOr<SwigluParams> decode_swiglu(
    ffi::AnyBuffer x, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
    ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> workspace, int64_t variant, int64_t order, int64_t cluster_up,
    int64_t cluster_down, int64_t row_tiles, int64_t f_group, int64_t num_clusters,
    int64_t k_splits_up, int64_t k_splits_down, int64_t pdl, int64_t gemv_mma, int64_t wgmma,
    bool has_down, bool has_residual) {
  auto fail = [](const std::string& m) {
    return ffi::Unexpected(ffi_util::invalid("swiglu: " + m));
  };
  auto xd = x.dimensions(), gd = w_gate.dimensions();
  if (xd.size() != 2) return fail("x must be [M, D], got " + ffi_util::dims_str(xd));
  if (gd.size() != 2) return fail("w_gate must be [D, F], got " + ffi_util::dims_str(gd));
  auto dtype = ffi_util::to_dtype(x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  if (*dtype == DType::kF32) return fail("x dtype must be float16 or bfloat16");
  SwigluParams p;
  p.dtype = *dtype;
  p.variant = static_cast<SwigluVariant>(variant);
  p.order = static_cast<SwigluOrder>(order);
  p.m = xd[0];
  p.d = xd[1];
  p.f = gd[1];
  p.has_down = has_down;
  p.has_residual = has_residual;
  p.cluster_up = static_cast<int>(cluster_up);
  p.cluster_down = static_cast<int>(cluster_down);
  p.row_tiles = static_cast<int>(row_tiles);
  p.f_group = static_cast<int>(f_group);
  p.num_clusters = static_cast<int>(num_clusters);
  p.k_splits_up = static_cast<int>(k_splits_up);
  p.k_splits_down = static_cast<int>(k_splits_down);
  p.pdl = pdl != 0;
  p.gemv_mma = gemv_mma != 0;
  p.wgmma = wgmma != 0;
  p.down_slots = false;
  if (p.m < 1) return fail("x must have at least one row");
  if (gd[0] != p.d) return fail("w_gate must be [D, F] with D = x.shape[1], got " + ffi_util::dims_str(gd));
  if (p.d % kSwigluAlign || p.f % kSwigluAlign) {
    return fail("D (" + std::to_string(p.d) + ") and F (" + std::to_string(p.f) +
                ") must be multiples of 64");
  }
  auto wd = w_up.dimensions();
  if (wd.size() != 2 || wd[0] != p.d || wd[1] != p.f) return fail("w_up must have w_gate's shape [D, F]");
  for (const ffi::AnyBuffer* b : {&w_gate, &w_up}) {
    if (b->element_type() != x.element_type()) return fail("weights must have x's dtype");
  }
  const int64_t out_cols = has_down ? p.d : p.f;
  if (out->element_type() != x.element_type() ||
      static_cast<int64_t>(out->element_count()) != p.m * out_cols) {
    return fail("output must be [M, " + std::to_string(out_cols) + "] of x's dtype");
  }
  if (has_down) {
    auto dd = w_down.dimensions();
    if (dd.size() != 2 || dd[0] != p.f || dd[1] != p.d) return fail("w_down must be [F, D], got " + ffi_util::dims_str(dd));
    if (w_down.element_type() != x.element_type()) return fail("w_down must have x's dtype");
  }
  if (has_residual) {
    if (!has_down) return fail("residual needs w_down");
    if (residual.element_type() != x.element_type() ||
        static_cast<int64_t>(residual.element_count()) != p.m * p.d) {
      return fail("residual must be [M, D] of x's dtype");
    }
  }
  if (variant < 0 || variant > 4) {
    return fail("variant must be 0 (split), 1 (fused), 2 (stream), 3 (gemv) or 4 (tma)");
  }
  if (pdl != 0 && pdl != 1) return fail("pdl must be 0 or 1");
  if (gemv_mma != 0 && gemv_mma != 1) return fail("gemv_mma must be 0 or 1");
  if (wgmma != 0 && wgmma != 1) return fail("wgmma must be 0 or 1");
  if (p.wgmma && (p.variant != SwigluVariant::kTma || row_tiles != 4)) {
    return fail("wgmma is a knob of the tma variant with row_tiles 4");
  }
  if (p.variant == SwigluVariant::kGemv) {
    const int64_t max_rows = swiglu_gemv_max_rows(p.gemv_mma);
    if (p.m > max_rows) {
      return fail("the gemv variant takes at most " + std::to_string(max_rows) + " rows of x" +
                  (p.gemv_mma ? "" : " on CUDA cores"));
    }
    const int64_t xrow = swiglu_gemv_x_row_bytes(p.m, p.gemv_mma);  // bytes of one K row of x
    for (auto [splits, k, name] : {std::tuple{k_splits_up, p.d, "k_splits_up"},
                                   std::tuple{k_splits_down, has_down ? p.f : 64, "k_splits_down"}}) {
      if (splits < 1 || splits > k / 16 || swiglu_gemv_chunk(k, splits) * xrow > kSwigluGemvXBytes) {
        return fail(std::string(name) + " must be in 1..K/16 with K/" + name +
                    " rows of x fitting 64 KB of shared memory, got " +
                    std::to_string(splits));
      }
    }
  }
  if (order != 0 && order != 1) return fail("order must be 0 (col) or 1 (row)");
  if (row_tiles != 1 && row_tiles != 2 && row_tiles != 4) return fail("row_tiles must be 1, 2 or 4");
  if (!is_pow2_cluster_size(cluster_up) || cluster_up > p.d / 64) {
    return fail("cluster_up must be 1, 2, 4, 8 or 16 and at most D / 64");
  }
  if (p.variant == SwigluVariant::kSplit && has_down &&
      (!is_pow2_cluster_size(cluster_down) || cluster_down > p.f / 64)) {
    return fail("cluster_down must be 1, 2, 4, 8 or 16 and at most F / 64");
  }
  if (p.variant == SwigluVariant::kStream && (num_clusters < 1 || num_clusters > 65535)) {
    return fail("num_clusters (the stream kernels' blocks) must be in 1..65535");
  }
  if (p.variant == SwigluVariant::kTma && (num_clusters < 1 || num_clusters > 65535)) {
    return fail("num_clusters (the tma kernels' blocks) must be in 1..65535");
  }
  const bool fused = p.variant == SwigluVariant::kFused && has_down;
  if (fused) {
    if (f_group < 1 || f_group > 64) return fail("f_group must be in 1..64");
    if (num_clusters < 1 || num_clusters > p.f / 64) return fail("num_clusters must be in 1..F/64");
  }
  const SwigluSmemPlan plan = fused ? swiglu_fused_smem(p) : swiglu_tile_smem(p);
  if (plan.stages == 0) {
    return fail("this configuration needs more shared memory than a block has (row_tiles " +
                std::to_string(row_tiles) + ", f_group " + std::to_string(f_group) +
                ", cluster " + std::to_string(cluster_up) + ")");
  }
  if (static_cast<int64_t>(workspace->size_bytes()) < swiglu_workspace_bytes(p)) {
    return fail("workspace too small");
  }
  p.x = x.untyped_data();
  p.w_gate = w_gate.untyped_data();
  p.w_up = w_up.untyped_data();
  p.w_down = w_down.untyped_data();
  p.residual = residual.untyped_data();
  p.out = out->untyped_data();
  p.workspace = workspace->untyped_data();
  return p;
}

// Ffi binding shared by both handlers (the CUDA one prepends the stream).
template <typename Binding>
auto bind_swiglu(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // x [M, D]
      .template Arg<ffi::AnyBuffer>()                 // w_gate [D, F]
      .template Arg<ffi::AnyBuffer>()                 // w_up [D, F]
      .template Arg<ffi::AnyBuffer>()                 // w_down [F, D] (or empty)
      .template Arg<ffi::AnyBuffer>()                 // residual [M, D] (or empty)
      .template Ret<ffi::AnyBuffer>()                 // y [M, D] or A2 [M, F]
      .template Ret<ffi::AnyBuffer>()                 // workspace
      .template Attr<int64_t>("variant")
      .template Attr<int64_t>("order")
      .template Attr<int64_t>("cluster_up")
      .template Attr<int64_t>("cluster_down")
      .template Attr<int64_t>("row_tiles")
      .template Attr<int64_t>("f_group")
      .template Attr<int64_t>("num_clusters")
      .template Attr<int64_t>("k_splits_up")
      .template Attr<int64_t>("k_splits_down")
      .template Attr<int64_t>("pdl")
      .template Attr<int64_t>("gemv_mma")
      .template Attr<int64_t>("wgmma")
      .template Attr<bool>("has_down")
      .template Attr<bool>("has_residual");
}

}  // namespace jax_cluster

#define JAX_CLUSTER_SWIGLU_ARGS                                                              \
  ffi::AnyBuffer x, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,        \
      ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> out,                               \
      ffi::Result<ffi::AnyBuffer> workspace, int64_t variant, int64_t order,                  \
      int64_t cluster_up, int64_t cluster_down, int64_t row_tiles, int64_t f_group,           \
      int64_t num_clusters, int64_t k_splits_up, int64_t k_splits_down, int64_t pdl,        \
      int64_t gemv_mma, int64_t wgmma, bool has_down, bool has_residual
#define JAX_CLUSTER_SWIGLU_DECODE                                                             \
  decode_swiglu(x, w_gate, w_up, w_down, residual, out, workspace, variant, order, cluster_up, \
                cluster_down, row_tiles, f_group, num_clusters, k_splits_up, k_splits_down, pdl, \
                gemv_mma, wgmma, has_down, has_residual)
