#pragma once

#include "ops/decoder_layer/params.h"

namespace jax_cluster::cpu {

// The whole layer on the host in fp32 (sums in index order), the reference's rounding points.
void decoder_layer(const DecoderLayerParams& p);

}  // namespace jax_cluster::cpu
