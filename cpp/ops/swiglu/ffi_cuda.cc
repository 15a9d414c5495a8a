#include "ffi/cuda_util.h"
#include "ops/swiglu/ffi.h"
#include "ops/swiglu/launch.h"

JAX_CLUSTER_FFI_CUDA_LAUNCH_HANDLER(swiglu, jax_cluster::decode_swiglu, jax_cluster::launch_swiglu);
