#pragma once

#include <cuda_runtime.h>

#include "ops/decoder_layer/params.h"

namespace jax_cluster {

// The one-launch layer kernel on the stream (the workspace's counters zeroed first, one
// cooperative launch). p must pass decoder_layer_check and decoder_layer_cuda_check;
// workspace: decoder_layer_workspace_floats(p) floats.
cudaError_t launch_decoder_layer(const DecoderLayerParams& p, float* workspace, cudaStream_t stream);

}  // namespace jax_cluster
