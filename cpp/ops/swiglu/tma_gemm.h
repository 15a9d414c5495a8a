// The tma variant's down GEMM as a building block (launch_tma.cu): y = a @ w (+ residual)
// on one persistent stream-K kernel of 256-column work tiles fed by the bulk copy engine,
// or clusters summing each tile over DSMEM. swiglu's down stage and the linear projection
// (cpp/ops/linear) run on it; its kernels are compiled once, in launch_tma.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_cluster/types.h"

namespace jax_cluster {

struct TmaGemm {
  DType dtype;            // a, w, residual (16-bit)
  int64_t m, k, n;        // a [m, k], w [k, n], y [m, n]; k and n multiples of 64
  int row_tiles;          // 16-row mma tiles per block: 1, 2 or 4
  int64_t max_blocks;     // at most this many blocks
  const void* a;
  const void* w;
  const void* residual;   // [m, n] or null
  void* out;              // y in dtype, or in fp32 with out_f32
  bool out_f32;
  unsigned int* counters;  // one per work tile
  float* slots;            // fp32 partials [segments][min(m, 16 row_tiles)][256]
  int64_t zero_counters;   // counters the launch zeroes first (0: they are zero already)
  bool wait_prior;         // PDL: a, counters and slots may come from the previous kernel
  bool trigger;            // PDL: let the next kernel of the stream launch now
};

// One launch (plus the counters' zero kernel); every CUDA return code is checked.
cudaError_t launch_tma_gemm(const TmaGemm& g, cudaStream_t stream);

}  // namespace jax_cluster
