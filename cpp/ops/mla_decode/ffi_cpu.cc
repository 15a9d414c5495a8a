#include "ops/mla_decode/cpu.h"
#include "ops/mla_decode/ffi.h"

JAX_CLUSTER_FFI_CPU_HANDLER(mla_decode, jax_cluster::decode_mla_decode, jax_cluster::cpu::mla_decode);

#include "ops/mla_decode/ffi_projections.h"

JAX_CLUSTER_FFI_CPU_HANDLER(mla_project, jax_cluster::decode_mla_project, jax_cluster::cpu::mla_project);
JAX_CLUSTER_FFI_CPU_HANDLER(mla_output, jax_cluster::decode_mla_output, jax_cluster::cpu::mla_output);
