#pragma once

#include "ops/swiglu/params.h"

namespace jax_cluster::cpu {

// Plain loops, fp32 accumulation in index order: g = x @ w_gate, u = x @ w_up,
// A2 = round(silu(g) * u) to the activation dtype, y = round(A2 @ w_down + residual).
// The variant / tiling fields of p are validated but do not change the result's math.
void swiglu(const SwigluParams& p);

}  // namespace jax_cluster::cpu
