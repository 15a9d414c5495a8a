// The linear projection's launcher: one down-type GEMM of swiglu's tma engine, whose
// kernels are compiled with swiglu's (ops/swiglu/launch_tma.cu).
#include <cstdint>

#include "ops/linear/launch.h"
#include "ops/swiglu/tma_gemm.h"

namespace jax_cluster {

cudaError_t launch_linear(const LinearParams& p, cudaStream_t stream) {
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  TmaGemm g;
  g.dtype = p.dtype;
  g.m = p.m;
  g.k = p.k;
  g.n = p.n;
  g.row_tiles = p.row_tiles;
  g.max_blocks = p.max_blocks;
  g.a = p.a;
  g.w = p.w;
  g.residual = p.has_residual ? p.residual : nullptr;
  g.out = p.out;
  g.out_f32 = p.out_f32;
  g.counters = reinterpret_cast<unsigned int*>(ws);
  g.slots = reinterpret_cast<float*>(ws + linear_slots_offset(p.m, p.n));
  g.zero_counters = linear_tiles(p.m, p.n);
  g.wait_prior = p.pdl;
  g.trigger = true;  // the next kernel may take SMs this grid leaves free, and wait there
  return launch_tma_gemm(g, stream);
}

}  // namespace jax_cluster
