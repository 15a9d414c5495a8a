// attention_block's FFI binding, shared by the CPU and CUDA handlers: the attributes are
// one struct (decoded by XLA from the call's attribute dictionary), the buffers are read by
// position, and both are validated ONCE here into an AttentionBlockParams. The Python
// wrapper checks the same step first (through plan.h, so the messages agree); this is the
// last line of defence against a malformed custom call.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "ffi/common.h"
#include "ffi/decode_step.h"
#include "ops/attention_block/params.h"
#include "ops/attention_block/plan.h"

namespace jax_cluster {

namespace ffi = xla::ffi;

// The custom call's attributes (Python: jax_cluster/ops/attention_block.py binds them).
struct AttentionBlockAttrs {
  int64_t num_q_heads, num_kv_heads, rotary_dim, rope_layout, norm;
  float eps, scale;
  bool residual, has_qkv_bias, has_o_bias;
  int64_t cluster_size, max_heads_per_cluster, dataflow, pipeline;
};

// A call's buffers, bound as .RemainingArgs().RemainingRets(): operand i and result i by
// position, once `arity` checked that there are exactly `ins` and `outs` of them, all
// arrays (the attention ops' handlers share this).
struct FfiBuffers {
  ffi::RemainingArgs args;
  ffi::RemainingRets rets;

  std::string arity(size_t ins, size_t outs) const {
    if (args.size() != ins || rets.size() != outs) {
      return "expected " + std::to_string(ins) + " operands and " + std::to_string(outs) +
             " results, got " + std::to_string(args.size()) + " and " + std::to_string(rets.size());
    }
    for (size_t i = 0; i < ins; ++i) {
      if (!args.isa<ffi::AnyBuffer>(i)) return "operand " + std::to_string(i) + " is not an array";
    }
    for (size_t i = 0; i < outs; ++i) {
      if (!rets.isa<ffi::AnyBuffer>(i)) return "result " + std::to_string(i) + " is not an array";
    }
    return "";
  }
  ffi::AnyBuffer in(size_t i) const { return *args.get<ffi::AnyBuffer>(i); }
  ffi::Result<ffi::AnyBuffer> out(size_t i) const { return *rets.get<ffi::AnyBuffer>(i); }
};

// Operands and results in the order Python binds them.
enum AttentionBlockOperand : size_t {
  kAbX, kAbNormW, kAbNormB, kAbWqkv, kAbQkvBias, kAbWo, kAbOBias, kAbInvFreq, kAbLengths,
  kAbKCache, kAbVCache, kAbOperands
};
enum AttentionBlockResult : size_t { kAbY, kAbKOut, kAbVOut, kAbWorkspace, kAbResults };

inline ffi::ErrorOr<AttentionBlockParams> attention_block_params(const FfiBuffers& call,
                                                                 const AttentionBlockAttrs& a) {
  auto fail = [](const std::string& m) {
    return ffi::Unexpected(ffi_util::invalid("attention_block: " + m));
  };
  if (auto e = call.arity(kAbOperands, kAbResults); !e.empty()) return fail(e);
  const ffi::AnyBuffer x = call.in(kAbX), k_cache = call.in(kAbKCache), v_cache = call.in(kAbVCache);
  const ffi::AnyBuffer w_qkv = call.in(kAbWqkv), w_o = call.in(kAbWo), norm_w = call.in(kAbNormW);
  const ffi::AnyBuffer norm_b = call.in(kAbNormB), qkv_bias = call.in(kAbQkvBias);
  const ffi::AnyBuffer o_bias = call.in(kAbOBias), inv_freq = call.in(kAbInvFreq);
  const ffi::AnyBuffer lengths = call.in(kAbLengths);
  ffi::Result<ffi::AnyBuffer> y = call.out(kAbY), k_out = call.out(kAbKOut), v_out = call.out(kAbVOut);
  ffi::Result<ffi::AnyBuffer> workspace = call.out(kAbWorkspace);

  AttentionBlockParams p{};
  if (auto e = read_decode_geometry(p, x, k_cache, a); !e.empty()) return fail(e);
  auto dtype = ffi_util::to_dtype(x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  if (a.norm < 0 || a.norm > 2) return fail("norm must be 0 (none), 1 (rms) or 2 (layer)");
  p.dtype = *dtype;
  p.residual = a.residual;
  p.has_qkv_bias = a.has_qkv_bias;
  p.has_o_bias = a.has_o_bias;
  p.cluster_size = static_cast<int>(a.cluster_size);
  p.max_heads_per_cluster = static_cast<int>(a.max_heads_per_cluster);
  p.dataflow = static_cast<AttnDataflow>(a.dataflow);
  p.pipeline = static_cast<AttnPipeline>(a.pipeline);
  if (auto e = attention_block_check(p); !e.empty()) return fail(e);

  if (auto e = check_decode_inputs(p, k_cache, v_cache, lengths, inv_freq, k_out->untyped_data(),
                                   v_out->untyped_data());
      !e.empty()) {
    return fail(e);
  }
  const int64_t cols = (p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim;
  auto count = [](const ffi::AnyBuffer& b) { return static_cast<int64_t>(b.element_count()); };
  if (count(w_qkv) != p.hidden * cols) return fail("w_qkv must be [D, (Hq + 2 Hkv) Dh]");
  if (count(w_o) != p.num_q_heads * p.head_dim * p.hidden) return fail("w_o must be [Hq Dh, D]");
  if (p.has_qkv_bias && count(qkv_bias) != cols) return fail("qkv_bias must be [(Hq + 2 Hkv) Dh]");
  if (p.has_o_bias && count(o_bias) != p.hidden) return fail("o_bias must be [D]");
  if (p.norm != NormKind::kNone && count(norm_w) != p.hidden) return fail("norm_weight must be [D]");
  if (p.norm == NormKind::kLayer && count(norm_b) != p.hidden) return fail("norm_bias must be [D]");
  for (const ffi::AnyBuffer* buf : {&w_qkv, &w_o, &k_cache, &v_cache}) {
    if (buf->element_type() != x.element_type()) return fail("weights and caches must have x's dtype");
  }
  if (static_cast<int64_t>(workspace->size_bytes()) < attention_block_workspace_bytes(p)) {
    return fail("workspace too small");
  }
  p.x = x.untyped_data();
  p.norm_w = norm_w.untyped_data();
  p.norm_b = norm_b.untyped_data();
  p.w_qkv = w_qkv.untyped_data();
  p.qkv_bias = qkv_bias.untyped_data();
  p.w_o = w_o.untyped_data();
  p.o_bias = o_bias.untyped_data();
  p.inv_freq = static_cast<const float*>(inv_freq.untyped_data());
  p.lengths = static_cast<const int32_t*>(lengths.untyped_data());
  p.k_cache = k_out->untyped_data();
  p.v_cache = v_out->untyped_data();
  p.y = y->untyped_data();
  p.partial = static_cast<float*>(workspace->untyped_data());
  return p;
}

// The binding both handlers use (the CUDA one adds the stream first).
template <typename Binding>
auto bind_attention_block(Binding&& b) {
  return std::move(b).RemainingArgs().RemainingRets().template Attrs<AttentionBlockAttrs>();
}

}  // namespace jax_cluster

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_cluster::AttentionBlockAttrs, xla::ffi::StructMember<int64_t>("num_q_heads"),
    xla::ffi::StructMember<int64_t>("num_kv_heads"), xla::ffi::StructMember<int64_t>("rotary_dim"),
    xla::ffi::StructMember<int64_t>("rope_layout"), xla::ffi::StructMember<int64_t>("norm"),
    xla::ffi::StructMember<float>("eps"), xla::ffi::StructMember<float>("scale"),
    xla::ffi::StructMember<bool>("residual"), xla::ffi::StructMember<bool>("has_qkv_bias"),
    xla::ffi::StructMember<bool>("has_o_bias"), xla::ffi::StructMember<int64_t>("cluster_size"),
    xla::ffi::StructMember<int64_t>("max_heads_per_cluster"),
    xla::ffi::StructMember<int64_t>("dataflow"), xla::ffi::StructMember<int64_t>("pipeline"));
