#include "ops/flash_attention/cpu.h"
#include "ops/flash_attention/ffi.h"

JAX_CLUSTER_FFI_CPU_HANDLER(flash_attention, jax_cluster::decode_flash_attention,
                            jax_cluster::cpu::flash_attention);
