#pragma once

#include "ops/mla_decode/params.h"

namespace jax_cluster::cpu {

// The latent attention in fp32 on the host (one pass per row and head; the workspace is
// not used): the same cache write and the same NaN rows as the CUDA kernels.
void mla_decode(const MlaDecodeParams& p);

}  // namespace jax_cluster::cpu
