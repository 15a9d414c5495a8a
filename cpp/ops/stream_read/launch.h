#pragma once

#include <cuda_runtime.h>

#include "ops/stream_read/params.h"

namespace jax_cluster {

cudaError_t launch_stream_read(const StreamReadParams& p, cudaStream_t stream);

}  // namespace jax_cluster
