#include "ops/swiglu/cpu.h"
#include "ops/swiglu/ffi.h"

JAX_CLUSTER_FFI_CPU_HANDLER(swiglu, jax_cluster::decode_swiglu, jax_cluster::cpu::swiglu);
