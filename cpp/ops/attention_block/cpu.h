#pragma once

#include "ops/attention_block/params.h"

namespace jax_cluster::cpu {

// Plain loops, fp32 throughout; the new k, v are rounded to the cache dtype
// before attention reads them, as the kernel does.
void attention_block(const AttentionBlockParams& p);

}  // namespace jax_cluster::cpu
