// Merging partial softmax states: the one merge the attention kernels share (the blocks of
// a cluster, the token splits of split-K decoding).
#pragma once

#include <cmath>

namespace jax_cluster {

// One normalised output entry o / l of `n` partial attention states merged in index order:
// state r has running max m_of(r) (exp2 domain; -inf = it saw no token), sum l_of(r) and
// output entry o_of(r), both scaled to its own max. Each state is rescaled to the common
// max; a state without tokens is skipped before its l and o are read. A fixed order of
// fused multiply-adds: every caller that merges the same states gets the same bits.
template <typename Index, typename MOf, typename LOf, typename OOf>
__device__ __forceinline__ float merge_partial_states(Index n, MOf m_of, LOf l_of, OOf o_of) {
  float m = -INFINITY;
  for (Index r = 0; r < n; ++r) m = fmaxf(m, m_of(r));
  float o = 0.f, l = 0.f;
  for (Index r = 0; r < n; ++r) {
    const float mr = m_of(r);
    if (mr == -INFINITY) continue;  // a part without tokens
    const float w = exp2f(mr - m);
    o = fmaf(o_of(r), w, o);
    l = fmaf(l_of(r), w, l);
  }
  return o / l;
}

}  // namespace jax_cluster
