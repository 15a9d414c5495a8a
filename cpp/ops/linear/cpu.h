#pragma once

#include "ops/linear/params.h"

namespace jax_cluster::cpu {

// Plain loops, fp32 accumulation in index order: y = round(a @ w + residual) to the
// output dtype (fp32: not rounded). The tiling fields of p are validated, not used.
void linear(const LinearParams& p);

}  // namespace jax_cluster::cpu
