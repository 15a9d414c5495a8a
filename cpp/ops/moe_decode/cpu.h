#pragma once

#include "ops/moe_decode/params.h"
#include "ops/moe_decode/route.h"

namespace jax_cluster::cpu {

// Plain loops, fp32 math in index order (the kernels' rounding points): per (row, slot)
// pair with a valid id e, g = x @ w_gate[e], u = x @ w_up[e], h = round(silu(g) * u) to the
// dtype, y_e = h @ w_down[e] (fp32); y[n] = round(sum over s in order of weights * y_e
// (+ residual)). A row with an id outside [0, E) is all NaN. Launch fields: validated only.
void moe_decode(const MoeDecodeParams& p);

// route.h's router: logits summed in K order, softmax, group-limited greedy (groups ranked
// by their best score, the lower group first on ties), top_k (the lower expert first on
// ties), the weights normalised or scaled. A NaN score is never chosen (its slot's id -1).
void moe_route(const MoeRouteParams& p);

}  // namespace jax_cluster::cpu
