#include "ffi/cuda_util.h"
#include "ops/decode_attention/ffi.h"
#include "ops/decode_attention/launch.h"

namespace jax_cluster {
namespace {

// Both targets: decode the call with Params (decode_attention_params or _append_params),
// then launch the kernels.
template <typename Attrs, auto Params>
ffi::Error decode_attention_cuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                                 Attrs attrs) {
  auto p = Params({args, rets}, attrs);
  if (!p) return p.error();
  const char* op = p->qkv != nullptr ? "decode_attention_append" : "decode_attention";
  if (auto e = decode_attention_cuda_check(*p); !e.empty()) return ffi_util::invalid(std::string(op) + ": " + e);
  return ffi_util::from_cuda(launch_decode_attention(*p, stream), op);
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_decode_attention_cuda,
    (jax_cluster::decode_attention_cuda<jax_cluster::DecodeAttentionAttrs, jax_cluster::decode_attention_params>),
    jax_cluster::bind_decode_attention<jax_cluster::DecodeAttentionAttrs>(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_decode_attention_append_cuda,
    (jax_cluster::decode_attention_cuda<jax_cluster::DecodeAttentionAppendAttrs,
                                        jax_cluster::decode_attention_append_params>),
    jax_cluster::bind_decode_attention<jax_cluster::DecodeAttentionAppendAttrs>(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
