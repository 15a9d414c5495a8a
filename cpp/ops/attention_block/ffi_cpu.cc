#include "ops/attention_block/cpu.h"
#include "ops/attention_block/ffi.h"

namespace jax_cluster {
namespace {

ffi::Error attention_block_cpu(ffi::RemainingArgs args, ffi::RemainingRets rets, AttentionBlockAttrs attrs) {
  auto p = attention_block_params({args, rets}, attrs);
  if (!p) return p.error();
  cpu::attention_block(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cluster

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_attention_block_cpu, jax_cluster::attention_block_cpu,
                              jax_cluster::bind_attention_block(xla::ffi::Ffi::Bind()));
