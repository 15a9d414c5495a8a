// The FFI bindings of decode_attention and decode_attention_append, shared by the CPU and
// CUDA handlers: attributes as one struct per target, buffers by position (FfiBuffers),
// validated ONCE here into a DecodeAttentionParams. The Python wrapper checks the same sizes
// first (through params.h's checks); this is the last line of defence.
#pragma once

#include <string>
#include <utility>

#include "ffi/common.h"
#include "ops/attention_block/ffi.h"  // FfiBuffers
#include "ops/decode_attention/params.h"

namespace jax_cluster {

namespace ffi = xla::ffi;

struct DecodeAttentionAttrs {
  int64_t splits;
};

struct DecodeAttentionAppendAttrs {
  int64_t splits, num_q_heads, rotary_dim, rope_layout;
  float scale;
  bool rolling;  // the caches are a sliding window's rolling buffer (DecodeAttentionParams)
};

namespace decode_attention_ffi {

inline auto fail(const char* op, const std::string& m) {
  return ffi::Unexpected(ffi_util::invalid(std::string(op) + ": " + m));
}

inline bool same_dims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// The attention's checks and params for a query of shape `qd` (plain mode: q itself; append
// mode: out, whose shape q would have).
inline ffi::ErrorOr<DecodeAttentionParams> attention_params(
    const char* op, ffi::AnyBuffer::Dimensions qd, ffi::DataType q_type, const ffi::AnyBuffer& k_cache,
    const ffi::AnyBuffer& v_cache, const ffi::AnyBuffer& lengths, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> workspace, int64_t splits) {
  auto kd = k_cache.dimensions();
  if (qd.size() != 4 || kd.size() != 4) {
    return fail(op, "q must be [B, Hkv, G, Dh] and the caches [B, Hkv, S_max, Dh]");
  }
  auto dtype = ffi_util::to_dtype(q_type, "q");
  if (!dtype) return ffi::Unexpected(dtype.error());
  if (k_cache.element_type() != q_type || v_cache.element_type() != q_type || out->element_type() != q_type) {
    return fail(op, "q, the caches and out must share one dtype");
  }
  if (!same_dims(v_cache.dimensions(), kd) || kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3]) {
    return fail(op, "shapes disagree: q " + ffi_util::dims_str(qd) + ", k_cache " + ffi_util::dims_str(kd) +
                        ", v_cache " + ffi_util::dims_str(v_cache.dimensions()));
  }
  if (!same_dims(out->dimensions(), qd)) return fail(op, "out must have q's shape");
  if (lengths.element_type() != ffi::DataType::S32 || lengths.dimensions().size() != 1 ||
      lengths.dimensions()[0] != qd[0]) {
    return fail(op, "lengths must be int32 [B]");
  }
  DecodeAttentionParams p{};
  p.dtype = *dtype;
  p.batch = qd[0];
  p.num_kv_heads = qd[1];
  p.group = qd[2];
  p.head_dim = qd[3];
  p.max_seq = kd[2];
  p.splits = splits;
  if (auto e = decode_attention_check(p); !e.empty()) return fail(op, e);
  if (workspace->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(workspace->element_count()) < decode_attention_workspace_floats(p)) {
    return fail(op, "workspace must be float32 with at least B * Hkv * (splits * G * (Dh + 2) + 2 Dh) elements");
  }
  p.k_cache = k_cache.untyped_data();
  p.v_cache = v_cache.untyped_data();
  p.lengths = static_cast<const int32_t*>(lengths.untyped_data());
  p.out = out->untyped_data();
  p.partial = static_cast<float*>(workspace->untyped_data());
  return p;
}

}  // namespace decode_attention_ffi

// Operands (q, k_cache, v_cache, lengths) and results (out, workspace).
inline ffi::ErrorOr<DecodeAttentionParams> decode_attention_params(const FfiBuffers& call,
                                                                        const DecodeAttentionAttrs& a) {
  constexpr const char* kOp = "decode_attention";
  if (auto e = call.arity(4, 2); !e.empty()) return decode_attention_ffi::fail(kOp, e);
  const ffi::AnyBuffer q = call.in(0);
  auto p = decode_attention_ffi::attention_params(kOp, q.dimensions(), q.element_type(), call.in(1),
                                                  call.in(2), call.in(3), call.out(0), call.out(1), a.splits);
  if (p) p->q = q.untyped_data();
  return p;
}

// Operands (qkv, k_cache, v_cache, lengths, inv_freq) and results (out, k_cache, v_cache,
// workspace): qkv [B, (Hq + 2 Hkv) Dh] float32 in place of q; the caches are aliased to the
// results, where the new token's k, v are written.
inline ffi::ErrorOr<DecodeAttentionParams> decode_attention_append_params(
    const FfiBuffers& call, const DecodeAttentionAppendAttrs& a) {
  constexpr const char* kOp = "decode_attention_append";
  using decode_attention_ffi::fail;
  if (auto e = call.arity(5, 4); !e.empty()) return fail(kOp, e);
  const ffi::AnyBuffer qkv = call.in(0), k_cache = call.in(1), v_cache = call.in(2), inv_freq = call.in(4);
  ffi::Result<ffi::AnyBuffer> out = call.out(0), k_out = call.out(1), v_out = call.out(2);
  auto kd = k_cache.dimensions(), od = out->dimensions();
  if (kd.size() != 4 || od.size() != 4) return fail(kOp, "caches and out must be 4-D");
  const int64_t hkv = kd[1], dh = kd[3];
  if (a.num_q_heads < 1 || a.num_q_heads % hkv || od[0] != kd[0] || od[1] != hkv ||
      od[2] * hkv != a.num_q_heads || od[3] != dh) {
    return fail(kOp, "out must be [B, Hkv, Hq / Hkv, Dh] for caches " + ffi_util::dims_str(kd) +
                         " and num_q_heads " + std::to_string(a.num_q_heads));
  }
  auto qd = qkv.dimensions();
  if (qkv.element_type() != ffi::DataType::F32 || qd.size() != 2 || qd[0] != kd[0] ||
      qd[1] != (a.num_q_heads + 2 * hkv) * dh) {
    return fail(kOp, "qkv must be float32 [B, (Hq + 2 Hkv) Dh], got " + ffi_util::dims_str(qd));
  }
  if (inv_freq.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(inv_freq.element_count()) != a.rotary_dim / 2) {
    return fail(kOp, "inv_freq must be float32 [rotary_dim / 2]");
  }
  if (a.rope_layout != 0 && a.rope_layout != 1) return fail(kOp, "rope_layout must be 0 (half) or 1 (interleaved)");
  if (k_out->untyped_data() != k_cache.untyped_data() || v_out->untyped_data() != v_cache.untyped_data()) {
    return fail(kOp, "the caches must be aliased to the k_cache and v_cache results");
  }
  // The attention's checks, on the query shape of out (q is not read in this mode).
  auto p = decode_attention_ffi::attention_params(kOp, od, out->element_type(), k_cache, v_cache,
                                                  call.in(3), out, call.out(3), a.splits);
  if (!p) return p;
  p->qkv = static_cast<const float*>(qkv.untyped_data());
  p->inv_freq = static_cast<const float*>(inv_freq.untyped_data());
  p->rotary_dim = a.rotary_dim;
  p->rope_layout = static_cast<RopeLayout>(a.rope_layout);
  p->scale = a.scale;
  p->rolling = a.rolling;
  if (auto e = decode_attention_check(*p); !e.empty()) return fail(kOp, e);  // rotary_dim
  return p;
}

// The bindings both handlers use (the CUDA ones add the stream first).
template <typename Attrs, typename Binding>
auto bind_decode_attention(Binding&& b) {
  return std::move(b).RemainingArgs().RemainingRets().template Attrs<Attrs>();
}

}  // namespace jax_cluster

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_cluster::DecodeAttentionAttrs,
                                      xla::ffi::StructMember<int64_t>("splits"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_cluster::DecodeAttentionAppendAttrs, xla::ffi::StructMember<int64_t>("splits"),
    xla::ffi::StructMember<int64_t>("num_q_heads"), xla::ffi::StructMember<int64_t>("rotary_dim"),
    xla::ffi::StructMember<int64_t>("rope_layout"), xla::ffi::StructMember<float>("scale"),
    xla::ffi::StructMember<bool>("rolling"));
