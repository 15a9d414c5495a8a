#include "ops/decode_attention/cpu.h"
#include "ops/decode_attention/ffi.h"

namespace jax_cluster {
namespace {

// Both targets: decode the call with Params (decode_attention_params or _append_params),
// then run the plain C++ computation.
template <typename Attrs, auto Params>
ffi::Error decode_attention_cpu(ffi::RemainingArgs args, ffi::RemainingRets rets, Attrs attrs) {
  auto p = Params({args, rets}, attrs);
  if (!p) return p.error();
  cpu::decode_attention(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_decode_attention_cpu,
    (jax_cluster::decode_attention_cpu<jax_cluster::DecodeAttentionAttrs, jax_cluster::decode_attention_params>),
    jax_cluster::bind_decode_attention<jax_cluster::DecodeAttentionAttrs>(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_decode_attention_append_cpu,
    (jax_cluster::decode_attention_cpu<jax_cluster::DecodeAttentionAppendAttrs,
                                       jax_cluster::decode_attention_append_params>),
    jax_cluster::bind_decode_attention<jax_cluster::DecodeAttentionAppendAttrs>(xla::ffi::Ffi::Bind()));
