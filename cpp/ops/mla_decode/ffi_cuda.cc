#include "ffi/cuda_util.h"
#include "ops/mla_decode/ffi.h"
#include "ops/mla_decode/ffi_projections.h"
#include "ops/mla_decode/launch.h"

namespace jax_cluster {
namespace {

ffi::Error run_mla_decode_cuda(const MlaDecodeParams& p, cudaStream_t stream) {
  if (auto e = mla_decode_cuda_check(p); !e.empty()) return ffi_util::invalid("mla_decode: " + e);
  return ffi_util::from_cuda(launch_mla_decode(p, stream), "mla_decode");
}

ffi::Error run_mla_project_cuda(const MlaProjectParams& p, cudaStream_t stream) {
  if (auto e = mla_projections_check(p.dtype, p.batch, p.hidden, p.q_in, p.nope, p.rope, p.rank, p.v_dim, true);
      !e.empty()) {
    return ffi_util::invalid("mla_project: " + e);
  }
  return ffi_util::from_cuda(launch_mla_project(p, stream), "mla_project");
}

ffi::Error run_mla_output_cuda(const MlaOutputParams& p, cudaStream_t stream) {
  if (auto e = mla_projections_check(p.dtype, p.batch, p.hidden, p.hidden, p.nope, 0, p.rank, p.v_dim, true);
      !e.empty()) {
    return ffi_util::invalid("mla_output: " + e);
  }
  return ffi_util::from_cuda(launch_mla_output(p, stream), "mla_output");
}

}  // namespace
}  // namespace jax_cluster

JAX_CLUSTER_FFI_CUDA_HANDLER(mla_decode, jax_cluster::decode_mla_decode, jax_cluster::run_mla_decode_cuda);
JAX_CLUSTER_FFI_CUDA_HANDLER(mla_project, jax_cluster::decode_mla_project, jax_cluster::run_mla_project_cuda);
JAX_CLUSTER_FFI_CUDA_HANDLER(mla_output, jax_cluster::decode_mla_output, jax_cluster::run_mla_output_cuda);
