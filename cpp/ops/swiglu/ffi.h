// The FFI binding of swiglu (the pattern of ffi/common.h): one decode into SwigluParams,
// shared by the CPU and CUDA handlers. The Python wrapper (jax_cluster/ops/swiglu.py)
// plans its launch with the same C++ checks (plan.cc), so an error here is a bug there.
//
// Operands: x [M, D], w_gate, w_up [D, F], w_down [F, D] (or empty), residual [M, D] (or
// empty). Results: y [M, D] (A2 [M, F] without w_down), workspace (uint8). Attributes:
// SwigluAttrs.
#pragma once

#include <string>

#include "ffi/common.h"
#include "ops/swiglu/params.h"

namespace jax_cluster {

struct SwigluAttrs {
  int64_t variant;  // SwigluVariant
  int64_t row_tiles;
  int64_t blocks;
  int64_t clusters;
  int64_t cluster_size;
  int64_t f_group;
  int64_t k_splits_up;
  int64_t k_splits_down;
  bool pdl;
  bool has_down;
  bool has_residual;
};

}  // namespace jax_cluster

JAX_CLUSTER_FFI_ATTRS(jax_cluster::SwigluAttrs,
                      xla::ffi::StructMember<int64_t>("variant"),
                      xla::ffi::StructMember<int64_t>("row_tiles"),
                      xla::ffi::StructMember<int64_t>("blocks"),
                      xla::ffi::StructMember<int64_t>("clusters"),
                      xla::ffi::StructMember<int64_t>("cluster_size"),
                      xla::ffi::StructMember<int64_t>("f_group"),
                      xla::ffi::StructMember<int64_t>("k_splits_up"),
                      xla::ffi::StructMember<int64_t>("k_splits_down"),
                      xla::ffi::StructMember<bool>("pdl"),
                      xla::ffi::StructMember<bool>("has_down"),
                      xla::ffi::StructMember<bool>("has_residual"));

namespace jax_cluster {

namespace ffi = xla::ffi;

// An attribute that must fit an int (the launch fields), or -1 (rejected by the checks).
inline int swiglu_int_attr(int64_t v) { return v >= 0 && v <= 65535 ? static_cast<int>(v) : -1; }

inline ffi::ErrorOr<SwigluParams> decode_swiglu(ffi::AnyBuffer x, ffi::AnyBuffer w_gate,
                                                ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                                                ffi::AnyBuffer residual,
                                                ffi::Result<ffi::AnyBuffer> out,
                                                ffi::Result<ffi::AnyBuffer> workspace,
                                                SwigluAttrs a) {
  auto fail = [](const std::string& m) {
    return ffi::Unexpected(ffi_util::invalid("swiglu: " + m));
  };
  auto xd = x.dimensions(), gd = w_gate.dimensions();
  if (xd.size() != 2) return fail("x must be [M, D], got " + ffi_util::dims_str(xd));
  if (gd.size() != 2) return fail("w_gate must be [D, F], got " + ffi_util::dims_str(gd));
  auto dtype = ffi_util::to_dtype(x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  if (*dtype == DType::kF32) return fail("x dtype must be float16 or bfloat16");
  if (a.variant < 0 || a.variant > 2) return fail("variant must be 0 (tma), 1 (gemv) or 2 (fused)");
  SwigluParams p;
  p.dtype = *dtype;
  p.variant = static_cast<SwigluVariant>(a.variant);
  p.m = xd[0];
  p.d = xd[1];
  p.f = gd[1];
  p.has_down = a.has_down;
  p.has_residual = a.has_residual;
  p.row_tiles = swiglu_int_attr(a.row_tiles);
  p.blocks = swiglu_int_attr(a.blocks);
  p.clusters = swiglu_int_attr(a.clusters);
  p.cluster_size = swiglu_int_attr(a.cluster_size);
  p.f_group = swiglu_int_attr(a.f_group);
  p.k_splits_up = swiglu_int_attr(a.k_splits_up);
  p.k_splits_down = swiglu_int_attr(a.k_splits_down);
  p.pdl = a.pdl;
  if (p.m < 1) return fail("x must have at least one row");
  if (gd[0] != p.d) return fail("w_gate must be [D, F] with D = x.shape[1], got " + ffi_util::dims_str(gd));
  if (p.d % kSwigluAlign || p.f % kSwigluAlign) {
    return fail("D (" + std::to_string(p.d) + ") and F (" + std::to_string(p.f) +
                ") must be multiples of 64");
  }
  auto ud = w_up.dimensions();
  if (ud.size() != 2 || ud[0] != p.d || ud[1] != p.f) return fail("w_up must have w_gate's shape [D, F]");
  for (const ffi::AnyBuffer* b : {&w_gate, &w_up}) {
    if (b->element_type() != x.element_type()) return fail("weights must have x's dtype");
  }
  const int64_t out_cols = p.has_down ? p.d : p.f;
  if (out->element_type() != x.element_type() ||
      static_cast<int64_t>(out->element_count()) != p.m * out_cols) {
    return fail("output must be [M, " + std::to_string(out_cols) + "] of x's dtype");
  }
  if (p.has_down) {
    auto dd = w_down.dimensions();
    if (dd.size() != 2 || dd[0] != p.f || dd[1] != p.d) return fail("w_down must be [F, D], got " + ffi_util::dims_str(dd));
    if (w_down.element_type() != x.element_type()) return fail("w_down must have x's dtype");
  }
  if (p.has_residual) {
    if (!p.has_down) return fail("residual needs w_down");
    if (residual.element_type() != x.element_type() ||
        static_cast<int64_t>(residual.element_count()) != p.m * p.d) {
      return fail("residual must be [M, D] of x's dtype");
    }
  }
  if (const std::string why = swiglu_launch_error(p); !why.empty()) return fail(why);
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

}  // namespace jax_cluster
