// The FFI binding of cluster_reduce / cluster_gather (the pattern of ffi/common.h): one
// decode, shared by both targets and both platforms, into one ClusterCollectiveParams.
//
// Operands: x [groups, N, size]. Results: out, workspace (uint8, the off-chip exchange
// area; empty for the DSMEM exchange). Attributes: ClusterCollectiveAttrs.
#pragma once

#include <string>

#include "ffi/common.h"
#include "ops/cluster_collectives/params.h"

namespace jax_cluster {

struct ClusterCollectiveAttrs {
  int64_t op;        // ReduceOp (reduce only; 0 for gather)
  int64_t exchange;  // ClusterExchange
  int64_t repeat;    // collective calls per kernel (>= 1)
  bool all_blocks;   // write every block's copy of the result
};

}  // namespace jax_cluster

JAX_CLUSTER_FFI_ATTRS(jax_cluster::ClusterCollectiveAttrs,
                      xla::ffi::StructMember<int64_t>("op"),
                      xla::ffi::StructMember<int64_t>("exchange"),
                      xla::ffi::StructMember<int64_t>("repeat"),
                      xla::ffi::StructMember<bool>("all_blocks"));

namespace jax_cluster {

namespace ffi = xla::ffi;

template <bool kGather>
ffi::ErrorOr<ClusterCollectiveParams> decode_cluster_collective(
    ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
    ClusterCollectiveAttrs a) {
  const std::string name = kGather ? "cluster_gather" : "cluster_reduce";
  auto fail = [&](const std::string& m) { return ffi::Unexpected(ffi_util::invalid(name + ": " + m)); };
  auto dims = x.dimensions();
  if (dims.size() != 3) return fail("x must be [groups, cluster_size, size], got " + ffi_util::dims_str(dims));
  auto dtype = ffi_util::to_dtype(x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  if (out->element_type() != x.element_type()) return fail("out dtype differs from x");
  if (a.op != 0 && a.op != 1) return fail("op must be 0 (sum) or 1 (max)");
  if (a.exchange != 0 && a.exchange != 1) return fail("exchange must be 0 (dsmem) or 1 (global)");
  if (a.repeat < 1) return fail("repeat must be >= 1");
  ClusterCollectiveParams p;
  p.dtype = *dtype;
  p.groups = dims[0];
  p.cluster_size = static_cast<int>(dims[1]);
  p.size = dims[2];
  p.op = static_cast<ReduceOp>(a.op);
  p.exchange = static_cast<ClusterExchange>(a.exchange);
  p.repeat = static_cast<int>(a.repeat);
  p.all_blocks = a.all_blocks;
  p.x = x.untyped_data();
  p.out = out->untyped_data();
  p.workspace = workspace->untyped_data();
  if (!is_valid_cluster_size(p.cluster_size)) {
    return fail("cluster size (x.shape[1]) must be 1..8 or 16, got " + std::to_string(p.cluster_size));
  }
  const int64_t per_copy = kGather ? p.cluster_size * p.size : p.size;
  const int64_t copies = p.all_blocks ? p.cluster_size : 1;
  if (static_cast<int64_t>(out->element_count()) != p.groups * copies * per_copy) {
    return fail("out has the wrong number of elements");
  }
  if (static_cast<int64_t>(workspace->size_bytes()) < cluster_collective_workspace_bytes(
                                                     p.dtype, p.groups, p.cluster_size, p.size, p.exchange)) {
    return fail("workspace too small");
  }
  const int64_t smem = cluster_collective_smem_bytes(kGather, p.dtype, p.cluster_size, p.size, p.exchange);
  if (smem > kMaxDynamicSharedBytes) {
    return fail("per-block slice needs " + std::to_string(smem) +
                " bytes of shared memory, above the limit of " + std::to_string(kMaxDynamicSharedBytes));
  }
  return p;
}

}  // namespace jax_cluster
