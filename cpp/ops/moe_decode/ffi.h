// The FFI binding of moe_decode (the pattern of ffi/common.h): one decode into
// MoeDecodeParams, shared by the CPU and CUDA handlers. The Python wrapper
// (jax_cluster/ops/moe_decode.py) checks the same things first with friendlier messages,
// through the same C++ check (plan.cc).
//
// Operands: x [N, H], weights float32 [N, k], ids int32 [N, k], w_gate, w_up [E, H, I],
// w_down [E, I, H], the shared experts s_gate, s_up [H, Is], s_down [Is, H] (or all three
// empty), residual [N, H] (or empty). Results: y [N, H] (x's dtype), workspace (uint8).
// Attributes: MoeDecodeAttrs.
#pragma once

#include <string>

#include "ffi/common.h"
#include "ops/moe_decode/params.h"
#include "ops/moe_decode/route.h"

namespace jax_cluster {

struct MoeRouteAttrs {
  int64_t top_k;
  bool group_limited;
  bool noaux_tc;
  int64_t n_group;
  int64_t topk_group;
  bool norm_topk_prob;
  float routed_scaling_factor;
  float norm_eps;
};

struct MoeDecodeAttrs {
  int64_t cols_up;
  int64_t cols_down;
  bool pdl;
  bool has_residual;
};

}  // namespace jax_cluster

JAX_CLUSTER_FFI_ATTRS(jax_cluster::MoeDecodeAttrs,
                      xla::ffi::StructMember<int64_t>("cols_up"),
                      xla::ffi::StructMember<int64_t>("cols_down"),
                      xla::ffi::StructMember<bool>("pdl"),
                      xla::ffi::StructMember<bool>("has_residual"));

JAX_CLUSTER_FFI_ATTRS(jax_cluster::MoeRouteAttrs,
                      xla::ffi::StructMember<int64_t>("top_k"),
                      xla::ffi::StructMember<bool>("group_limited"),
                      xla::ffi::StructMember<bool>("noaux_tc"),
                      xla::ffi::StructMember<int64_t>("n_group"),
                      xla::ffi::StructMember<int64_t>("topk_group"),
                      xla::ffi::StructMember<bool>("norm_topk_prob"),
                      xla::ffi::StructMember<float>("routed_scaling_factor"),
                      xla::ffi::StructMember<float>("norm_eps"));

namespace jax_cluster {

namespace ffi = xla::ffi;

// moe_route: x [N, H] (fp16 / bf16 / fp32), router [H, E] (fp32 / fp16 / bf16), score_bias
// float32 [E] (noaux_tc; otherwise unused, any shape), norm [H] of x's dtype (or empty: no
// norm) -> weights float32 [N, k], ids int32 [N, k], h [N, H] of x's dtype (RMSNorm(x); empty
// without a norm), workspace (uint8). Attributes: MoeRouteAttrs.
inline ffi::ErrorOr<MoeRouteParams> decode_moe_route(ffi::AnyBuffer x, ffi::AnyBuffer router,
                                                     ffi::AnyBuffer score_bias, ffi::AnyBuffer norm,
                                                     ffi::Result<ffi::AnyBuffer> weights,
                                                     ffi::Result<ffi::AnyBuffer> ids,
                                                     ffi::Result<ffi::AnyBuffer> normed,
                                                     ffi::Result<ffi::AnyBuffer> workspace, MoeRouteAttrs a) {
  auto fail = [](const std::string& m) { return ffi::Unexpected(ffi_util::invalid("moe_route: " + m)); };
  auto xd = x.dimensions(), rd = router.dimensions();
  if (xd.size() != 2) return fail("x must be [N, H], got " + ffi_util::dims_str(xd));
  if (rd.size() != 2 || rd[0] != xd[1]) return fail("router must be [H, E] with H = x.shape[1], got " + ffi_util::dims_str(rd));
  auto dtype = ffi_util::to_dtype(x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  auto rdtype = ffi_util::to_dtype(router.element_type(), "router");
  if (!rdtype) return ffi::Unexpected(rdtype.error());
  MoeRouteParams p{};
  p.dtype = *dtype;
  p.router_dtype = *rdtype;
  p.n = xd[0];
  p.h = xd[1];
  p.e = rd[1];
  p.k = a.top_k;
  p.group_limited = a.group_limited;
  p.noaux_tc = a.noaux_tc;
  p.n_group = a.n_group;
  p.topk_group = a.topk_group;
  p.norm_topk_prob = a.norm_topk_prob;
  p.scaling = a.routed_scaling_factor;
  p.norm_eps = a.norm_eps;
  if (norm.element_count() > 0) {
    auto nd = norm.dimensions();
    if (norm.element_type() != x.element_type() || nd.size() != 1 || nd[0] != p.h) {
      return fail("norm must be [H] of x's dtype, got " + ffi_util::dims_str(nd));
    }
    if (normed->element_type() != x.element_type() || static_cast<int64_t>(normed->element_count()) != p.n * p.h) {
      return fail("with a norm, the normed output must be [N, H] of x's dtype");
    }
    p.norm = norm.untyped_data();
    p.normed = normed->untyped_data();
  }
  if (const std::string why = moe_route_check(p); !why.empty()) return fail(why);
  if (p.noaux_tc) {
    auto bd = score_bias.dimensions();
    if (score_bias.element_type() != ffi::DataType::F32 || bd.size() != 1 || bd[0] != p.e) {
      return fail("score_bias must be float32 [E] for noaux_tc, got " + ffi_util::dims_str(bd));
    }
    p.score_bias = static_cast<const float*>(score_bias.untyped_data());
  }
  auto wd = weights->dimensions(), id = ids->dimensions();
  if (weights->element_type() != ffi::DataType::F32 || wd.size() != 2 || wd[0] != p.n || wd[1] != p.k ||
      ids->element_type() != ffi::DataType::S32 || id.size() != 2 || id[0] != p.n || id[1] != p.k) {
    return fail("weights must be float32 [N, k] and ids int32 [N, k]");
  }
  if (static_cast<int64_t>(workspace->size_bytes()) < moe_route_workspace_bytes(p.n, p.h, p.e, p.router_dtype)) {
    return fail("workspace too small");
  }
  p.x = x.untyped_data();
  p.router = router.untyped_data();
  p.weights = static_cast<float*>(weights->untyped_data());
  p.ids = static_cast<int32_t*>(ids->untyped_data());
  p.workspace = workspace->untyped_data();
  return p;
}

inline ffi::ErrorOr<MoeDecodeParams> decode_moe_decode(
    ffi::AnyBuffer x, ffi::AnyBuffer weights, ffi::AnyBuffer ids, ffi::AnyBuffer w_gate,
    ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer s_gate, ffi::AnyBuffer s_up,
    ffi::AnyBuffer s_down, ffi::AnyBuffer residual,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, MoeDecodeAttrs a) {
  auto fail = [](const std::string& m) {
    return ffi::Unexpected(ffi_util::invalid("moe_decode: " + m));
  };
  auto xd = x.dimensions(), wd = weights.dimensions(), gd = w_gate.dimensions();
  if (xd.size() != 2) return fail("x must be [N, H], got " + ffi_util::dims_str(xd));
  if (wd.size() != 2) return fail("weights must be [N, k], got " + ffi_util::dims_str(wd));
  if (gd.size() != 3) return fail("w_gate must be [E, H, I], got " + ffi_util::dims_str(gd));
  auto dtype = ffi_util::to_dtype(x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  MoeDecodeParams p{};
  p.dtype = *dtype;
  p.n = xd[0];
  p.h = xd[1];
  p.k = wd[1];
  p.e = gd[0];
  p.i = gd[2];
  p.cols_up = a.cols_up >= 0 && a.cols_up <= 1024 ? static_cast<int>(a.cols_up) : -1;
  p.cols_down = a.cols_down >= 0 && a.cols_down <= 1024 ? static_cast<int>(a.cols_down) : -1;
  p.pdl = a.pdl;
  p.has_residual = a.has_residual;
  if (weights.element_type() != ffi::DataType::F32 || wd[0] != p.n) {
    return fail("weights must be float32 [N, k] with N = x.shape[0]");
  }
  auto id = ids.dimensions();
  if (ids.element_type() != ffi::DataType::S32 || id.size() != 2 || id[0] != p.n || id[1] != p.k) {
    return fail("ids must be int32 [N, k], weights' shape");
  }
  if (gd[1] != p.h) return fail("w_gate must be [E, H, I] with H = x.shape[1], got " + ffi_util::dims_str(gd));
  auto ud = w_up.dimensions(), dd = w_down.dimensions();
  if (ud.size() != 3 || ud[0] != p.e || ud[1] != p.h || ud[2] != p.i) return fail("w_up must have w_gate's shape [E, H, I]");
  if (dd.size() != 3 || dd[0] != p.e || dd[1] != p.i || dd[2] != p.h) {
    return fail("w_down must be [E, I, H], got " + ffi_util::dims_str(dd));
  }
  for (const ffi::AnyBuffer* b : {&w_gate, &w_up, &w_down}) {
    if (b->element_type() != x.element_type()) return fail("expert weights must have x's dtype");
  }
  if (s_gate.element_count() > 0) {
    auto sg = s_gate.dimensions(), su = s_up.dimensions(), sd = s_down.dimensions();
    if (sg.size() != 2 || sg[0] != p.h) return fail("s_gate must be [H, Is], got " + ffi_util::dims_str(sg));
    p.i_s = sg[1];
    if (su.size() != 2 || su[0] != p.h || su[1] != p.i_s) return fail("s_up must have s_gate's shape [H, Is]");
    if (sd.size() != 2 || sd[0] != p.i_s || sd[1] != p.h) return fail("s_down must be [Is, H], got " + ffi_util::dims_str(sd));
    for (const ffi::AnyBuffer* b : {&s_gate, &s_up, &s_down}) {
      if (b->element_type() != x.element_type()) return fail("shared expert weights must have x's dtype");
    }
  } else if (s_up.element_count() > 0 || s_down.element_count() > 0) {
    return fail("s_gate, s_up and s_down are given together or not at all");
  }
  if (out->element_type() != x.element_type() || static_cast<int64_t>(out->element_count()) != p.n * p.h) {
    return fail("output must be [N, H] of x's dtype");
  }
  if (p.has_residual && (residual.element_type() != x.element_type() ||
                         static_cast<int64_t>(residual.element_count()) != p.n * p.h)) {
    return fail("residual must be [N, H] of x's dtype");
  }
  if (const std::string why = moe_decode_check(p); !why.empty()) return fail(why);
  if (static_cast<int64_t>(workspace->size_bytes()) < moe_decode_workspace_bytes(p.n, p.k, p.h, p.i, p.i_s, p.dtype)) {
    return fail("workspace too small");
  }
  p.x = x.untyped_data();
  p.weights = static_cast<const float*>(weights.untyped_data());
  p.ids = static_cast<const int32_t*>(ids.untyped_data());
  p.w_gate = w_gate.untyped_data();
  p.w_up = w_up.untyped_data();
  p.w_down = w_down.untyped_data();
  if (p.i_s > 0) {
    p.s_gate = s_gate.untyped_data();
    p.s_up = s_up.untyped_data();
    p.s_down = s_down.untyped_data();
  }
  p.residual = residual.untyped_data();
  p.out = out->untyped_data();
  p.workspace = workspace->untyped_data();
  return p;
}

}  // namespace jax_cluster
