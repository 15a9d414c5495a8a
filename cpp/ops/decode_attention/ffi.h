// Decodes and validates decode_attention's FFI arguments (shared by the CPU and CUDA
// handlers). The Python wrapper checks the same things first with friendlier messages.
#pragma once

#include <string>
#include <utility>

#include "ffi/common.h"
#include "ops/decode_attention/params.h"

namespace jax_cluster {

namespace ffi = xla::ffi;

inline ffi::ErrorOr<DecodeAttentionParams> decode_decode_attention(
    ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer pos,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, int64_t splits) {
  auto fail = [](const std::string& m) {
    return ffi::Unexpected(ffi_util::invalid("decode_attention: " + m));
  };
  auto qd = q.dimensions(), kd = k_cache.dimensions();
  auto same = [](ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i] != b[i]) return false;
    }
    return true;
  };
  if (qd.size() != 4 || kd.size() != 4) {
    return fail("q must be [B, Hkv, G, Dh] and the caches [B, Hkv, S_max, Dh]");
  }
  auto dtype = ffi_util::to_dtype(q.element_type(), "q");
  if (!dtype) return ffi::Unexpected(dtype.error());
  if (k_cache.element_type() != q.element_type() || v_cache.element_type() != q.element_type() ||
      out->element_type() != q.element_type()) {
    return fail("q, the caches and out must share one dtype");
  }
  if (!same(v_cache.dimensions(), kd) || kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3]) {
    return fail("shapes disagree: q " + ffi_util::dims_str(qd) + ", k_cache " +
                ffi_util::dims_str(kd) + ", v_cache " + ffi_util::dims_str(v_cache.dimensions()));
  }
  if (!same(out->dimensions(), qd)) return fail("out must have q's shape");
  if (pos.element_type() != ffi::DataType::S32 || pos.dimensions().size() != 1 ||
      pos.dimensions()[0] != qd[0]) {
    return fail("pos must be int32 [B]");
  }
  if (splits < 1 || splits > kDecodeAttentionMaxSplits) {
    return fail("splits must be in 1.." + std::to_string(kDecodeAttentionMaxSplits));
  }
  if (qd[2] < 1 || qd[2] > kDecodeAttentionMaxGroup) {
    return fail("at most " + std::to_string(kDecodeAttentionMaxGroup) + " query heads per KV head");
  }
  DecodeAttentionParams p{};
  p.dtype = *dtype;
  p.batch = qd[0];
  p.num_kv_heads = qd[1];
  p.group = qd[2];
  p.head_dim = qd[3];
  p.max_seq = kd[2];
  p.splits = splits;
  if (workspace->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(workspace->element_count()) < decode_attention_workspace_floats(p)) {
    return fail("workspace must be float32 with at least B * Hkv * splits * G * (Dh + 2) elements");
  }
  p.q = q.untyped_data();
  p.k_cache = k_cache.untyped_data();
  p.v_cache = v_cache.untyped_data();
  p.pos = static_cast<const int32_t*>(pos.untyped_data());
  p.out = out->untyped_data();
  p.partial = static_cast<float*>(workspace->untyped_data());
  return p;
}

// decode_attention_append: qkv [B, (Hq + 2 Hkv) Dh] float32 in place of q; the caches are
// aliased to the outputs k_out, v_out (the new token's k, v are written there).
inline ffi::ErrorOr<DecodeAttentionParams> decode_decode_attention_append(
    ffi::AnyBuffer qkv, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer pos,
    ffi::AnyBuffer inv_freq, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_out,
    ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> workspace, int64_t splits,
    int64_t num_q_heads, int64_t rotary_dim, int64_t rope_layout, float scale) {
  auto fail = [](const std::string& m) {
    return ffi::Unexpected(ffi_util::invalid("decode_attention_append: " + m));
  };
  auto kd = k_cache.dimensions(), od = out->dimensions();
  if (kd.size() != 4 || od.size() != 4) return fail("caches and out must be 4-D");
  const int64_t hkv = kd[1], dh = kd[3];
  if (num_q_heads < 1 || num_q_heads % hkv || od[0] != kd[0] || od[1] != hkv ||
      od[2] * hkv != num_q_heads || od[3] != dh) {
    return fail("out must be [B, Hkv, Hq / Hkv, Dh] for caches " + ffi_util::dims_str(kd) +
                " and num_q_heads " + std::to_string(num_q_heads));
  }
  auto qd = qkv.dimensions();
  if (qkv.element_type() != ffi::DataType::F32 || qd.size() != 2 || qd[0] != kd[0] ||
      qd[1] != (num_q_heads + 2 * hkv) * dh) {
    return fail("qkv must be float32 [B, (Hq + 2 Hkv) Dh], got " + ffi_util::dims_str(qd));
  }
  if (rotary_dim < 0 || rotary_dim > dh || rotary_dim % 2 ||
      inv_freq.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(inv_freq.element_count()) != rotary_dim / 2) {
    return fail("rotary_dim must be even and <= head_dim, inv_freq float32 [rotary_dim / 2]");
  }
  if (rope_layout != 0 && rope_layout != 1) return fail("rope_layout must be 0 (half) or 1 (interleaved)");
  // The attention's checks, on a query-shaped view of out (q is not read in this mode).
  auto p = decode_decode_attention(*out, k_cache, v_cache, pos, out, workspace, splits);
  if (!p) return p;
  // Reads and the new token's write go to the outputs: the caches' aliases (a handler
  // copies the inputs over first in case XLA ever hands it two buffers).
  p->k_cache = k_out->untyped_data();
  p->v_cache = v_out->untyped_data();
  p->q = nullptr;
  p->qkv = static_cast<const float*>(qkv.untyped_data());
  p->inv_freq = static_cast<const float*>(inv_freq.untyped_data());
  p->rotary_dim = rotary_dim;
  p->rope_layout = static_cast<RopeLayout>(rope_layout);
  p->scale = scale;
  return p;
}

template <typename Binding>
auto bind_decode_attention_append(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()  // qkv
      .template Arg<ffi::AnyBuffer>()  // k_cache
      .template Arg<ffi::AnyBuffer>()  // v_cache
      .template Arg<ffi::AnyBuffer>()  // pos
      .template Arg<ffi::AnyBuffer>()  // inv_freq
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // k_out (aliases k_cache)
      .template Ret<ffi::AnyBuffer>()  // v_out (aliases v_cache)
      .template Ret<ffi::AnyBuffer>()  // workspace
      .template Attr<int64_t>("splits")
      .template Attr<int64_t>("num_q_heads")
      .template Attr<int64_t>("rotary_dim")
      .template Attr<int64_t>("rope_layout")
      .template Attr<float>("scale");
}

template <typename Binding>
auto bind_decode_attention(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k_cache
      .template Arg<ffi::AnyBuffer>()  // v_cache
      .template Arg<ffi::AnyBuffer>()  // pos
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // workspace
      .template Attr<int64_t>("splits");
}

}  // namespace jax_cluster

// decode_attention_append's handler signature, which both platforms implement (after the
// optional stream), and its decoding.
#define JAX_CLUSTER_DECODE_ATTENTION_APPEND_ARGS                                                \
  ffi::AnyBuffer qkv, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer pos,       \
      ffi::AnyBuffer inv_freq, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_out, \
      ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> workspace, int64_t splits,  \
      int64_t num_q_heads, int64_t rotary_dim, int64_t rope_layout, float scale
#define JAX_CLUSTER_DECODE_ATTENTION_APPEND_DECODE                                              \
  decode_decode_attention_append(qkv, k_cache, v_cache, pos, inv_freq, out, k_out, v_out,       \
                                 workspace, splits, num_q_heads, rotary_dim, rope_layout, scale)
