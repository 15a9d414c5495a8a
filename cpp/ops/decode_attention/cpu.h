#pragma once

#include "ops/decode_attention/params.h"

namespace jax_cluster::cpu {

// The CUDA kernels' computation, split for split (the same partials in the workspace and
// the same merge order), in fp32 on the host.
void decode_attention(const DecodeAttentionParams& p);

}  // namespace jax_cluster::cpu
