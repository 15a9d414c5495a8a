#include "ops/cluster_collectives/cpu.h"

#include <algorithm>
#include <vector>

#include "cpu/numerics.h"

namespace jax_cluster::cpu {

void cluster_reduce(const ClusterCollectiveParams& p) {
  const int n = p.cluster_size;
  const int64_t size = p.size;
  std::vector<float> cur(static_cast<size_t>(n) * size), next(cur.size());
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t i = 0; i < n * size; ++i) cur[i] = load(p.dtype, p.x, g * n * size + i);
    for (int c = 0; c < p.repeat; ++c) {
      // The off-chip baseline and the direct schedule of sizes that are not powers of two:
      // rank order in fp32, one rounding.
      if (p.exchange == ClusterExchange::kGlobal || (n & (n - 1)) != 0) {
        for (int64_t i = 0; i < size; ++i) {
          float acc = cur[i];
          for (int b = 1; b < n; ++b) {
            acc = p.op == ReduceOp::kSum ? acc + cur[b * size + i] : std::max(acc, cur[b * size + i]);
          }
          for (int b = 0; b < n; ++b) next[b * size + i] = round_to(p.dtype, acc);
        }
        std::swap(cur, next);
        continue;
      }
      for (int stride = 1; stride < n; stride *= 2) {
        for (int b = 0; b < n; ++b) {
          const float* mine = &cur[b * size];
          const float* peer = &cur[(b ^ stride) * size];
          for (int64_t i = 0; i < size; ++i) {
            const float v = p.op == ReduceOp::kSum ? mine[i] + peer[i] : std::max(mine[i], peer[i]);
            next[b * size + i] = round_to(p.dtype, v);
          }
        }
        std::swap(cur, next);
      }
    }
    if (p.all_blocks) {
      for (int64_t i = 0; i < n * size; ++i) store(p.dtype, p.out, g * n * size + i, cur[i]);
    } else {
      for (int64_t i = 0; i < size; ++i) store(p.dtype, p.out, g * size + i, cur[i]);
    }
  }
}

void cluster_gather(const ClusterCollectiveParams& p) {
  const int n = p.cluster_size;
  const int64_t row = n * p.size;
  // The kernels gather x + c in call c: the last call's data remains.
  const float last = static_cast<float>(p.repeat - 1);
  for (int64_t g = 0; g < p.groups; ++g) {
    const int copies = p.all_blocks ? n : 1;
    for (int copy = 0; copy < copies; ++copy) {
      const int64_t dst = (g * copies + copy) * row;
      for (int64_t i = 0; i < row; ++i) {
        const float x = load(p.dtype, p.x, g * row + i);
        store(p.dtype, p.out, dst + i, p.repeat > 1 ? round_to(p.dtype, x + last) : x);
      }
    }
  }
}

}  // namespace jax_cluster::cpu
