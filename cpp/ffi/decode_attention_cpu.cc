#include "cpu/decode_attention.h"
#include "ffi/decode_attention.h"

namespace jax_cluster {
namespace {

ffi::Error decode_attention_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                ffi::AnyBuffer pos, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> workspace, int64_t splits) {
  auto p = decode_decode_attention(q, k_cache, v_cache, pos, out, workspace, splits);
  if (!p) return p.error();
  cpu::decode_attention(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_decode_attention_cpu, jax_cluster::decode_attention_cpu,
                              jax_cluster::bind_decode_attention(xla::ffi::Ffi::Bind()));
