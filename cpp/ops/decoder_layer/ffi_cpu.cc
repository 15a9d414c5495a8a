#include "ops/decoder_layer/cpu.h"
#include "ops/decoder_layer/ffi.h"

namespace jax_cluster {
namespace {

ffi::Error decoder_layer_cpu(ffi::RemainingArgs args, ffi::RemainingRets rets, DecoderLayerAttrs attrs) {
  auto p = decode_decoder_layer({args, rets}, attrs);
  if (!p) return p.error();
  cpu::decoder_layer(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_decoder_layer_cpu, jax_cluster::decoder_layer_cpu,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs<jax_cluster::DecoderLayerAttrs>());
