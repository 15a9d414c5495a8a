#pragma once

#include "ops/flash_attention/params.h"

namespace jax_cluster::cpu {

// Plain loops, fp32: for each query row, the scores over the keys of every kv chunk,
// their softmax-weighted V and log-sum-exp, then the stable merge with the incoming state.
void flash_attention(const FlashAttentionParams& p);

}  // namespace jax_cluster::cpu
