// decoder_layer's CUDA target: the one-launch layer kernel (launch.cu). Shapes it does not
// cover are refused with decoder_layer_cuda_check's reason (Python's auto never binds them).
#include "ffi/cuda_util.h"
#include "ops/decoder_layer/ffi.h"
#include "ops/decoder_layer/launch.h"

namespace jax_cluster {
namespace {

ffi::Error decoder_layer_cuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                              DecoderLayerAttrs attrs) {
  auto p = decode_decoder_layer({args, rets}, attrs);
  if (!p) return p.error();
  if (auto e = decoder_layer_cuda_check(*p); !e.empty()) return ffi_util::invalid("decoder_layer: " + e);
  return ffi_util::from_cuda(launch_decoder_layer(*p, p->workspace, stream), "decoder_layer");
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_decoder_layer_cuda, jax_cluster::decoder_layer_cuda,
    xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>().RemainingArgs().RemainingRets().Attrs<
        jax_cluster::DecoderLayerAttrs>(),
    {xla::ffi::Traits::kCmdBufferCompatible});
