#pragma once

#include "ops/mla_decode/params.h"
#include "ops/mla_decode/projections.h"

namespace jax_cluster::cpu {

// The latent attention in fp32 on the host (one pass per row and head; the workspace is
// not used): the same cache write and the same NaN rows as the CUDA kernels.
void mla_decode(const MlaDecodeParams& p);

// The projection kernels' math on the host, rounded where they round (the workspace is not
// used): any size, float32 too.
void mla_project(const MlaProjectParams& p);
void mla_output(const MlaOutputParams& p);

}  // namespace jax_cluster::cpu
