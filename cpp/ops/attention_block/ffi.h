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

  auto xd = x.dimensions(), kd = k_cache.dimensions();
  if (xd.size() != 2 || kd.size() != 4) return fail("x must be [B, D] and caches [B, Hkv, S_max, Dh]");
  auto dtype = ffi_util::to_dtype(x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  if (a.rope_layout != 0 && a.rope_layout != 1) return fail("rope_layout must be 0 (half) or 1 (interleaved)");
  if (a.norm < 0 || a.norm > 2) return fail("norm must be 0 (none), 1 (rms) or 2 (layer)");
  AttentionBlockParams p{};
  p.dtype = *dtype;
  p.batch = xd[0];
  p.hidden = xd[1];
  p.num_q_heads = a.num_q_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.head_dim = kd[3];
  p.max_seq = kd[2];
  p.rotary_dim = a.rotary_dim;
  p.rope_layout = static_cast<RopeLayout>(a.rope_layout);
  p.norm = static_cast<NormKind>(a.norm);
  p.eps = a.eps;
  p.scale = a.scale;
  p.residual = a.residual;
  p.has_qkv_bias = a.has_qkv_bias;
  p.has_o_bias = a.has_o_bias;
  p.cluster_size = static_cast<int>(a.cluster_size);
  p.max_heads_per_cluster = static_cast<int>(a.max_heads_per_cluster);
  p.dataflow = static_cast<AttnDataflow>(a.dataflow);
  p.pipeline = static_cast<AttnPipeline>(a.pipeline);
  if (auto e = attention_block_check(p); !e.empty()) return fail(e);

  if (kd[0] != p.batch || kd[1] != p.num_kv_heads) return fail("cache shape does not match x / num_kv_heads");
  if (v_cache.dimensions().size() != 4 || v_cache.element_count() != k_cache.element_count()) {
    return fail("v_cache must have k_cache's shape");
  }
  const int64_t cols = (p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim;
  auto count = [](const ffi::AnyBuffer& b) { return static_cast<int64_t>(b.element_count()); };
  if (count(w_qkv) != p.hidden * cols) return fail("w_qkv must be [D, (Hq + 2 Hkv) Dh]");
  if (count(w_o) != p.num_q_heads * p.head_dim * p.hidden) return fail("w_o must be [Hq Dh, D]");
  if (p.has_qkv_bias && count(qkv_bias) != cols) return fail("qkv_bias must be [(Hq + 2 Hkv) Dh]");
  if (p.has_o_bias && count(o_bias) != p.hidden) return fail("o_bias must be [D]");
  if (p.norm != NormKind::kNone && count(norm_w) != p.hidden) return fail("norm_weight must be [D]");
  if (p.norm == NormKind::kLayer && count(norm_b) != p.hidden) return fail("norm_bias must be [D]");
  if (inv_freq.element_type() != ffi::DataType::F32 || count(inv_freq) != p.rotary_dim / 2) {
    return fail("inv_freq must be float32 [rotary_dim / 2]");
  }
  if (lengths.element_type() != ffi::DataType::S32 || count(lengths) != p.batch) {
    return fail("lengths must be int32 [B]");
  }
  for (const ffi::AnyBuffer* buf : {&w_qkv, &w_o, &k_cache, &v_cache}) {
    if (buf->element_type() != x.element_type()) return fail("weights and caches must have x's dtype");
  }
  // The caches are updated in place: XLA hands the aliased outputs the operands' buffers.
  if (k_out->untyped_data() != k_cache.untyped_data() || v_out->untyped_data() != v_cache.untyped_data()) {
    return fail("the caches must be aliased to the k_cache and v_cache results");
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
