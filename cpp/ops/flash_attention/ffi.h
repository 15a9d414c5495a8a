// The FFI binding of flash_attention (the pattern of ffi/common.h): decodes and validates
// the arguments into one FlashAttentionParams, shared by the CPU and CUDA handlers. The
// Python wrapper checks the same things first with friendlier messages; this is the last
// line of defence against a malformed call.
//
// Operands (variadic): q_0 .. q_{nq-1}, k_0 .. k_{nkv-1}, v_0 .. v_{nkv-1}, then
// (o_in_i, lse_in_i) for each query chunk i whose bit is set in `state_mask`, in order.
// Results: (o_i, lse_i) for each query chunk. Attributes: FlashAttentionAttrs.
#pragma once

#include <cmath>
#include <string>
#include <utility>

#include "ffi/common.h"
#include "ops/flash_attention/params.h"

namespace jax_cluster {

struct FlashAttentionAttrs {
  int64_t num_q, num_kv;
  int64_t state_mask;  // bit i: query chunk i comes with an incoming state
  float scale;
  bool finalize;
  int64_t kernel;  // a FlashKernel: which CUDA kernel (the CPU handler ignores it)
};

}  // namespace jax_cluster

JAX_CLUSTER_FFI_ATTRS(jax_cluster::FlashAttentionAttrs,
                      xla::ffi::StructMember<int64_t>("num_q"),
                      xla::ffi::StructMember<int64_t>("num_kv"),
                      xla::ffi::StructMember<int64_t>("state_mask"),
                      xla::ffi::StructMember<float>("scale"),
                      xla::ffi::StructMember<bool>("finalize"),
                      xla::ffi::StructMember<int64_t>("kernel"));

namespace jax_cluster {

namespace ffi = xla::ffi;

// A q, k or v chunk as decode sees it: its rows, element type and dimensions. The custom
// call's chunks are its operands (flash_operand); the NVSHMEM backend's arena attention
// (cpp/ops/nvshmem_attention/src/ffi.cc) also makes them from its symmetric arena.
struct FlashOperand {
  const void* data;
  ffi::DataType type;
  int64_t dims[4];
  size_t rank;
};

inline FlashOperand flash_operand(const ffi::AnyBuffer& b) {
  FlashOperand o{b.untyped_data(), b.element_type(), {0, 0, 0, 0}, b.dimensions().size()};
  for (size_t i = 0; i < o.rank && i < 4; ++i) o.dims[i] = b.dimensions()[i];
  return o;
}

inline std::string dims_str(const FlashOperand& o) {
  std::string s = "[";
  for (size_t i = 0; i < o.rank && i < 4; ++i) s += (i ? ", " : "") + std::to_string(o.dims[i]);
  return s + (o.rank > 4 ? ", ...]" : "]");
}

// Decodes a call whose operands are laid out as the custom call's (q chunks, k chunks, v
// chunks, then the incoming states) with chunk operand i (i < num_q + 2 num_kv) given by
// `chunk(i)` -> ffi::ErrorOr<FlashOperand>; the states and results are args' and rets'.
template <typename ChunkAt>
ffi::ErrorOr<FlashAttentionParams> decode_flash_attention_chunks(ffi::RemainingArgs args,
                                                                 ffi::RemainingRets rets,
                                                                 FlashAttentionAttrs a,
                                                                 ChunkAt chunk) {
  const int64_t num_q = a.num_q, num_kv = a.num_kv, state_mask = a.state_mask;
  const float scale = a.scale;
  const bool finalize = a.finalize;
  const int64_t kernel = a.kernel;
  auto fail = [](const std::string& m) {
    return ffi::Unexpected(ffi_util::invalid("flash_attention: " + m));
  };
  if (num_q < 1 || num_q > kFlashMaxQChunks) {
    return fail("num_q must be in 1.." + std::to_string(kFlashMaxQChunks));
  }
  if (num_kv < 0 || num_kv > kFlashMaxKVChunks) {
    return fail("num_kv must be in 0.." + std::to_string(kFlashMaxKVChunks));
  }
  if (state_mask < 0 || (num_q < 63 && (state_mask >> num_q) != 0)) {
    return fail("state_mask has bits beyond num_q");
  }
  int64_t num_states = 0;
  for (int64_t i = 0; i < num_q; ++i) num_states += (state_mask >> i) & 1;
  if (args.size() != static_cast<size_t>(num_q + 2 * num_kv + 2 * num_states)) {
    return fail("expected " + std::to_string(num_q + 2 * num_kv + 2 * num_states) +
                " operands (q chunks, k chunks, v chunks, states), got " +
                std::to_string(args.size()));
  }
  if (rets.size() != static_cast<size_t>(2 * num_q)) {
    return fail("expected " + std::to_string(2 * num_q) + " results (o, lse per q chunk)");
  }
  if (!std::isfinite(scale)) return fail("scale must be finite");
  if (kernel < 0 || kernel >= kFlashNumKernels) {
    return fail("kernel must be in 0.." + std::to_string(kFlashNumKernels - 1));
  }

  FlashAttentionParams p{};
  p.scale = scale;
  p.finalize = finalize;
  p.kernel = static_cast<FlashKernel>(kernel);
  p.num_q = static_cast<int>(num_q);
  p.num_kv = static_cast<int>(num_kv);
  ffi::DataType elem = ffi::DataType::INVALID;
  auto check_qkv = [&](const FlashOperand& buf, const std::string& name, int64_t* len) -> ffi::Error {
    const int64_t* d = buf.dims;
    if (buf.rank != 4 || d[0] != p.batch || d[2] != p.heads || d[3] != p.head_dim || buf.type != elem) {
      return ffi_util::invalid("flash_attention: " + name + " must be [B=" +
                               std::to_string(p.batch) + ", L, H=" + std::to_string(p.heads) +
                               ", Dh=" + std::to_string(p.head_dim) +
                               "] with q's dtype, got " + dims_str(buf));
    }
    *len = d[1];
    return ffi::Error::Success();
  };

  // q chunks (q_0 fixes B, H, Dh and the dtype)
  for (int64_t i = 0; i < num_q; ++i) {
    ffi::ErrorOr<FlashOperand> q = chunk(i);
    if (!q) return ffi::Unexpected(q.error());
    if (i == 0) {
      const int64_t* d = q->dims;
      if (q->rank != 4) return fail("q[0] must be [B, L, H, Dh], got " + dims_str(*q));
      auto dt = ffi_util::to_dtype(q->type, "q");
      if (!dt) return ffi::Unexpected(dt.error());
      elem = q->type;
      p.dtype = *dt;
      p.batch = d[0];
      p.heads = d[2];
      p.head_dim = d[3];
      if (p.head_dim < 1) return fail("head_dim must be >= 1");
    }
    auto err = check_qkv(*q, "q[" + std::to_string(i) + "]", &p.q[i].len);
    if (err.failure()) return ffi::Unexpected(std::move(err));
    p.q[i].q = q->data;
  }
  // kv chunks
  for (int64_t j = 0; j < num_kv; ++j) {
    ffi::ErrorOr<FlashOperand> k = chunk(num_q + j);
    ffi::ErrorOr<FlashOperand> v = chunk(num_q + num_kv + j);
    if (!k) return ffi::Unexpected(k.error());
    if (!v) return ffi::Unexpected(v.error());
    int64_t lk = 0, lv = 0;
    auto err = check_qkv(*k, "k[" + std::to_string(j) + "]", &lk);
    if (err.failure()) return ffi::Unexpected(std::move(err));
    err = check_qkv(*v, "v[" + std::to_string(j) + "]", &lv);
    if (err.failure()) return ffi::Unexpected(std::move(err));
    if (lk != lv) return fail("k[" + std::to_string(j) + "] and v[" + std::to_string(j) + "] lengths differ");
    p.kv[j] = {k->data, v->data, lk};
  }
  // states and results
  int64_t next = num_q + 2 * num_kv;
  for (int64_t i = 0; i < num_q; ++i) {
    FlashQChunk& c = p.q[i];
    const std::string tag = "[" + std::to_string(i) + "]";
    if ((state_mask >> i) & 1) {
      auto o_in = args.get<ffi::AnyBuffer>(next++);
      auto lse_in = args.get<ffi::AnyBuffer>(next++);
      if (!o_in) return ffi::Unexpected(o_in.error());
      if (!lse_in) return ffi::Unexpected(lse_in.error());
      auto od = o_in->dimensions(), ld = lse_in->dimensions();
      if (o_in->element_type() != ffi::DataType::F32 || od.size() != 4 || od[0] != p.batch ||
          od[1] != c.len || od[2] != p.heads || od[3] != p.head_dim) {
        return fail("state o" + tag + " must be float32 [B, Lq, H, Dh], got " + ffi_util::dims_str(od));
      }
      if (lse_in->element_type() != ffi::DataType::F32 || ld.size() != 3 || ld[0] != p.batch ||
          ld[1] != p.heads || ld[2] != c.len) {
        return fail("state lse" + tag + " must be float32 [B, H, Lq], got " + ffi_util::dims_str(ld));
      }
      c.o_in = static_cast<const float*>(o_in->untyped_data());
      c.lse_in = static_cast<const float*>(lse_in->untyped_data());
    }
    auto o = rets.get<ffi::AnyBuffer>(2 * i);
    auto lse = rets.get<ffi::AnyBuffer>(2 * i + 1);
    if (!o) return ffi::Unexpected(o.error());
    if (!lse) return ffi::Unexpected(lse.error());
    const ffi::DataType o_type = finalize ? elem : ffi::DataType::F32;
    auto od = (*o)->dimensions(), ld = (*lse)->dimensions();
    if ((*o)->element_type() != o_type || od.size() != 4 || od[0] != p.batch || od[1] != c.len ||
        od[2] != p.heads || od[3] != p.head_dim) {
      return fail("result o" + tag + " must be [B, Lq, H, Dh] in " +
                  (finalize ? "q's dtype" : std::string("float32")));
    }
    if ((*lse)->element_type() != ffi::DataType::F32 || ld.size() != 3 || ld[0] != p.batch ||
        ld[1] != p.heads || ld[2] != c.len) {
      return fail("result lse" + tag + " must be float32 [B, H, Lq]");
    }
    c.o = (*o)->untyped_data();
    c.lse = static_cast<float*>((*lse)->untyped_data());
  }
  return p;
}

// The custom call: every chunk is an operand.
inline ffi::ErrorOr<FlashAttentionParams> decode_flash_attention(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                                                 FlashAttentionAttrs a) {
  return decode_flash_attention_chunks(args, rets, a, [&](int64_t i) -> ffi::ErrorOr<FlashOperand> {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b) return ffi::Unexpected(b.error());
    return flash_operand(*b);
  });
}

}  // namespace jax_cluster
