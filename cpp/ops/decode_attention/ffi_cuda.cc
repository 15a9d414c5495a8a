#include <utility>

#include "ffi/cuda_util.h"
#include "ops/decode_attention/ffi.h"
#include "ops/decode_attention/launch.h"

namespace jax_cluster {
namespace {

ffi::Error decode_attention_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                 ffi::AnyBuffer v_cache, ffi::AnyBuffer pos,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> workspace, int64_t splits) {
  auto p = decode_decode_attention(q, k_cache, v_cache, pos, out, workspace, splits);
  if (!p) return p.error();
  if (!decode_attention_cuda_supports(*p)) {
    return ffi_util::invalid("decode_attention: no CUDA kernel for this head_dim/dtype "
                             "(head_dim 64, 80, 96 or 128; float16 or bfloat16)");
  }
  return ffi_util::from_cuda(launch_decode_attention(*p, stream), "decode_attention");
}

ffi::Error decode_attention_append_cuda(cudaStream_t stream,
                                        JAX_CLUSTER_DECODE_ATTENTION_APPEND_ARGS) {
  auto p = JAX_CLUSTER_DECODE_ATTENTION_APPEND_DECODE;
  if (!p) return p.error();
  if (!decode_attention_cuda_supports(*p)) {
    return ffi_util::invalid("decode_attention_append: no CUDA kernel for this head_dim/dtype "
                             "(head_dim 64, 80, 96 or 128; float16 or bfloat16)");
  }
  for (auto [src, dst] : {std::pair{k_cache.untyped_data(), k_out->untyped_data()},
                          std::pair{v_cache.untyped_data(), v_out->untyped_data()}}) {
    if (src != dst) {
      auto err = cudaMemcpyAsync(dst, src, k_cache.size_bytes(), cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) return ffi_util::from_cuda(err, "decode_attention_append");
    }
  }
  return ffi_util::from_cuda(launch_decode_attention(*p, stream), "decode_attention_append");
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_decode_attention_cuda, jax_cluster::decode_attention_cuda,
    jax_cluster::bind_decode_attention(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_cluster_decode_attention_append_cuda, jax_cluster::decode_attention_append_cuda,
    jax_cluster::bind_decode_attention_append(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
