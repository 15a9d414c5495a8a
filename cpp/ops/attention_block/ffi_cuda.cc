#include "ffi/cuda_util.h"
#include "ops/attention_block/ffi.h"
#include "ops/attention_block/launch.h"

namespace jax_cluster {
namespace {

ffi::Error attention_block_cuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                                AttentionBlockAttrs attrs) {
  auto p = attention_block_params({args, rets}, attrs);
  if (!p) return p.error();
  if (auto e = attention_block_cuda_check(*p); !e.empty()) return ffi_util::invalid("attention_block: " + e);
  return ffi_util::from_cuda(launch_attention_block(*p, stream), "attention_block");
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_attention_block_cuda, jax_cluster::attention_block_cuda,
    jax_cluster::bind_attention_block(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
