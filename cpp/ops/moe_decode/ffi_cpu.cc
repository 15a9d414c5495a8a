#include "ops/moe_decode/cpu.h"
#include "ops/moe_decode/ffi.h"

JAX_CLUSTER_FFI_CPU_HANDLER(moe_decode, jax_cluster::decode_moe_decode, jax_cluster::cpu::moe_decode);
JAX_CLUSTER_FFI_CPU_HANDLER(moe_route, jax_cluster::decode_moe_route, jax_cluster::cpu::moe_route);
