// What the decode-step ops (attention_block, decoder_layer) read the same way from a call:
// the geometry of x [B, D] and of the caches [B, Hkv, S_max, Dh] with the attributes' head
// counts, RoPE and norm settings; the per-row inputs lengths (int32 [B]) and inv_freq
// (float32 [rotary_dim / 2]); the caches aliased to their results (updated in place).
// Each returns "" or the problem, which the op prefixes with its name.
#pragma once

#include <string>

#include "ffi/common.h"

namespace jax_cluster {

// Fills the geometry fields Params shares with every decode-step op's params struct
// (batch, hidden, head counts, head_dim, max_seq, rotary_dim, rope_layout, norm, eps, scale).
template <class Params, class Attrs>
std::string read_decode_geometry(Params& p, const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& k_cache,
                                 const Attrs& a) {
  auto xd = x.dimensions(), kd = k_cache.dimensions();
  if (xd.size() != 2 || kd.size() != 4) return "x must be [B, D] and the caches [B, Hkv, S_max, Dh]";
  if (a.rope_layout != 0 && a.rope_layout != 1) return "rope_layout must be 0 (half) or 1 (interleaved)";
  p.batch = xd[0];
  p.hidden = xd[1];
  p.num_q_heads = a.num_q_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.head_dim = kd[3];
  p.max_seq = kd[2];
  p.rotary_dim = a.rotary_dim;
  p.rope_layout = static_cast<decltype(p.rope_layout)>(a.rope_layout);
  p.norm = static_cast<decltype(p.norm)>(a.norm);
  p.eps = a.eps;
  p.scale = a.scale;
  return "";
}

// The caches against x's batch and num_kv_heads, lengths, inv_freq, and the aliasing of the
// cache results (XLA hands the aliased outputs the operands' buffers).
template <class Params>
std::string check_decode_inputs(const Params& p, const xla::ffi::AnyBuffer& k_cache,
                                const xla::ffi::AnyBuffer& v_cache, const xla::ffi::AnyBuffer& lengths,
                                const xla::ffi::AnyBuffer& inv_freq, void* k_out, void* v_out) {
  auto kd = k_cache.dimensions();
  if (kd[0] != p.batch || kd[1] != p.num_kv_heads) {
    return "the caches must be [B, Hkv, S_max, Dh] with x's B and num_kv_heads";
  }
  if (v_cache.dimensions().size() != 4 || v_cache.element_count() != k_cache.element_count()) {
    return "v_cache must have k_cache's shape";
  }
  if (lengths.element_type() != xla::ffi::DataType::S32 || static_cast<int64_t>(lengths.element_count()) != p.batch) {
    return "lengths must be int32 [B]";
  }
  if (inv_freq.element_type() != xla::ffi::DataType::F32 ||
      static_cast<int64_t>(inv_freq.element_count()) != p.rotary_dim / 2) {
    return "inv_freq must be float32 [rotary_dim / 2]";
  }
  if (k_out != k_cache.untyped_data() || v_out != v_cache.untyped_data()) {
    return "the caches must be aliased to the k_cache and v_cache results";
  }
  return "";
}

}  // namespace jax_cluster
