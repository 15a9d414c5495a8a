#include "ops/linear/cpu.h"
#include "ops/linear/ffi.h"

JAX_CLUSTER_FFI_CPU_HANDLER(linear, jax_cluster::decode_linear, jax_cluster::cpu::linear);
