// The FFI binding of decoder_layer (operands by position, one attribute struct), shared by the
// CPU and CUDA handlers. The Python wrapper (jax_cluster/ops/decoder_layer.py) checks the same
// things first; absent optional weights are passed as empty arrays.
#pragma once

#include <string>
#include <utility>

#include "ffi/common.h"
#include "ffi/decode_step.h"
#include "ops/attention_block/ffi.h"  // FfiBuffers
#include "ops/decoder_layer/params.h"
#include "ops/decoder_layer/plan.h"

namespace jax_cluster {

struct DecoderLayerAttrs {
  int64_t num_q_heads, num_kv_heads, rotary_dim, rope_layout, norm, mlp;
  bool parallel_residual, rolling;
  float eps, scale;
};

// Operands and results in the order Python binds them; results: y, k_cache, v_cache and
// the one-launch kernel's fp32 workspace (decoder_layer_workspace_floats; unused on CPU).
enum DecoderLayerOperand : size_t {
  kDlX, kDlNormW, kDlNormB, kDlWqkv, kDlQkvBias, kDlWo, kDlOBias, kDlPostNormW, kDlPostNormB,
  kDlW1, kDlW2, kDlW3, kDlB1, kDlB3, kDlKCache, kDlVCache, kDlLengths, kDlInvFreq, kDlOperands
};

inline ffi::ErrorOr<DecoderLayerParams> decode_decoder_layer(const FfiBuffers& call, const DecoderLayerAttrs& a) {
  auto fail = [](const std::string& m) { return ffi::Unexpected(ffi_util::invalid("decoder_layer: " + m)); };
  if (auto e = call.arity(kDlOperands, 4); !e.empty()) return fail(e);
  const ffi::AnyBuffer x = call.in(kDlX), kc = call.in(kDlKCache), vc = call.in(kDlVCache);
  const ffi::AnyBuffer lengths = call.in(kDlLengths), inv_freq = call.in(kDlInvFreq);
  DecoderLayerParams p{};
  if (auto e = read_decode_geometry(p, x, kc, a); !e.empty()) return fail(e);
  auto dtype = ffi_util::to_dtype(x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  if (a.mlp < 0 || a.mlp > 2) return fail("mlp must be 0 (SwiGLU), 1 (GeLU) or 2 (tanh GeLU)");
  p.dtype = *dtype;
  p.mlp = static_cast<MlpKind>(a.mlp);
  p.parallel_residual = a.parallel_residual;
  p.rolling = a.rolling;
  p.inter = call.in(kDlW1).dimensions().size() == 2 ? call.in(kDlW1).dimensions()[1] : 0;
  if (auto e = decoder_layer_check(p); !e.empty()) return fail(e);
  if (auto e = check_decode_inputs(p, kc, vc, lengths, inv_freq, call.out(1)->untyped_data(),
                                   call.out(2)->untyped_data());
      !e.empty()) {
    return fail(e);
  }
  const int64_t d = p.hidden, f = p.inter, dh = p.head_dim, cols = (p.num_q_heads + 2 * p.num_kv_heads) * dh;
  // (operand, elements it must hold; 0: may be empty, -1: must be empty)
  const bool swiglu = p.mlp == MlpKind::kSwiglu, layer = p.norm == NormKind::kLayer;
  const std::pair<size_t, int64_t> sizes[] = {
      {kDlNormW, d}, {kDlNormB, layer ? d : -1}, {kDlWqkv, d * cols}, {kDlQkvBias, 0}, {kDlWo, p.num_q_heads * dh * d},
      {kDlOBias, 0}, {kDlPostNormW, d}, {kDlPostNormB, layer ? d : -1}, {kDlW1, d * f}, {kDlW2, swiglu ? d * f : -1},
      {kDlW3, f * d}, {kDlB1, swiglu ? -1 : 0}, {kDlB3, swiglu ? -1 : 0}};
  const int64_t optional_size[] = {0, 0, 0, cols, 0, d, 0, 0, 0, 0, 0, f, d};
  for (size_t i = 0; i < std::size(sizes); ++i) {
    const ffi::AnyBuffer buf = call.in(sizes[i].first);
    const int64_t n = static_cast<int64_t>(buf.element_count()), want = sizes[i].second;
    const bool ok = want > 0 ? n == want : want < 0 ? n == 0 : (n == 0 || n == optional_size[i]);
    if (!ok || (n > 0 && buf.element_type() != x.element_type())) {
      return fail("operand " + std::to_string(sizes[i].first) + " has " + std::to_string(n) +
                  " elements or another dtype than x");
    }
  }
  auto y = call.out(0);
  if (y->element_type() != x.element_type() || y->element_count() != x.element_count()) {
    return fail("y must have x's shape and dtype");
  }
  auto ws = call.out(3);
  if (ws->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(ws->element_count()) < decoder_layer_workspace_floats(p)) {
    return fail("the workspace must be float32 of decoder_layer_workspace_floats elements");
  }
  p.workspace = static_cast<float*>(ws->untyped_data());
  auto ptr = [&](size_t i) -> const void* {
    const ffi::AnyBuffer buf = call.in(i);
    return buf.element_count() ? buf.untyped_data() : nullptr;
  };
  p.x = x.untyped_data();
  p.norm_w = ptr(kDlNormW), p.norm_b = ptr(kDlNormB), p.w_qkv = ptr(kDlWqkv), p.qkv_bias = ptr(kDlQkvBias);
  p.w_o = ptr(kDlWo), p.o_bias = ptr(kDlOBias), p.post_norm_w = ptr(kDlPostNormW), p.post_norm_b = ptr(kDlPostNormB);
  p.w1 = ptr(kDlW1), p.w2 = ptr(kDlW2), p.w3 = ptr(kDlW3), p.b1 = ptr(kDlB1), p.b3 = ptr(kDlB3);
  p.inv_freq = static_cast<const float*>(inv_freq.untyped_data());
  p.lengths = static_cast<const int32_t*>(lengths.untyped_data());
  p.k_cache = kc.untyped_data();
  p.v_cache = vc.untyped_data();
  p.y = y->untyped_data();
  return p;
}

}  // namespace jax_cluster

JAX_CLUSTER_FFI_ATTRS(jax_cluster::DecoderLayerAttrs, xla::ffi::StructMember<int64_t>("num_q_heads"),
                      xla::ffi::StructMember<int64_t>("num_kv_heads"), xla::ffi::StructMember<int64_t>("rotary_dim"),
                      xla::ffi::StructMember<int64_t>("rope_layout"), xla::ffi::StructMember<int64_t>("norm"),
                      xla::ffi::StructMember<int64_t>("mlp"), xla::ffi::StructMember<bool>("parallel_residual"),
                      xla::ffi::StructMember<bool>("rolling"), xla::ffi::StructMember<float>("eps"), xla::ffi::StructMember<float>("scale"));
