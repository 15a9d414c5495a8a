// XLA FFI handlers of the one-sided backend (jax_cluster/parallel/nvshmem_backend.py builds the
// calls). No command-buffer trait: a put and its wait are paired on the host (runtime.h), so
// each must run as its own thunk, in program order.
//
// A slot that arrived by a put stays in the arena: `wait` returns a token once its signal
// came, and what reads the slot takes that token (so XLA orders it after the wait) and the
// region's offset. `flash_attention` runs the op's kernel with such chunks read in place,
// `put` forwards them (the ring passing K/V on), `read` copies one out for anything else.
#include <cuda_runtime.h>

#include <string>

#include "ffi/cuda_util.h"
#include "ops/flash_attention/ffi.h"
#include "ops/flash_attention/launch.h"
#include "runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace rt = jax_cluster::nvshmem_rt;

namespace {

ffi::Error status(const std::string& e) {
  return e.empty() ? ffi::Error::Success() : ffi::Error(ffi::ErrorCode::kInternal, e);
}

ffi::Error put(cudaStream_t stream, ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> /*token*/, int64_t offset,
               int64_t nbytes, int64_t signal, int64_t signal_offset, ffi::Span<const int64_t> peers,
               int64_t src_offset) {
  if (static_cast<int64_t>(peers.size()) != rt::n_pes())
    return ffi::Error::InvalidArgument("nvshmem put: peers for " + std::to_string(peers.size()) +
                                       " PEs, NVSHMEM has " + std::to_string(rt::n_pes()));
  const void* data = src.untyped_data();
  if (src_offset >= 0) {  // a slot that arrived earlier, forwarded from this PE's arena (src: its token)
    uint8_t* p = nullptr;
    if (auto e = rt::region(src_offset, nbytes, "nvshmem put (arena source)", &p); !e.empty()) return status(e);
    data = p;
  } else if (static_cast<int64_t>(src.size_bytes()) != nbytes) {
    return ffi::Error::InvalidArgument("nvshmem put: source has " + std::to_string(src.size_bytes()) +
                                       " bytes, the arena region " + std::to_string(nbytes));
  }
  return status(rt::put_signal(stream, data, offset, nbytes, static_cast<int>(peers[rt::my_pe()]), signal_offset,
                               signal));
}

ffi::Error wait(cudaStream_t stream, ffi::AnyBuffer /*token*/, ffi::AnyBuffer /*src, kept alive*/,
                ffi::Result<ffi::AnyBuffer> /*token*/, int64_t signal, int64_t signal_offset) {
  return status(rt::wait(stream, signal_offset, signal));
}

ffi::Error read(cudaStream_t stream, ffi::AnyBuffer /*token*/, ffi::Result<ffi::AnyBuffer> dst, int64_t offset) {
  return status(rt::copy_out(stream, dst->untyped_data(), offset, dst->size_bytes()));
}

// flash_attention with some chunks in the arena: operands as the op's custom call's, where
// chunk operand i with arena[i] >= 0 is a token and its rows are the region at that offset,
// [batch, rows[i], heads, head_dim] of `dtype` (0 float16, 1 bfloat16).
ffi::Error arena_flash_attention(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                                 int64_t num_q, int64_t num_kv, int64_t state_mask, float scale, bool finalize,
                                 int64_t kernel, ffi::Span<const int64_t> arena, ffi::Span<const int64_t> rows,
                                 int64_t batch, int64_t heads, int64_t head_dim, int64_t dtype) {
  using jax_cluster::FlashOperand;
  if (static_cast<int64_t>(arena.size()) != num_q + 2 * num_kv || rows.size() != arena.size())
    return ffi::Error::InvalidArgument("nvshmem flash_attention: arena and rows need one entry per q, k and v chunk");
  if (dtype != 0 && dtype != 1) return ffi::Error::InvalidArgument("nvshmem flash_attention: dtype must be 0 or 1");
  const ffi::DataType type = dtype == 0 ? ffi::DataType::F16 : ffi::DataType::BF16;
  const jax_cluster::FlashAttentionAttrs attrs{num_q, num_kv, state_mask, scale, finalize, kernel};
  auto chunk = [&](int64_t i) -> ffi::ErrorOr<FlashOperand> {
    if (i < 0 || i >= static_cast<int64_t>(arena.size()))
      return ffi::Unexpected(ffi::Error::InvalidArgument("nvshmem flash_attention: chunk index out of range"));
    if (arena[i] < 0) {
      auto b = args.get<ffi::AnyBuffer>(i);
      if (!b) return ffi::Unexpected(b.error());
      return jax_cluster::flash_operand(*b);
    }
    if (batch < 0 || rows[i] < 0 || heads < 0 || head_dim < 0)
      return ffi::Unexpected(ffi::Error::InvalidArgument("nvshmem flash_attention: negative chunk dimension"));
    const int64_t nbytes = batch * rows[i] * heads * head_dim * 2;  // 16-bit elements
    uint8_t* p = nullptr;
    if (auto e = rt::region(arena[i], nbytes, "nvshmem flash_attention", &p); !e.empty())
      return ffi::Unexpected(status(e));
    return FlashOperand{p, type, {batch, rows[i], heads, head_dim}, 4};
  };
  auto p = jax_cluster::decode_flash_attention_chunks(args, rets, attrs, chunk);
  if (!p) return p.error();
  if (!jax_cluster::flash_attention_cuda_supports(*p))
    return ffi::Error::InvalidArgument("nvshmem flash_attention: no CUDA kernel for this head_dim/dtype");
  if (p->kernel == jax_cluster::FlashKernel::kWgmma && !jax_cluster::flash_attention_sm90_serves(*p))
    return ffi::Error::InvalidArgument("nvshmem flash_attention: the wgmma kernel does not serve this call");
  return jax_cluster::ffi_util::from_cuda(jax_cluster::launch_flash_attention(*p, stream), "nvshmem flash_attention");
}

ffi::Error barrier(cudaStream_t stream, ffi::AnyBuffer /*x*/, ffi::Result<ffi::AnyBuffer> /*x aliased*/,
                   int64_t signal, int64_t signal_offset) {
  return status(rt::barrier(stream, signal_offset, signal));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_nvshmem_put, put,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("nbytes")
                                  .Attr<int64_t>("signal")
                                  .Attr<int64_t>("signal_offset")
                                  .Attr<ffi::Span<const int64_t>>("peers")
                                  .Attr<int64_t>("src_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_nvshmem_wait, wait,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("signal")
                                  .Attr<int64_t>("signal_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_nvshmem_read, read,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_nvshmem_flash_attention, arena_flash_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_q")
                                  .Attr<int64_t>("num_kv")
                                  .Attr<int64_t>("state_mask")
                                  .Attr<float>("scale")
                                  .Attr<bool>("finalize")
                                  .Attr<int64_t>("kernel")
                                  .Attr<ffi::Span<const int64_t>>("arena")
                                  .Attr<ffi::Span<const int64_t>>("rows")
                                  .Attr<int64_t>("batch")
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("head_dim")
                                  .Attr<int64_t>("dtype"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cluster_nvshmem_barrier, barrier,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("signal")
                                  .Attr<int64_t>("signal_offset"));
