// The FFI bindings of mla_decode's projection kernels (projections.h), shared by the CPU
// and CUDA handlers. The Python wrapper checks the same sizes first with friendlier
// messages; optional operands (q_src, biases, residual) are empty arrays when absent.
//
// mla_project: x [B, D], norm [D], q_src [B, q_in] or [0], w_q [q_in, H (dn + dr)],
//   w_kv_a [D, r + dr], kv_a_bias [r + dr] or [0], kv_a_norm [r], w_kv_b [r, H (dn + dv)],
//   lengths int32 [B], inv_freq f32 [dr / 2] -> q_full f32 [B, H, r + dr], new_latent f32 [B, r + dr],
//   workspace f32
// mla_output: o_lat [B, H, r], w_kv_b, w_o [H dv, D], o_bias [D] or [0], residual [B, D]
//   or [0] -> y [B, D], workspace f32
#pragma once

#include <string>

#include "ffi/common.h"
#include "ops/mla_decode/projections.h"

namespace jax_cluster {

struct MlaProjectAttrs {
  int64_t num_heads, nope, rope, rank, v_dim, capacity;
  float eps, latent_eps, rope_factor;
};

struct MlaOutputAttrs {
  int64_t nope, v_dim;
};

}  // namespace jax_cluster

JAX_CLUSTER_FFI_ATTRS(jax_cluster::MlaProjectAttrs,
                      xla::ffi::StructMember<int64_t>("num_heads"),
                      xla::ffi::StructMember<int64_t>("nope"),
                      xla::ffi::StructMember<int64_t>("rope"),
                      xla::ffi::StructMember<int64_t>("rank"),
                      xla::ffi::StructMember<int64_t>("v_dim"),
                      xla::ffi::StructMember<int64_t>("capacity"),
                      xla::ffi::StructMember<float>("eps"),
                      xla::ffi::StructMember<float>("latent_eps"),
                      xla::ffi::StructMember<float>("rope_factor"));

JAX_CLUSTER_FFI_ATTRS(jax_cluster::MlaOutputAttrs,
                      xla::ffi::StructMember<int64_t>("nope"),
                      xla::ffi::StructMember<int64_t>("v_dim"));

namespace jax_cluster {

namespace ffi = xla::ffi;

namespace mla_ffi {

// buf's data if it has exactly `dims` of `want`'s element type, else an error naming it.
inline std::string expect(const char* name, const ffi::AnyBuffer& buf, ffi::DataType want,
                          std::initializer_list<int64_t> dims) {
  auto d = buf.dimensions();
  bool ok = buf.element_type() == want && d.size() == dims.size();
  size_t i = 0;
  for (int64_t v : dims) ok = ok && d[i++] == v;
  if (ok) return "";
  std::string want_dims;
  for (int64_t v : dims) want_dims += (want_dims.empty() ? "" : ", ") + std::to_string(v);
  return std::string(name) + " must be [" + want_dims + "] of the activations' dtype (or the stated one), got " +
         ffi_util::dims_str(d);
}

inline bool present(const ffi::AnyBuffer& b) { return b.element_count() > 0; }

}  // namespace mla_ffi

inline ffi::ErrorOr<MlaProjectParams> decode_mla_project(
    ffi::AnyBuffer x, ffi::AnyBuffer norm, ffi::AnyBuffer q_src, ffi::AnyBuffer w_q, ffi::AnyBuffer w_kv_a,
    ffi::AnyBuffer kv_a_bias, ffi::AnyBuffer kv_a_norm, ffi::AnyBuffer w_kv_b, ffi::AnyBuffer lengths,
    ffi::AnyBuffer inv_freq, ffi::Result<ffi::AnyBuffer> q_full, ffi::Result<ffi::AnyBuffer> new_latent,
    ffi::Result<ffi::AnyBuffer> workspace, ffi::Result<ffi::AnyBuffer> counters, MlaProjectAttrs a) {
  auto fail = [](const std::string& m) { return ffi::Unexpected(ffi_util::invalid("mla_project: " + m)); };
  auto xd = x.dimensions();
  if (xd.size() != 2) return fail("x must be [B, hidden]");
  auto dtype = ffi_util::to_dtype(x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  MlaProjectParams p{};
  p.dtype = *dtype;
  p.batch = xd[0];
  p.hidden = xd[1];
  p.num_heads = a.num_heads;
  p.nope = a.nope;
  p.rope = a.rope;
  p.rank = a.rank;
  p.v_dim = a.v_dim;
  p.capacity = a.capacity;
  p.eps = a.eps;
  p.latent_eps = a.latent_eps;
  p.rope_factor = a.rope_factor;
  const bool lora = mla_ffi::present(q_src);
  p.q_in = lora ? (q_src.dimensions().size() == 2 ? q_src.dimensions()[1] : 0) : p.hidden;
  if (auto e = mla_projections_check(p.dtype, p.batch, p.hidden, p.q_in, p.nope, p.rope, p.rank, p.v_dim, false);
      !e.empty() || p.num_heads < 1 || p.capacity < 1) {
    return fail(e.empty() ? "num_heads and capacity must be positive" : e);
  }
  const auto t = x.element_type();
  const int64_t hc = p.num_heads * p.head_cols(), E = p.latent_cols();
  for (auto e : {mla_ffi::expect("norm", norm, t, {p.hidden}),
                 lora ? mla_ffi::expect("q_src", q_src, t, {p.batch, p.q_in}) : std::string(),
                 mla_ffi::expect("w_q", w_q, t, {p.q_in, hc}), mla_ffi::expect("w_kv_a", w_kv_a, t, {p.hidden, E}),
                 mla_ffi::present(kv_a_bias) ? mla_ffi::expect("kv_a_bias", kv_a_bias, t, {E}) : std::string(),
                 mla_ffi::expect("kv_a_norm", kv_a_norm, t, {p.rank}),
                 mla_ffi::expect("w_kv_b", w_kv_b, t, {p.rank, p.num_heads * (p.nope + p.v_dim)}),
                 mla_ffi::expect("lengths", lengths, ffi::DataType::S32, {p.batch}),
                 mla_ffi::expect("inv_freq", inv_freq, ffi::DataType::F32, {p.rope / 2}),
                 mla_ffi::expect("q_full", *q_full, ffi::DataType::F32, {p.batch, p.num_heads, E}),
                 mla_ffi::expect("new_latent", *new_latent, ffi::DataType::F32, {p.batch, E})}) {
    if (!e.empty()) return fail(e);
  }
  p.x = x.untyped_data();
  p.norm = norm.untyped_data();
  p.q_src = lora ? q_src.untyped_data() : nullptr;
  p.w_q = w_q.untyped_data();
  p.w_kv_a = w_kv_a.untyped_data();
  p.kv_a_bias = mla_ffi::present(kv_a_bias) ? kv_a_bias.untyped_data() : nullptr;
  p.kv_a_norm = kv_a_norm.untyped_data();
  p.w_kv_b = w_kv_b.untyped_data();
  p.lengths = static_cast<const int32_t*>(lengths.untyped_data());
  p.inv_freq = static_cast<const float*>(inv_freq.untyped_data());
  const int64_t ws = mla_project_workspace_floats(p.batch, E);
  if (workspace->element_type() != ffi::DataType::F32 || static_cast<int64_t>(workspace->element_count()) < ws) {
    return fail("workspace must be float32 with at least " + std::to_string(ws) + " elements");
  }
  p.q_full = static_cast<float*>(q_full->untyped_data());
  p.new_latent = static_cast<float*>(new_latent->untyped_data());
  if (auto e = mla_ffi::expect("counters", *counters, ffi::DataType::U32, {kMlaCounterWords}); !e.empty()) {
    return fail(e);
  }
  p.kv_raw = static_cast<float*>(workspace->untyped_data());
  p.counters = static_cast<unsigned int*>(counters->untyped_data());
  return p;
}

inline ffi::ErrorOr<MlaOutputParams> decode_mla_output(ffi::AnyBuffer o_lat, ffi::AnyBuffer w_kv_b,
                                                       ffi::AnyBuffer w_o, ffi::AnyBuffer o_bias,
                                                       ffi::AnyBuffer residual, ffi::AnyBuffer counters,
                                                       ffi::Result<ffi::AnyBuffer> y,
                                                       ffi::Result<ffi::AnyBuffer> workspace,
                                                       ffi::Result<ffi::AnyBuffer> counters_out, MlaOutputAttrs a) {
  auto fail = [](const std::string& m) { return ffi::Unexpected(ffi_util::invalid("mla_output: " + m)); };
  auto od = o_lat.dimensions();
  if (od.size() != 3) return fail("o_lat must be [B, H, r]");
  auto dtype = ffi_util::to_dtype(o_lat.element_type(), "o_lat");
  if (!dtype) return ffi::Unexpected(dtype.error());
  MlaOutputParams p{};
  p.dtype = *dtype;
  p.batch = od[0];
  p.num_heads = od[1];
  p.rank = od[2];
  p.nope = a.nope;
  p.v_dim = a.v_dim;
  auto wd = w_o.dimensions();
  if (wd.size() != 2) return fail("w_o must be [H dv, hidden]");
  p.hidden = wd[1];
  if (auto e = mla_projections_check(p.dtype, p.batch, p.hidden, p.hidden, p.nope, 0, p.rank, p.v_dim, false);
      !e.empty() || p.num_heads < 1) {
    return fail(e.empty() ? "num_heads must be positive" : e);
  }
  const auto t = o_lat.element_type();
  for (auto e : {mla_ffi::expect("w_kv_b", w_kv_b, t, {p.rank, p.num_heads * (p.nope + p.v_dim)}),
                 mla_ffi::expect("w_o", w_o, t, {p.num_heads * p.v_dim, p.hidden}),
                 mla_ffi::present(o_bias) ? mla_ffi::expect("o_bias", o_bias, t, {p.hidden}) : std::string(),
                 mla_ffi::present(residual) ? mla_ffi::expect("residual", residual, t, {p.batch, p.hidden})
                                            : std::string(),
                 mla_ffi::expect("y", *y, t, {p.batch, p.hidden}),
                 mla_ffi::expect("counters", counters, ffi::DataType::U32, {kMlaCounterWords})}) {
    if (!e.empty()) return fail(e);
  }
  if (workspace->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(workspace->element_count()) < mla_output_workspace_floats(p)) {
    return fail("workspace must be float32 with at least H * B * hidden elements");
  }
  p.o_lat = o_lat.untyped_data();
  p.w_kv_b = w_kv_b.untyped_data();
  p.w_o = w_o.untyped_data();
  p.o_bias = mla_ffi::present(o_bias) ? o_bias.untyped_data() : nullptr;
  p.residual = mla_ffi::present(residual) ? residual.untyped_data() : nullptr;
  p.y = y->untyped_data();
  p.partial = static_cast<float*>(workspace->untyped_data());
  // counters_out aliases counters (mla_project's, zeroed at its launch): the kernel counts in it
  p.counters = static_cast<unsigned int*>(counters_out->untyped_data());
  return p;
}

}  // namespace jax_cluster
