// Decodes and validates the FFI arguments of cluster_reduce / cluster_gather
// into one ClusterCollectiveParams, shared by the CPU and CUDA handlers.
#pragma once

#include "ffi/common.h"
#include "ops/cluster_collectives/params.h"

namespace jax_cluster {

namespace ffi = xla::ffi;

inline ffi::ErrorOr<ClusterCollectiveParams> decode_cluster_collective(
    bool gather, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> workspace, int64_t op, int64_t impl, int64_t repeat,
    bool all_blocks) {
  using ffi_util::invalid;
  const char* name = gather ? "cluster_gather" : "cluster_reduce";
  auto dims = x.dimensions();
  if (dims.size() != 3) {
    return ffi::Unexpected(invalid(std::string(name) + ": x must be [groups, cluster_size, size], got " +
                                   ffi_util::dims_str(dims)));
  }
  auto dtype = ffi_util::to_dtype(x.element_type(), "x");
  if (!dtype) return ffi::Unexpected(dtype.error());
  if (out->element_type() != x.element_type()) {
    return ffi::Unexpected(invalid(std::string(name) + ": out dtype differs from x"));
  }
  ClusterCollectiveParams p;
  p.dtype = *dtype;
  p.groups = dims[0];
  p.cluster_size = static_cast<int>(dims[1]);
  p.size = dims[2];
  p.op = static_cast<ReduceOp>(op);
  p.impl = static_cast<CollectiveImpl>(impl);
  p.repeat = repeat;
  p.all_blocks = all_blocks;
  p.x = x.untyped_data();
  p.out = out->untyped_data();
  p.workspace = workspace->untyped_data();
  if (!is_valid_cluster_size(p.cluster_size)) {
    return ffi::Unexpected(invalid(std::string(name) + ": cluster size (x.shape[1]) must be 1..8 or 16, got " +
                                   std::to_string(p.cluster_size)));
  }
  if (op != 0 && op != 1) return ffi::Unexpected(invalid("cluster_reduce: op must be 0 (sum) or 1 (max)"));
  if (impl != 0 && impl != 1) return ffi::Unexpected(invalid(std::string(name) + ": impl must be 0 (dsmem) or 1 (global)"));
  if (repeat < 1) return ffi::Unexpected(invalid(std::string(name) + ": repeat must be >= 1"));
  const int64_t per_copy = gather ? p.cluster_size * p.size : p.size;
  const int64_t copies = all_blocks ? p.cluster_size : 1;
  if (static_cast<int64_t>(out->element_count()) != p.groups * copies * per_copy) {
    return ffi::Unexpected(invalid(std::string(name) + ": out has the wrong number of elements"));
  }
  if (static_cast<int64_t>(workspace->size_bytes()) < cluster_collective_workspace_bytes(p)) {
    return ffi::Unexpected(invalid(std::string(name) + ": workspace too small"));
  }
  const int64_t smem = gather ? cluster_gather_smem_bytes(p.dtype, p.cluster_size, p.size, p.impl)
                              : cluster_reduce_smem_bytes(p.dtype, p.cluster_size, p.size, p.impl);
  if (smem > kMaxSharedBytesPerBlock - 1024) {
    return ffi::Unexpected(invalid(std::string(name) + ": per-block slice needs " + std::to_string(smem) +
                                   " bytes of shared memory, above the limit"));
  }
  return p;
}

}  // namespace jax_cluster
