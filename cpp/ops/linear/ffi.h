// The FFI binding of linear (the pattern of ffi/common.h): one decode into LinearParams,
// shared by the CPU and CUDA handlers. The Python wrapper (jax_cluster/ops/linear.py)
// checks the same things first with friendlier messages.
//
// Operands: a [M, K], w [K, N], residual [M, N] (or empty). Results: y [M, N] (a's dtype or
// float32), workspace (uint8). Attributes: LinearAttrs.
#pragma once

#include <string>

#include "ffi/common.h"
#include "ops/linear/params.h"

namespace jax_cluster {

struct LinearAttrs {
  bool pdl;
  int64_t max_blocks;
  bool has_residual;
  bool out_f32;
};

}  // namespace jax_cluster

JAX_CLUSTER_FFI_ATTRS(jax_cluster::LinearAttrs,
                      xla::ffi::StructMember<bool>("pdl"),
                      xla::ffi::StructMember<int64_t>("max_blocks"),
                      xla::ffi::StructMember<bool>("has_residual"),
                      xla::ffi::StructMember<bool>("out_f32"));

namespace jax_cluster {

namespace ffi = xla::ffi;

inline ffi::ErrorOr<LinearParams> decode_linear(ffi::AnyBuffer a, ffi::AnyBuffer w,
                                                ffi::AnyBuffer residual,
                                                ffi::Result<ffi::AnyBuffer> out,
                                                ffi::Result<ffi::AnyBuffer> workspace,
                                                LinearAttrs attrs) {
  auto fail = [](const std::string& m) {
    return ffi::Unexpected(ffi_util::invalid("linear: " + m));
  };
  auto ad = a.dimensions(), wd = w.dimensions();
  if (ad.size() != 2) return fail("a must be [M, K], got " + ffi_util::dims_str(ad));
  if (wd.size() != 2) return fail("w must be [K, N], got " + ffi_util::dims_str(wd));
  auto dtype = ffi_util::to_dtype(a.element_type(), "a");
  if (!dtype) return ffi::Unexpected(dtype.error());
  if (*dtype == DType::kF32) return fail("a dtype must be float16 or bfloat16");
  if (w.element_type() != a.element_type()) return fail("w must have a's dtype");
  LinearParams p;
  p.dtype = *dtype;
  p.m = ad[0];
  p.k = ad[1];
  p.n = wd[1];
  if (p.m < 1) return fail("a must have at least one row");
  if (wd[0] != p.k) return fail("w must be [K, N] with K = a.shape[1], got " + ffi_util::dims_str(wd));
  if (p.k % kLinearAlign || p.n % kLinearAlign) {
    return fail("K (" + std::to_string(p.k) + ") and N (" + std::to_string(p.n) +
                ") must be multiples of 64");
  }
  if (out->element_type() != a.element_type() && out->element_type() != ffi::DataType::F32) {
    return fail("the output dtype must be a's or float32");
  }
  p.out_f32 = out->element_type() == ffi::DataType::F32;
  if (p.out_f32 != attrs.out_f32) return fail("out_f32 must say whether the output is float32");
  if (static_cast<int64_t>(out->element_count()) != p.m * p.n) {
    return fail("the output must be [M, N]");
  }
  p.has_residual = attrs.has_residual;
  if (p.has_residual && (residual.element_type() != a.element_type() ||
                         static_cast<int64_t>(residual.element_count()) != p.m * p.n)) {
    return fail("residual must be [M, N] of a's dtype");
  }
  if (attrs.max_blocks < 1 || attrs.max_blocks > 65535) return fail("max_blocks must be in 1..65535");
  p.pdl = attrs.pdl;
  p.max_blocks = static_cast<int>(attrs.max_blocks);
  p.row_tiles = linear_row_tiles(p.m);
  if (static_cast<int64_t>(workspace->size_bytes()) < linear_workspace_bytes(p.m, p.n, p.max_blocks)) {
    return fail("workspace too small");
  }
  p.a = a.untyped_data();
  p.w = w.untyped_data();
  p.residual = residual.untyped_data();
  p.out = out->untyped_data();
  p.workspace = workspace->untyped_data();
  return p;
}

}  // namespace jax_cluster
