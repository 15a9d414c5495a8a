// The FFI binding of mla_decode's latent attention (the pattern of ffi/common.h): one decode
// into MlaDecodeParams, shared by the CPU and CUDA handlers. The Python wrapper
// (jax_cluster/ops/mla_decode.py) checks the same things first with friendlier messages.
//
// Operands: q [B, H, E] f32, new_latent [B, E] f32, cache ([B, S_max, E] or a page pool
// [P, page, E]), block_table (int32 [B, max_blocks]; [0] when contiguous), lengths int32 [B].
// Results: out [B, H, r] (the cache's dtype), cache (aliased to the operand), workspace f32.
#pragma once

#include <string>

#include "ffi/common.h"
#include "ops/mla_decode/params.h"

namespace jax_cluster {

struct MlaDecodeAttrs {
  int64_t splits;
  int64_t rank;
  bool paged;
  float scale;
};

}  // namespace jax_cluster

JAX_CLUSTER_FFI_ATTRS(jax_cluster::MlaDecodeAttrs,
                      xla::ffi::StructMember<int64_t>("splits"),
                      xla::ffi::StructMember<int64_t>("rank"),
                      xla::ffi::StructMember<bool>("paged"),
                      xla::ffi::StructMember<float>("scale"));

namespace jax_cluster {

namespace ffi = xla::ffi;

inline ffi::ErrorOr<MlaDecodeParams> decode_mla_decode(
    ffi::AnyBuffer q, ffi::AnyBuffer new_latent, ffi::AnyBuffer cache, ffi::AnyBuffer block_table,
    ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> cache_out,
    ffi::Result<ffi::AnyBuffer> workspace, MlaDecodeAttrs attrs) {
  auto fail = [](const std::string& m) { return ffi::Unexpected(ffi_util::invalid("mla_decode: " + m)); };
  auto qd = q.dimensions(), cd = cache.dimensions();
  if (q.element_type() != ffi::DataType::F32 || qd.size() != 3) return fail("q must be float32 [B, H, E]");
  if (cd.size() != 3) return fail("the cache must be [B, S_max, E] or [pages, page_size, E]");
  MlaDecodeParams p{};
  auto dtype = ffi_util::to_dtype(cache.element_type(), "cache");
  if (!dtype) return ffi::Unexpected(dtype.error());
  p.dtype = *dtype;
  p.batch = qd[0];
  p.num_heads = qd[1];
  p.rank = attrs.rank;
  p.rope_dim = qd[2] - attrs.rank;
  p.splits = attrs.splits;
  p.paged = attrs.paged;
  p.scale = attrs.scale;
  const int64_t E = qd[2];
  if (cd[2] != E) return fail("the cache's last dimension must be q's E = r + dr, got " + ffi_util::dims_str(cd));
  auto nd = new_latent.dimensions();
  if (new_latent.element_type() != ffi::DataType::F32 || nd.size() != 2 || nd[0] != p.batch || nd[1] != E) {
    return fail("new_latent must be float32 [B, E]");
  }
  auto bd = block_table.dimensions();
  if (p.paged) {
    if (block_table.element_type() != ffi::DataType::S32 || bd.size() != 2 || bd[0] != p.batch) {
      return fail("block_table must be int32 [B, max_blocks]");
    }
    p.num_pages = cd[0];
    p.page_size = cd[1];
    p.max_blocks = bd[1];
    p.capacity = p.max_blocks * p.page_size;
  } else {
    if (cd[0] != p.batch) return fail("a contiguous cache must be [B, S_max, E]");
    p.capacity = cd[1];
  }
  if (lengths.element_type() != ffi::DataType::S32 || lengths.dimensions().size() != 1 ||
      lengths.dimensions()[0] != p.batch) {
    return fail("lengths must be int32 [B]");
  }
  if (auto e = mla_decode_check(p); !e.empty()) return fail(e);
  auto od = out->dimensions();
  if (out->element_type() != cache.element_type() || od.size() != 3 || od[0] != p.batch ||
      od[1] != p.num_heads || od[2] != p.rank) {
    return fail("out must be [B, H, r] of the cache's dtype");
  }
  if (cache_out->untyped_data() != cache.untyped_data()) return fail("the cache must be aliased to its result");
  if (workspace->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(workspace->element_count()) < mla_decode_workspace_floats(p)) {
    return fail("workspace must be float32 with at least B * H * splits * (r + 2) elements");
  }
  p.q = static_cast<const float*>(q.untyped_data());
  p.new_latent = static_cast<const float*>(new_latent.untyped_data());
  p.cache = cache.untyped_data();
  p.block_table = p.paged ? static_cast<const int32_t*>(block_table.untyped_data()) : nullptr;
  p.lengths = static_cast<const int32_t*>(lengths.untyped_data());
  p.out = out->untyped_data();
  p.partial = static_cast<float*>(workspace->untyped_data());
  return p;
}

}  // namespace jax_cluster
