#include "ops/attention_block/ffi.h"
#include "ffi/cuda_util.h"
#include "ops/attention_block/launch.h"

namespace jax_cluster {
namespace {

ffi::Error attention_decode_cuda(cudaStream_t stream, JAX_CLUSTER_ATTENTION_DECODE_ARGS) {
  auto p = JAX_CLUSTER_ATTENTION_DECODE_DECODE;
  if (!p) return p.error();
  if (!attention_decode_cuda_supports(*p)) {
    return ffi_util::invalid("attention_decode: no CUDA kernel for this shape/dtype "
                             "(the Python wrapper should have used the reference path)");
  }
  for (auto [in, out] : {std::pair{&k_cache, &k_out}, std::pair{&v_cache, &v_out}}) {
    if ((*out)->untyped_data() != in->untyped_data()) {  // never expected: aliased
      auto err = cudaMemcpyAsync((*out)->untyped_data(), in->untyped_data(), in->size_bytes(),
                                 cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) return ffi_util::from_cuda(err, "attention_decode cache copy");
    }
  }
  return ffi_util::from_cuda(launch_attention_decode(*p, stream), "attention_decode");
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_attention_decode_cuda, jax_cluster::attention_decode_cuda,
    jax_cluster::bind_attention_decode(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
