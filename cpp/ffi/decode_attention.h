// Decodes and validates decode_attention's FFI arguments (shared by the CPU and CUDA
// handlers). The Python wrapper checks the same things first with friendlier messages.
#pragma once

#include <string>
#include <utility>

#include "ffi/common.h"
#include "kernels/decode_attention.h"

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
