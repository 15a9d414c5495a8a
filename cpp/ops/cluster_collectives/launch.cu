// Kernels exposing the cluster collectives as ops (tests, the collectives' benchmark).
// One cluster per group; `repeat` collective calls per kernel so a benchmark can separate
// the collective's cost from the launch and the HBM traffic of loading x.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "jax_cluster/cluster_collectives.cuh"
#include "jax_cluster/dispatch.cuh"
#include "ops/cluster_collectives/launch.h"
#include "jax_cluster/launch.cuh"

namespace jax_cluster {
namespace {

constexpr int kThreads = 256;

struct SliceLayout {
  int64_t size;  // elements
  int vecs;      // 16-byte vectors (padded)
  bool aligned;  // global slices start 16-byte aligned and hold whole vectors
};

// Global slice -> shared vectors, zero padding the last vector.
template <typename T>
__device__ void load_slice(uint4* dst, const T* src, const SliceLayout& s) {
  if (s.aligned) {
    const uint4* src4 = reinterpret_cast<const uint4*>(src);
    for (int v = threadIdx.x; v < s.vecs; v += blockDim.x) dst[v] = src4[v];
    return;
  }
  T* d = reinterpret_cast<T*>(dst);
  const int64_t padded = static_cast<int64_t>(s.vecs) * Vec16<T>::kLanes;
  for (int64_t i = threadIdx.x; i < padded; i += blockDim.x) {
    d[i] = i < s.size ? src[i] : from_float<T>(0.f);
  }
}

// Elements [lo, hi) of a shared slice -> global.
template <typename T>
__device__ void store_slice(T* dst, const uint4* src, const SliceLayout& s, int64_t lo,
                            int64_t hi) {
  if (s.aligned && lo == 0 && hi == s.size) {
    uint4* dst4 = reinterpret_cast<uint4*>(dst);
    for (int v = threadIdx.x; v < s.vecs; v += blockDim.x) dst4[v] = src[v];
    return;
  }
  const T* e = reinterpret_cast<const T*>(src);
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = e[i];
}

template <typename T>
__device__ uint4 add_scalar(const uint4& v, float c) {
  constexpr int L = Vec16<T>::kLanes;
  float f[L];
  unpack<T>(v, f);
#pragma unroll
  for (int i = 0; i < L; ++i) f[i] += c;
  return pack<T>(f);
}

template <typename T>
__device__ void store_reduce_result(const ClusterCollectiveParams& p, const SliceLayout& s,
                                    const uint4* data, int64_t g, uint32_t rank) {
  T* out = static_cast<T*>(p.out);
  if (p.all_blocks) {
    store_slice<T>(out + (g * p.cluster_size + rank) * s.size, data, s, 0, s.size);
  } else {  // every block holds the result: each writes its share
    const int64_t chunk = (s.size + p.cluster_size - 1) / p.cluster_size;
    const int64_t lo = min(s.size, chunk * rank), hi = min(s.size, lo + chunk);
    SliceLayout unaligned = s;
    unaligned.aligned = false;
    store_slice<T>(out + g * s.size, data, unaligned, lo, hi);
  }
}

template <typename T, ReduceOp Op>
__global__ void __launch_bounds__(kThreads)
    reduce_dsmem_kernel(const ClusterCollectiveParams p, const SliceLayout s) {
  extern __shared__ __align__(16) uint4 smem[];
  __shared__ ClusterCollectiveBarriers bars;
  const int64_t g = blockIdx.x / p.cluster_size;
  const uint32_t rank = ptx::cluster_rank();
  uint4* data = smem;
  ClusterReduce<T, Op> reduce(&bars, smem + s.vecs, s.vecs);
  reduce.init();
  load_slice<T>(data, static_cast<const T*>(p.x) + (g * p.cluster_size + rank) * s.size, s);
  ptx::cluster_sync();
  for (int c = 0; c < p.repeat; ++c) reduce(data);
  store_reduce_result<T>(p, s, data, g, rank);
  reduce.finish();
}

// Off-chip baseline: each block publishes its slice in global memory, one
// cluster barrier, then every block reads all N slices and reduces them in
// rank order in fp32 (one rounding per call). Double-buffered by call parity: call c+2 rewrites slot c&1 only
// after call c+1's barrier, which no block passes before finishing call c.
template <typename T, ReduceOp Op>
__global__ void __launch_bounds__(kThreads)
    reduce_global_kernel(const ClusterCollectiveParams p, const SliceLayout s) {
  extern __shared__ __align__(16) uint4 smem[];
  const int64_t g = blockIdx.x / p.cluster_size;
  const uint32_t rank = ptx::cluster_rank();
  const int n = p.cluster_size;
  uint4* data = smem;
  uint4* ws = static_cast<uint4*>(p.workspace);
  load_slice<T>(data, static_cast<const T*>(p.x) + (g * n + rank) * s.size, s);
  __syncthreads();
  for (int c = 0; c < p.repeat; ++c) {
    uint4* slots = ws + ((c & 1) * p.groups + g) * n * static_cast<int64_t>(s.vecs);
    for (int v = threadIdx.x; v < s.vecs; v += blockDim.x) slots[rank * s.vecs + v] = data[v];
    ptx::cluster_sync();
    for (int v = threadIdx.x; v < s.vecs; v += blockDim.x) {
      constexpr int L = Vec16<T>::kLanes;
      float acc[L], lane[L];
      unpack<T>(__ldcg(&slots[v]), acc);
      for (int j = 1; j < n; ++j) {  // fp32 accumulation in rank order, one rounding
        unpack<T>(__ldcg(&slots[j * s.vecs + v]), lane);
#pragma unroll
        for (int i = 0; i < L; ++i) acc[i] = reduce_op<Op>(acc[i], lane[i]);
      }
      data[v] = pack<T>(acc);
    }
  }
  __syncthreads();
  store_reduce_result<T>(p, s, data, g, rank);
}

template <typename T>
__device__ void store_gather_result(const ClusterCollectiveParams& p, const SliceLayout& s,
                                    const uint4* gathered, int64_t g, uint32_t rank) {
  T* out = static_cast<T*>(p.out);
  const int n = p.cluster_size;
  if (p.all_blocks) {
    T* mine = out + (g * n + rank) * n * s.size;
    for (int j = 0; j < n; ++j) {
      store_slice<T>(mine + j * s.size, gathered + j * s.vecs, s, 0, s.size);
    }
  } else {  // block j writes segment j
    store_slice<T>(out + (g * n + rank) * s.size, gathered + rank * s.vecs, s, 0, s.size);
  }
}

// Call c gathers x + c: a stale segment from an earlier call would show.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    gather_dsmem_kernel(const ClusterCollectiveParams p, const SliceLayout s) {
  extern __shared__ __align__(16) uint4 smem[];
  __shared__ ClusterCollectiveBarriers bars;
  const int64_t g = blockIdx.x / p.cluster_size;
  const uint32_t rank = ptx::cluster_rank();
  uint4* stage = smem + static_cast<int64_t>(p.cluster_size) * s.vecs;
  ClusterGather<T> gather(&bars, smem, s.vecs);
  gather.init();
  load_slice<T>(stage, static_cast<const T*>(p.x) + (g * p.cluster_size + rank) * s.size, s);
  ptx::cluster_sync();
  uint4* mine = gather.segment(rank);
  for (int c = 0; c < p.repeat; ++c) {
    for (int v = threadIdx.x; v < s.vecs; v += blockDim.x) {
      mine[v] = c == 0 ? stage[v] : add_scalar<T>(stage[v], static_cast<float>(c));
    }
    gather();
  }
  __syncthreads();
  store_gather_result<T>(p, s, smem, g, rank);
  gather.finish();
}

// Off-chip baseline: publish, one cluster barrier, read all N slices.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    gather_global_kernel(const ClusterCollectiveParams p, const SliceLayout s) {
  extern __shared__ __align__(16) uint4 smem[];
  const int64_t g = blockIdx.x / p.cluster_size;
  const uint32_t rank = ptx::cluster_rank();
  const int n = p.cluster_size;
  uint4* gathered = smem;
  uint4* stage = smem + static_cast<int64_t>(n) * s.vecs;
  uint4* ws = static_cast<uint4*>(p.workspace);
  load_slice<T>(stage, static_cast<const T*>(p.x) + (g * n + rank) * s.size, s);
  __syncthreads();
  const int total = n * s.vecs;
  for (int c = 0; c < p.repeat; ++c) {
    uint4* slots = ws + ((c & 1) * p.groups + g) * n * static_cast<int64_t>(s.vecs);
    for (int v = threadIdx.x; v < s.vecs; v += blockDim.x) {
      slots[rank * s.vecs + v] = c == 0 ? stage[v] : add_scalar<T>(stage[v], static_cast<float>(c));
    }
    ptx::cluster_sync();
    for (int v = threadIdx.x; v < total; v += blockDim.x) gathered[v] = __ldcg(&slots[v]);
  }
  __syncthreads();
  store_gather_result<T>(p, s, gathered, g, rank);
}

SliceLayout slice_layout(const ClusterCollectiveParams& p) {
  const int elem = dtype_size(p.dtype);
  SliceLayout s;
  s.size = p.size;
  s.vecs = static_cast<int>(collective_slice_bytes(p.dtype, p.size) / 16);
  s.aligned = (p.size * elem) % 16 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  return s;
}

template <typename T>
cudaError_t launch_reduce_typed(const ClusterCollectiveParams& p, cudaStream_t stream) {
  const SliceLayout s = slice_layout(p);
  const dim3 grid(static_cast<unsigned>(p.groups * p.cluster_size)), block(kThreads);
  const size_t smem = cluster_collective_smem_bytes(false, p.dtype, p.cluster_size, p.size, p.exchange);
  const bool dsmem = p.exchange == ClusterExchange::kDsmem;
  if (p.op == ReduceOp::kSum) {
    return launch_cluster(dsmem ? reduce_dsmem_kernel<T, ReduceOp::kSum>
                                : reduce_global_kernel<T, ReduceOp::kSum>,
                          grid, block, smem, p.cluster_size, stream, p, s);
  }
  return launch_cluster(dsmem ? reduce_dsmem_kernel<T, ReduceOp::kMax>
                              : reduce_global_kernel<T, ReduceOp::kMax>,
                        grid, block, smem, p.cluster_size, stream, p, s);
}

template <typename T>
cudaError_t launch_gather_typed(const ClusterCollectiveParams& p, cudaStream_t stream) {
  const SliceLayout s = slice_layout(p);
  const dim3 grid(static_cast<unsigned>(p.groups * p.cluster_size)), block(kThreads);
  const size_t smem = cluster_collective_smem_bytes(true, p.dtype, p.cluster_size, p.size, p.exchange);
  return launch_cluster(
      p.exchange == ClusterExchange::kDsmem ? gather_dsmem_kernel<T> : gather_global_kernel<T>,
      grid, block, smem, p.cluster_size, stream, p, s);
}

}  // namespace

cudaError_t launch_cluster_reduce(const ClusterCollectiveParams& p, cudaStream_t stream) {
  return dispatch_float(p.dtype, [&](auto t) {
    return launch_reduce_typed<typename decltype(t)::type>(p, stream);
  });
}

cudaError_t launch_cluster_gather(const ClusterCollectiveParams& p, cudaStream_t stream) {
  return dispatch_float(p.dtype, [&](auto t) {
    return launch_gather_typed<typename decltype(t)::type>(p, stream);
  });
}

}  // namespace jax_cluster
