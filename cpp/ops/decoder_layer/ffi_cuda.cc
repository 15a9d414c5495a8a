// decoder_layer's CUDA target: the binding is decoded and validated like the CPU handler's,
// then the call is refused with decoder_layer_cuda_check's reason until the one-launch kernel
// exists (jax_cluster/ops/decoder_layer.py never binds it on a GPU before then).
#include "ffi/cuda_util.h"
#include "ops/decoder_layer/ffi.h"

namespace jax_cluster {
namespace {

ffi::Error decoder_layer_cuda(cudaStream_t, ffi::RemainingArgs args, ffi::RemainingRets rets, DecoderLayerAttrs attrs) {
  auto p = decode_decoder_layer({args, rets}, attrs);
  if (!p) return p.error();
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "decoder_layer: " + decoder_layer_cuda_check(*p));
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_decoder_layer_cuda, jax_cluster::decoder_layer_cuda,
    xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>().RemainingArgs().RemainingRets().Attrs<
        jax_cluster::DecoderLayerAttrs>(),
    {xla::ffi::Traits::kCmdBufferCompatible});
