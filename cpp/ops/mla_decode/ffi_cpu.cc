#include "ops/mla_decode/cpu.h"
#include "ops/mla_decode/ffi.h"

JAX_CLUSTER_FFI_CPU_HANDLER(mla_decode, jax_cluster::decode_mla_decode, jax_cluster::cpu::mla_decode);
