// The bulk copy engine (TMA) and the mbarrier ring that feeds it: what every streaming
// kernel here uses to move weights, KV caches and tiles into shared memory.
//
//  * bulk_load: one contiguous range global -> shared (cp.async.bulk, no tensor map);
//    bulk_store the other way (a finished tile leaving through the copy engine);
//  * tma_load_{2,4}d: one box of a tensor described by a CUtensorMap (passed to the
//    kernel by value as a __grid_constant__ parameter; encoded on the host by
//    jax_cluster/tma_host.h);
//  * both complete as transaction bytes on an mbarrier (the stage's `full` barrier);
//  * Ring<S>: S stages with full/empty barriers. One producer thread issues copies
//    into stage i after the consumers released it; consumers wait on `full`, read,
//    then arrive on `empty`. Stage and phase advance identically on both sides, so the
//    producer may run any distance ahead, across the phases of a kernel.
//
// The consumer warps of such a warp-specialised block synchronise among themselves with
// a ThreadGroup (jax_cluster/thread_group.cuh), never with __syncthreads.
#pragma once

#include <cuda.h>  // CUtensorMap (the type only: no driver-library link)
#include <cstdint>

#include "jax_cluster/ptx.cuh"

namespace jax_cluster {

namespace ptx {

// An L2 policy for data read exactly once (weights, KV): evicted first, so it does not
// push out what other blocks still share.
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// An L2 policy for data many blocks re-read (activations; attention's K and V tiles): kept
// longest.
__device__ __forceinline__ uint64_t l2_evict_last() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// The default policy, for data other blocks may read too (shared weights, a KV head read
// by several clusters).
__device__ __forceinline__ uint64_t l2_evict_normal() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// [src, src + bytes) -> shared dst; bytes complete on `bar`. 16-byte aligned addresses,
// bytes a multiple of 16.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

// One box of the tensor `map` at element coordinates (c0 innermost, ...) -> shared dst.
// Coordinates past the tensor's end read as zeros (and still count their bytes).
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int32_t c0,
                                            int32_t c1, uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int32_t c0,
                                            int32_t c1, int32_t c2, int32_t c3, uint64_t* bar,
                                            uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;" ::"r"(smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

// Pulls one box of the tensor `map` into L2 (no shared memory, nothing to wait for).
__device__ __forceinline__ void tma_prefetch_2d(const CUtensorMap* map, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"(map),
               "r"(c0), "r"(c1)
               : "memory");
}

// Shared src -> [dst, dst + bytes) in global memory through the copy engine (16-byte
// aligned addresses, bytes a multiple of 16). Writes made to src by ordinary stores must be
// fenced first (fence_proxy_async_shared); the copies of the issuing thread complete at
// bulk_store_wait.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_store_wait() {
  asm volatile("cp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group 0;" ::: "memory");
}

// Makes this thread's ordinary shared-memory writes visible to the copy engine.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Fetches a __grid_constant__ tensor map's descriptor ahead of its first use.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// A plain local arrival (release, cta scope).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

}  // namespace ptx

// S shared-memory stages fed by one producer thread, drained by `consumer_warps` warps.
// The barriers live in shared memory (this struct); the stage buffers wherever the kernel
// puts them. Stage/phase bookkeeping is per thread (RingCursor), advanced in the same order
// by the producer and by every consumer.
template <int S>
struct Ring {
  static constexpr int kStages = S;
  uint64_t full[S];   // the stage's bytes have landed
  uint64_t empty[S];  // every consumer warp is done with the stage

  // One thread, before the block's first barrier (and a fence for cluster peers if any).
  __device__ void init(uint32_t consumer_warps) {
#ifdef JC_RING_ARRIVE_PER_LANE
    consumer_warps *= 32;  // see ring_release
#endif
#pragma unroll
    for (int s = 0; s < S; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], consumer_warps);
    }
  }
};

struct RingCursor {
  int stage = 0;
  uint32_t phase = 0;
  template <int S>
  __device__ void advance() {
    advance(S);
  }
  // A ring used with fewer stages than its capacity (sized at launch).
  __device__ void advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// Producer side (one thread): wait until the stage is free, announce `bytes`, then issue
// the copies of this stage against ring.full[cur.stage].
template <int S>
__device__ __forceinline__ uint64_t* ring_acquire(Ring<S>& ring, const RingCursor& cur,
                                                  uint32_t bytes) {
  // The first pass over the ring finds every stage free (parity trick: waiting for the
  // phase before the initial one returns at once).
  ptx::mbarrier_wait(&ring.empty[cur.stage], cur.phase ^ 1);
  ptx::mbarrier_arrive_expect_tx(&ring.full[cur.stage], bytes);
  return &ring.full[cur.stage];
}

// Consumer side (every consumer thread): the stage's bytes are visible.
template <int S>
__device__ __forceinline__ void ring_wait(Ring<S>& ring, const RingCursor& cur) {
  ptx::mbarrier_wait(&ring.full[cur.stage], cur.phase);
}

// Consumer side: this warp is done reading the stage (call from all lanes after the
// warp's last read of it).
// JC_RING_ARRIVE_PER_LANE (sanitizer builds only): every lane arrives itself. racecheck
// does not follow the __syncwarp that orders the other lanes' reads before lane 0's
// arrive, and reports each stage's reuse as a WAR hazard; with per-lane arrives it checks
// the rest of the kernel (benchmarks/probes/sanitize_attention_kernels.sh builds so).
template <int S>
__device__ __forceinline__ void ring_release(Ring<S>& ring, const RingCursor& cur) {
#ifdef JC_RING_ARRIVE_PER_LANE
  ptx::mbarrier_arrive(&ring.empty[cur.stage]);
#else
  __syncwarp();
  if ((threadIdx.x & 31) == 0) ptx::mbarrier_arrive(&ring.empty[cur.stage]);
#endif
}

}  // namespace jax_cluster
