// Decodes and validates attention_decode's FFI arguments into one
// AttentionDecodeParams, shared by the CPU and CUDA handlers. The Python
// wrapper checks the same things first with friendlier messages; this is the
// last line of defence against a malformed custom call.
#pragma once

#include <string>
#include <utility>

#include "ffi/common.h"
#include "ops/attention_block/params.h"

namespace jax_cluster {

namespace ffi = xla::ffi;

struct AttentionDecodeBuffers {
  ffi::AnyBuffer x, norm_w, norm_b, w_qkv, qkv_bias, w_o, o_bias, inv_freq, lengths, k_cache,
      v_cache;
  ffi::Result<ffi::AnyBuffer> y, k_out, v_out, workspace;
};

inline ffi::ErrorOr<AttentionDecodeParams> decode_attention_decode(
    AttentionDecodeBuffers& a, int64_t num_q_heads, int64_t num_kv_heads, int64_t rotary_dim,
    int64_t rope_layout, int64_t norm, float eps, float scale, bool residual, bool has_qkv_bias,
    bool has_o_bias, int64_t cluster_size, int64_t max_heads_per_cluster, int64_t dataflow,
    int64_t pipeline, int64_t rows_per_cluster) {
  auto fail = [](const std::string& m) {
    return ffi::Unexpected(ffi_util::invalid("attention_decode: " + m));
  };
  auto xd = a.x.dimensions(), kd = a.k_cache.dimensions();
  if (xd.size() != 2 || kd.size() != 4) return fail("x must be [B, D] and caches [B, Hkv, S_max, Dh]");
  auto dtype = ffi_util::to_dtype(a.x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  AttentionDecodeParams p;
  p.dtype = *dtype;
  p.batch = xd[0];
  p.hidden = xd[1];
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = kd[3];
  p.max_seq = kd[2];
  p.rotary_dim = rotary_dim;
  p.rope_layout = static_cast<RopeLayout>(rope_layout);
  p.norm = static_cast<NormKind>(norm);
  p.eps = eps;
  p.scale = scale;
  p.residual = residual;
  p.has_qkv_bias = has_qkv_bias;
  p.has_o_bias = has_o_bias;
  p.cluster_size = static_cast<int>(cluster_size);
  if (max_heads_per_cluster < 1 || max_heads_per_cluster > kAttnMaxHeadsPerCluster) {
    return fail("max_heads_per_cluster must be in 1..8");
  }
  p.max_heads_per_cluster = static_cast<int>(max_heads_per_cluster);
  if (dataflow != 0 && dataflow != 1) return fail("dataflow must be 0 (split_token) or 1 (split_head)");
  p.dataflow = static_cast<AttnDataflow>(dataflow);
  if (pipeline != 0 && pipeline != 1) return fail("pipeline must be 0 (registers) or 1 (tma)");
  if (pipeline == 1 && p.dataflow != AttnDataflow::kSplitToken) {
    return fail("pipeline tma is a SplitToken pipeline (dataflow split_token)");
  }
  p.pipeline = static_cast<AttnPipeline>(pipeline);
  if (!is_pow2_cluster_size(rows_per_cluster)) {
    return fail("rows_per_cluster must be 1, 2, 4, 8 or 16");
  }
  p.rows_per_cluster = static_cast<int>(rows_per_cluster);
  if (rows_per_cluster > 1 && (p.dataflow != AttnDataflow::kSplitToken || p.pipeline != AttnPipeline::kRegisters)) {
    return fail("rows_per_cluster > 1 (the batch-tiled kernel) needs dataflow split_token and pipeline registers");
  }
  if (p.dataflow == AttnDataflow::kSplitHead && p.head_dim % (8 * cluster_size) != 0) {
    return fail("dataflow split_head needs head_dim divisible by 8 * cluster_size");
  }
  if (num_kv_heads < 1 || num_q_heads % num_kv_heads) return fail("num_q_heads must be a multiple of num_kv_heads");
  if (kd[0] != p.batch || kd[1] != num_kv_heads) return fail("cache shape does not match x / num_kv_heads");
  if (rotary_dim < 0 || rotary_dim > p.head_dim || rotary_dim % 2) return fail("rotary_dim must be even and <= head_dim");
  if (!is_valid_cluster_size(cluster_size)) return fail("cluster_size must be 1..8 or 16");
  if (!is_pow2_cluster_size(cluster_size) && (p.dataflow != AttnDataflow::kSplitToken || rows_per_cluster > 1)) {
    return fail("cluster sizes 3, 5, 6, 7 are for the SplitToken kernels with rows_per_cluster 1 only");
  }
  const int64_t cols = (num_q_heads + 2 * num_kv_heads) * p.head_dim;
  if (a.w_qkv.element_count() != static_cast<size_t>(p.hidden * cols)) return fail("w_qkv must be [D, (Hq + 2 Hkv) Dh]");
  if (a.w_o.element_count() != static_cast<size_t>(num_q_heads * p.head_dim * p.hidden)) return fail("w_o must be [Hq Dh, D]");
  if (has_qkv_bias && a.qkv_bias.element_count() != static_cast<size_t>(cols)) return fail("qkv_bias size");
  if (has_o_bias && a.o_bias.element_count() != static_cast<size_t>(p.hidden)) return fail("o_bias size");
  if (p.norm != NormKind::kNone && a.norm_w.element_count() != static_cast<size_t>(p.hidden)) return fail("norm_weight size");
  if (p.norm == NormKind::kLayer && a.norm_b.element_count() != static_cast<size_t>(p.hidden)) return fail("norm_bias size");
  if (a.inv_freq.element_type() != ffi::DataType::F32 || a.inv_freq.element_count() != static_cast<size_t>(rotary_dim / 2)) return fail("inv_freq must be float32 [rotary_dim / 2]");
  if (a.lengths.element_type() != ffi::DataType::S32 || a.lengths.element_count() != static_cast<size_t>(p.batch)) return fail("lengths must be int32 [B]");
  for (const ffi::AnyBuffer* buf : {&a.w_qkv, &a.w_o, &a.k_cache, &a.v_cache}) {
    if (buf->element_type() != a.x.element_type()) return fail("weights and caches must have x's dtype");
  }
  if (rows_per_cluster > 1) {
    const TiledLayout tiled(p.hidden, p.rows_per_cluster, static_cast<int>(p.heads_per_cluster()),
                            static_cast<int>(p.head_dim), p.cluster_size);
    if (tiled.bytes > kMaxSharedBytesPerBlock - 2048) {  // less the static part (<= 1.4 KB)
      return fail("rows_per_cluster " + std::to_string(rows_per_cluster) + " needs " +
                  std::to_string(tiled.bytes) + " bytes of shared memory per block, more than a block has");
    }
  }
  if (a.workspace->size_bytes() < static_cast<size_t>(attention_decode_workspace_bytes(p))) return fail("workspace too small");
  p.x = a.x.untyped_data();
  p.norm_w = a.norm_w.untyped_data();
  p.norm_b = a.norm_b.untyped_data();
  p.w_qkv = a.w_qkv.untyped_data();
  p.qkv_bias = a.qkv_bias.untyped_data();
  p.w_o = a.w_o.untyped_data();
  p.o_bias = a.o_bias.untyped_data();
  p.inv_freq = static_cast<const float*>(a.inv_freq.untyped_data());
  p.lengths = static_cast<const int32_t*>(a.lengths.untyped_data());
  p.k_cache = a.k_out->untyped_data();  // aliased with the input cache
  p.v_cache = a.v_out->untyped_data();
  p.y = a.y->untyped_data();
  p.partial = static_cast<float*>(a.workspace->untyped_data());
  return p;
}

// Ffi binding shared by both handlers (the CUDA one prepends the stream).
template <typename Binding>
auto bind_attention_decode(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()      // norm_w
      .template Arg<ffi::AnyBuffer>()      // norm_b
      .template Arg<ffi::AnyBuffer>()      // w_qkv
      .template Arg<ffi::AnyBuffer>()      // qkv_bias
      .template Arg<ffi::AnyBuffer>()      // w_o
      .template Arg<ffi::AnyBuffer>()      // o_bias
      .template Arg<ffi::AnyBuffer>()      // inv_freq
      .template Arg<ffi::AnyBuffer>()      // lengths
      .template Arg<ffi::AnyBuffer>()      // k_cache
      .template Arg<ffi::AnyBuffer>()      // v_cache
      .template Ret<ffi::AnyBuffer>()      // y
      .template Ret<ffi::AnyBuffer>()      // k_cache (aliased)
      .template Ret<ffi::AnyBuffer>()      // v_cache (aliased)
      .template Ret<ffi::AnyBuffer>()      // workspace
      .template Attr<int64_t>("num_q_heads")
      .template Attr<int64_t>("num_kv_heads")
      .template Attr<int64_t>("rotary_dim")
      .template Attr<int64_t>("rope_layout")
      .template Attr<int64_t>("norm")
      .template Attr<float>("eps")
      .template Attr<float>("scale")
      .template Attr<bool>("residual")
      .template Attr<bool>("has_qkv_bias")
      .template Attr<bool>("has_o_bias")
      .template Attr<int64_t>("cluster_size")
      .template Attr<int64_t>("max_heads_per_cluster")
      .template Attr<int64_t>("dataflow")
      .template Attr<int64_t>("pipeline")
      .template Attr<int64_t>("rows_per_cluster");
}

}  // namespace jax_cluster

// The handler signature both platforms implement (after the optional stream).
#define JAX_CLUSTER_ATTENTION_DECODE_ARGS                                                       \
  ffi::AnyBuffer x, ffi::AnyBuffer norm_w, ffi::AnyBuffer norm_b, ffi::AnyBuffer w_qkv,          \
      ffi::AnyBuffer qkv_bias, ffi::AnyBuffer w_o, ffi::AnyBuffer o_bias, ffi::AnyBuffer inv_freq, \
      ffi::AnyBuffer lengths, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,                    \
      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> k_out,                          \
      ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> workspace,                  \
      int64_t num_q_heads, int64_t num_kv_heads, int64_t rotary_dim, int64_t rope_layout,        \
      int64_t norm, float eps, float scale, bool residual, bool has_qkv_bias, bool has_o_bias,   \
      int64_t cluster_size, int64_t max_heads_per_cluster, int64_t dataflow, int64_t pipeline,  \
      int64_t rows_per_cluster
#define JAX_CLUSTER_ATTENTION_DECODE_DECODE                                                      \
  [&] {                                                                                          \
    AttentionDecodeBuffers buffers{x,       norm_w,  norm_b, w_qkv, qkv_bias, w_o, o_bias,       \
                                   inv_freq, lengths, k_cache, v_cache, y, k_out, v_out,         \
                                   workspace};                                                   \
    return decode_attention_decode(buffers,                                                      \
      num_q_heads, num_kv_heads, rotary_dim, rope_layout, norm, eps, scale, residual,            \
      has_qkv_bias, has_o_bias, cluster_size, max_heads_per_cluster, dataflow, pipeline,         \
      rows_per_cluster);                                                                         \
  }()
