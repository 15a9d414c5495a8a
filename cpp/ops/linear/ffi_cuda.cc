#include "ffi/cuda_util.h"
#include "ops/linear/ffi.h"
#include "ops/linear/launch.h"

JAX_CLUSTER_FFI_CUDA_LAUNCH_HANDLER(linear, jax_cluster::decode_linear, jax_cluster::launch_linear);
