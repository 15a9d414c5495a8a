// Thin wrappers over the Hopper PTX used by the cluster collectives and the
// fused kernels: distributed shared memory addressing, mbarriers with
// transaction counts, st.async remote stores and split cluster barriers.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace jax_cluster::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ uint32_t cluster_num_blocks() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// The shared::cluster address of `local_addr` in the block of rank `rank`.
__device__ __forceinline__ uint32_t map_to_rank(uint32_t local_addr, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_addr), "r"(rank));
  return remote;
}

// The GPU's nanosecond clock, common to all SMs: phase timelines of a launch.
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Asks the copy engine to pull [p, p + bytes) into L2 (no registers, no completion to
// wait for): used to start the next phase's stream before the current one ends.
// p 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// Streaming loads of data read once (weights, KV): read-only path, no L1 allocation.
// JAX_CLUSTER_LDG_STREAM(v4_name, v2_name, l2_qualifier) defines the 16-byte load v4_name
// and the 8-byte load v2_name (4 16-bit values) of `ld.global.nc.L1::no_allocate`, with the
// given (possibly empty) L2 qualifier.
#define JAX_CLUSTER_LDG_STREAM(v4_name, v2_name, l2_qualifier)                                 \
  __device__ __forceinline__ uint4 v4_name(const void* p) {                                    \
    uint4 v;                                                                                   \
    asm volatile("ld.global.nc.L1::no_allocate" l2_qualifier ".v4.u32 {%0, %1, %2, %3}, [%4];" \
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                                  \
                 : "l"(p));                                                                    \
    return v;                                                                                  \
  }                                                                                            \
  __device__ __forceinline__ uint2 v2_name(const void* p) {                                    \
    uint2 v;                                                                                   \
    asm volatile("ld.global.nc.L1::no_allocate" l2_qualifier ".v2.u32 {%0, %1}, [%2];"          \
                 : "=r"(v.x), "=r"(v.y)                                                        \
                 : "l"(p));                                                                    \
    return v;                                                                                  \
  }

// ldg_stream (16 bytes), ldg_stream8 (8 bytes).
JAX_CLUSTER_LDG_STREAM(ldg_stream, ldg_stream8, "")

// ldg_stream and ldg_stream8 with a 256-byte L2 prefetch-size hint: for warps that read
// each row in pieces smaller than a line (a whole row is then fetched from DRAM at the
// first piece's miss). The tensor-core split decode kernel's lanes read 64 bytes of each of
// 8 rows per instruction; without the hint each row reaches DRAM in 64-byte misses
// (docs/decode_attention.md).
JAX_CLUSTER_LDG_STREAM(ldg_stream_256, ldg_stream8_256, ".L2::256B")

#undef JAX_CLUSTER_LDG_STREAM

// Programmatic dependent launch (a kernel launched with the programmatic stream
// serialization attribute may start while the previous kernel of the stream still runs):
// griddep_wait() blocks until that previous grid has completed and its memory is visible
// (a no-op in a kernel launched without the attribute); griddep_launch_dependents() lets
// the next such kernel launch once every block of this grid has called it or exited.
__device__ __forceinline__ void griddep_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Spins until the global counter reaches `target` (gpu-scope acquire: what the writers
// released before their increments is visible to this thread afterwards; a CTA barrier
// after it extends that to the block). Only for blocks that are all resident at once.
__device__ __forceinline__ void wait_counter_at_least(const unsigned int* counter,
                                                      unsigned int target) {
  for (;;) {
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    if (v >= target) return;
    __nanosleep(64);
  }
}

// 16-byte shared-memory load (one LDS.128; the address must be 16-byte aligned).
__device__ __forceinline__ uint4 lds128(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_addr(p)));
  return v;
}

// 2^x (MUFU.EX2, flush-to-zero; 2^-inf = 0): softmax in the log2 domain.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Full cluster barrier, split so independent work can sit between the halves.
// release/acquire order shared AND global memory across the cluster.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals)
               : "memory");
}

// Makes mbarrier initialisation visible to the other blocks of the cluster
// (they arrive on / complete transactions against our barriers).
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One local arrival that also announces `bytes` of incoming transactions.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(
                   smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

// An arrival on a barrier in another block of the cluster.
__device__ __forceinline__ void mbarrier_arrive_remote(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote_bar)
               : "memory");
}

// One mbarrier.try_wait on the phase of the given parity (the hardware may suspend the
// thread a while before it answers): true once that phase completed. name: cta scope;
// name_cluster: with cluster-scope acquire (barriers other blocks of the cluster arrive on).
#define JAX_CLUSTER_MBARRIER_TRY_WAIT(name, semantics)                                  \
  __device__ __forceinline__ bool name(uint32_t addr, uint32_t parity) {              \
    uint32_t done;                                                                    \
    asm volatile(                                                                     \
        "{\n .reg .pred p;\n"                                                         \
        " mbarrier.try_wait.parity" semantics ".shared::cta.b64 p, [%1], %2;\n"         \
        " selp.u32 %0, 1, 0, p;\n}"                                                    \
        : "=r"(done)                                                                  \
        : "r"(addr), "r"(parity)                                                      \
        : "memory");                                                                  \
    return done != 0;                                                                 \
  }
JAX_CLUSTER_MBARRIER_TRY_WAIT(mbarrier_try_wait, "")
JAX_CLUSTER_MBARRIER_TRY_WAIT(mbarrier_try_wait_cluster, ".acquire.cluster")
#undef JAX_CLUSTER_MBARRIER_TRY_WAIT

// Waits (with cluster-scope acquire) until the phase of the given parity completed.
__device__ __forceinline__ void mbarrier_wait_cluster(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  while (!mbarrier_try_wait_cluster(addr, parity)) {
  }
}

// Same, cta scope: for barriers completed by the bulk-copy engine of this block.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  while (!mbarrier_try_wait(addr, parity)) {
  }
}

// Loads from another block's shared memory (a shared::cluster address from map_to_rank).
// Ordered against the cluster barriers that publish the data (memory clobber).
__device__ __forceinline__ float ld_cluster_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 ld_cluster_f32x4(uint32_t addr) {  // 16-byte aligned
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// 16-byte store into another block's shared memory; its bytes count as
// completed transactions on that block's mbarrier `remote_bar`.
__device__ __forceinline__ void st_async_16(uint32_t remote_addr, uint4 v, uint32_t remote_bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::
          "r"(remote_addr),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(remote_bar)
      : "memory");
}


// 8-byte store into another block's shared memory, completing transactions on its mbarrier.
__device__ __forceinline__ void st_async_8(uint32_t remote_addr, uint2 v, uint32_t remote_bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
          remote_addr),
      "r"(v.x), "r"(v.y), "r"(remote_bar)
      : "memory");
}

// mbarrier_wait_cluster that traps after ~seconds instead of hanging forever: a protocol
// error then surfaces as a launch failure (an error in JAX) rather than a hung device.
// try_wait suspends in hardware between polls, so the bound is generous.
__device__ __forceinline__ void mbarrier_wait_cluster_or_trap(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  for (uint32_t spins = 0;; ++spins) {
    if (mbarrier_try_wait_cluster(addr, parity)) return;
    if (spins == (1u << 26)) __trap();
  }
}

}  // namespace jax_cluster::ptx
