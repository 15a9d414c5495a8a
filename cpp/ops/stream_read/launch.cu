// stream_read (see stream_read.h): one block per chunk, 16-byte read-only loads that
// skip L1, 8 in flight per thread (the access pattern of weight streaming).
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/launch.cuh"
#include "ops/stream_read/launch.h"

namespace jax_cluster {
namespace {

constexpr int kThreads = 512;
constexpr int kInFlight = 8;

__global__ void __launch_bounds__(kThreads) stream_read_kernel(const StreamReadParams p) {
  const int64_t vecs = p.bytes / 16 / p.chunks;
  const uint4* src = static_cast<const uint4*>(p.x) + blockIdx.x * vecs;
  uint32_t acc = 0;
  int64_t v = threadIdx.x;
  for (; v + (kInFlight - 1) * kThreads < vecs; v += kInFlight * kThreads) {
    uint4 r[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) r[u] = ptx::ldg_stream(src + v + u * kThreads);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  for (; v < vecs; v += kThreads) {
    const uint4 r = ptx::ldg_stream(src + v);
    acc ^= r.x ^ r.y ^ r.z ^ r.w;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, off);
  __shared__ uint32_t warps[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t all = 0;
    for (int w = 0; w < kThreads / 32; ++w) all ^= warps[w];
    p.out[blockIdx.x] = all;
  }
}

}  // namespace

cudaError_t launch_stream_read(const StreamReadParams& p, cudaStream_t stream) {
  if (p.chunks < 1 || p.chunks > 2147483647 || p.bytes % (16 * p.chunks) != 0) {
    return cudaErrorInvalidValue;
  }
  stream_read_kernel<<<static_cast<unsigned>(p.chunks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_cluster
