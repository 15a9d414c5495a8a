// ClusterReduce and ClusterGather over distributed shared memory (DSMEM):
// ClusterFusion §3.1, Algorithms 1 and 2, rebuilt to be race-free.
//
// Both run log2(N) rounds with doubling stride. Round r pairs block b with
// b XOR 2^r (a butterfly): partners are symmetric and fixed per round, which
// gives three properties the original ring schedule lacks:
//  * reduce: both partners combine the same two operands (a+b == b+a bitwise),
//    so EVERY block ends with a bitwise-identical result;
//  * gather: data lands at its natural position (segment j = block j), no
//    rotation to undo;
//  * reuse: a receive slot is only ever written by the same partner, so a
//    one-arrival "slot free" credit per round replaces cluster-wide barriers.
//
// Data moves with st.async: 16-byte remote stores whose bytes complete a
// transaction count on the receiver's mbarrier (`full`). The receiver returns
// a credit on the sender's `empty` barrier once it no longer needs the slot;
// the sender waits on that credit before writing the slot in the next call.
// This is the fix for the write-after-read race of the original code, where
// a round could overwrite a buffer its peer was still reading.
//
// Cost per round: one mbarrier wait on data (`full`), one on the credit
// (`empty`, already complete in steady state), no cluster barrier. One cluster
// barrier at start-up (barrier init visible to peers) and one before exit
// (no block leaves while peers may still touch its shared memory).
//
// Cluster sizes that are not powers of two (3, 5, 6, 7) have no butterfly: there
// every block sends its data straight to each of its N - 1 peers (slot s of the
// block s + 1 ranks up), with the same per-slot full/empty barriers. A reduce then
// combines the N values in rank order in fp32 and rounds once, so every block still
// ends with a bitwise-identical result; a gather's segments land in place.
//
// Usage inside a kernel (every thread of the block, or of the ThreadGroup passed last to
// the constructor, calls every method):
//   __shared__ ClusterCollectiveBarriers bars;
//   ClusterReduce<half, ReduceOp::kSum> reduce(&bars, recv_smem, num_vecs);
//   reduce.init();  ptx::cluster_sync();    // once, after all collectives' init
//   ... write data_smem ...; reduce(data_smem);   // any number of calls
//   reduce.finish();                          // before the block exits
// Buffers are arrays of 16-byte vectors (uint4) of T; pad partial vectors.
#pragma once

#include "jax_cluster/ptx.cuh"
#include "jax_cluster/thread_group.cuh"
#include "jax_cluster/types.h"
#include "jax_cluster/vec.cuh"

namespace jax_cluster {

// Receive slots per block: log2(16) butterfly rounds, or 7 - 1 direct peers.
inline constexpr int kMaxClusterSlots = 6;

struct ClusterCollectiveBarriers {
  uint64_t full[kMaxClusterSlots];   // data of round (slot) r arrived in my slot
  uint64_t empty[kMaxClusterSlots];  // the block I send to in round r freed its slot
};

template <ReduceOp Op>
__device__ __forceinline__ float reduce_op(float a, float b) {
  if constexpr (Op == ReduceOp::kSum) {
    return a + b;
  } else {
    return fmaxf(a, b);
  }
}

template <typename T, ReduceOp Op>
__device__ __forceinline__ uint4 combine(const uint4& a, const uint4& b) {
  constexpr int L = Vec16<T>::kLanes;
  float fa[L], fb[L];
  unpack<T>(a, fa);
  unpack<T>(b, fb);
#pragma unroll
  for (int i = 0; i < L; ++i) fa[i] = reduce_op<Op>(fa[i], fb[i]);
  return pack<T>(fa);
}

// Shared state of both collectives: rounds, partner addresses, call parity.
class ClusterCollectiveBase {
 protected:
  __device__ ClusterCollectiveBase(ClusterCollectiveBarriers* bars, ThreadGroup group)
      : bars_(bars), group_(group), rank_(ptx::cluster_rank()), n_(ptx::cluster_num_blocks()),
        calls_(0) {
    rounds_ = cluster_exchange_slots(n_);
    direct_ = (n_ & (n_ - 1)) != 0;
  }

  __device__ void init_barriers(uint32_t empty_arrivals) {
    if (threadIdx.x == 0) {
      for (int r = 0; r < rounds_; ++r) {
        ptx::mbarrier_init(&bars_->full[r], 1);
        ptx::mbarrier_init(&bars_->empty[r], empty_arrivals);
      }
      ptx::fence_mbarrier_init_cluster();
    }
  }

  // Butterfly: the block I exchange with in round r (both ways).
  __device__ uint32_t partner(int r) const { return rank_ ^ (1u << r); }
  // Direct schedule: slot r of the block r + 1 ranks up receives my data; mine receives
  // the data of the block r + 1 ranks down.
  __device__ uint32_t receiver(int r) const { return (rank_ + r + 1) % n_; }
  __device__ uint32_t sender(int r) const { return (rank_ + n_ - 1 - r) % n_; }

  __device__ uint32_t remote(const void* local, uint32_t rank) const {
    return ptx::map_to_rank(ptx::smem_addr(local), rank);
  }

  // Before writing into the partner's slot r: its previous call released it.
  __device__ void wait_slot_free(int r) const {
    if (calls_ > 0) ptx::mbarrier_wait_cluster(&bars_->empty[r], (calls_ - 1) & 1);
  }

  ClusterCollectiveBarriers* bars_;
  ThreadGroup group_;  // the threads that call the collective (all of them, every call)
  uint32_t rank_, n_;
  int rounds_;   // receive slots: butterfly rounds, or peers (direct)
  bool direct_;  // n is not a power of two
  uint32_t calls_;

 public:
  __device__ int rounds() const { return rounds_; }
  __device__ uint32_t rank() const { return rank_; }
  // No block may exit while a peer can still access its shared memory.
  __device__ void finish() const { ptx::cluster_sync(); }
};

// In-place all-reduce of `num_vecs` 16-byte vectors per block.
// Shared memory it owns: `recv` of rounds() * num_vecs vectors (one slot per round).
template <typename T, ReduceOp Op>
class ClusterReduce : public ClusterCollectiveBase {
 public:
  __device__ ClusterReduce(ClusterCollectiveBarriers* bars, uint4* recv, int num_vecs,
                           ThreadGroup group = ThreadGroup::block())
      : ClusterCollectiveBase(bars, group), recv_(recv), num_vecs_(num_vecs) {}

  // Slot credits come from every warp of the partner after it read the slot.
  __device__ void init() { init_barriers(group_.threads / 32); }

  __device__ void operator()(uint4* data) {
    group_.sync();  // `data` complete before anyone sends it
    if (direct_) {
      exchange_direct(data);
    } else {
      butterfly(data);
    }
    ++calls_;
    group_.sync();  // every thread may read every vector of the result
  }

 private:
  __device__ void butterfly(uint4* data) {
    const uint32_t bytes = static_cast<uint32_t>(num_vecs_) * 16u;
    for (int r = 0; r < rounds_; ++r) {
      const uint32_t peer = partner(r);
      uint4* slot = recv_ + static_cast<size_t>(r) * num_vecs_;
      if (threadIdx.x == 0) ptx::mbarrier_arrive_expect_tx(&bars_->full[r], bytes);
      wait_slot_free(r);
      const uint32_t peer_slot = remote(slot, peer);
      const uint32_t peer_full = remote(&bars_->full[r], peer);
      // Each thread owns the same vectors in every round: no block barrier
      // between rounds; its send reads the value its own combine wrote.
      for (int v = threadIdx.x; v < num_vecs_; v += group_.threads) {
        ptx::st_async_16(peer_slot + 16u * v, data[v], peer_full);
      }
      ptx::mbarrier_wait_cluster(&bars_->full[r], calls_ & 1);
      for (int v = threadIdx.x; v < num_vecs_; v += group_.threads) {
        data[v] = combine<T, Op>(data[v], slot[v]);
      }
      __syncwarp();
      if ((threadIdx.x & 31) == 0) ptx::mbarrier_arrive_remote(remote(&bars_->empty[r], peer));
    }
  }

  // Send to every peer, then combine the N values of each vector in rank order (fp32, one
  // rounding): the same operations in every block.
  __device__ void exchange_direct(uint4* data) {
    const uint32_t bytes = static_cast<uint32_t>(num_vecs_) * 16u;
    if (threadIdx.x == 0) {
      for (int r = 0; r < rounds_; ++r) ptx::mbarrier_arrive_expect_tx(&bars_->full[r], bytes);
    }
    for (int r = 0; r < rounds_; ++r) {
      wait_slot_free(r);
      const uint32_t peer = receiver(r);
      const uint32_t peer_slot = remote(recv_ + static_cast<size_t>(r) * num_vecs_, peer);
      const uint32_t peer_full = remote(&bars_->full[r], peer);
      for (int v = threadIdx.x; v < num_vecs_; v += group_.threads) {
        ptx::st_async_16(peer_slot + 16u * v, data[v], peer_full);
      }
    }
    for (int r = 0; r < rounds_; ++r) ptx::mbarrier_wait_cluster(&bars_->full[r], calls_ & 1);
    constexpr int L = Vec16<T>::kLanes;
    // rank j's vectors: mine, or those of slot (rank - j - 1) mod n
    auto from = [&](uint32_t j, int v) {
      return j == rank_ ? data[v] : recv_[static_cast<size_t>((rank_ + n_ - j - 1) % n_) * num_vecs_ + v];
    };
    for (int v = threadIdx.x; v < num_vecs_; v += group_.threads) {
      float acc[L], x[L];
      unpack<T>(from(0, v), acc);
      for (uint32_t j = 1; j < n_; ++j) {
        unpack<T>(from(j, v), x);
#pragma unroll
        for (int i = 0; i < L; ++i) acc[i] = reduce_op<Op>(acc[i], x[i]);
      }
      data[v] = pack<T>(acc);
    }
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
      for (int r = 0; r < rounds_; ++r) ptx::mbarrier_arrive_remote(remote(&bars_->empty[r], sender(r)));
    }
  }

  uint4* recv_;
  int num_vecs_;
};

// All-gather: block j's segment (seg_vecs vectors) ends at out[j * seg_vecs]
// in every block. The caller writes its own segment (segment(rank())) first.
// `out` (N * seg_vecs vectors) is written by peers: its contents stay valid
// until this block's next call, which tells the peers the buffer is free.
template <typename T>
class ClusterGather : public ClusterCollectiveBase {
 public:
  __device__ ClusterGather(ClusterCollectiveBarriers* bars, uint4* out, int seg_vecs,
                           ThreadGroup group = ThreadGroup::block())
      : ClusterCollectiveBase(bars, group), out_(out), seg_vecs_(seg_vecs) {}

  __device__ void init() { init_barriers(1); }

  __device__ uint4* segment(uint32_t rank) const {
    return out_ + static_cast<size_t>(rank) * seg_vecs_;
  }

  __device__ void operator()() {
    group_.sync();  // own segment written; previous result consumed
    if (calls_ > 0 && static_cast<int>(threadIdx.x) < rounds_) {
      const int r = threadIdx.x;  // my buffer is free again for whoever writes it in round r
      ptx::mbarrier_arrive_remote(remote(&bars_->empty[r], direct_ ? sender(r) : partner(r)));
    }
    if (direct_) {
      exchange_direct();
    } else {
      butterfly();
    }
    ++calls_;
    group_.sync();  // no thread rewrites its segment while another still sends it
  }

 private:
  __device__ void butterfly() {
    for (int r = 0; r < rounds_; ++r) {
      const uint32_t stride = 1u << r;
      const uint32_t peer = partner(r);
      // After round r-1 this block holds the segments of its aligned group
      // of `stride` blocks; it sends them to the same positions in the peer.
      const int first = static_cast<int>(rank_ & ~(stride - 1)) * seg_vecs_;
      const int count = static_cast<int>(stride) * seg_vecs_;
      if (threadIdx.x == 0) {
        ptx::mbarrier_arrive_expect_tx(&bars_->full[r], static_cast<uint32_t>(count) * 16u);
      }
      wait_slot_free(r);
      const uint32_t peer_out = remote(out_, peer);
      const uint32_t peer_full = remote(&bars_->full[r], peer);
      for (int v = threadIdx.x; v < count; v += group_.threads) {
        ptx::st_async_16(peer_out + 16u * (first + v), out_[first + v], peer_full);
      }
      ptx::mbarrier_wait_cluster(&bars_->full[r], calls_ & 1);
    }
  }

  // My segment straight to every peer, at its place in their buffers.
  __device__ void exchange_direct() {
    const int first = static_cast<int>(rank_) * seg_vecs_;
    if (threadIdx.x == 0) {
      for (int r = 0; r < rounds_; ++r) {
        ptx::mbarrier_arrive_expect_tx(&bars_->full[r], static_cast<uint32_t>(seg_vecs_) * 16u);
      }
    }
    for (int r = 0; r < rounds_; ++r) {
      wait_slot_free(r);
      const uint32_t peer = receiver(r);
      const uint32_t peer_out = remote(out_, peer);
      const uint32_t peer_full = remote(&bars_->full[r], peer);
      for (int v = threadIdx.x; v < seg_vecs_; v += group_.threads) {
        ptx::st_async_16(peer_out + 16u * (first + v), out_[first + v], peer_full);
      }
    }
    for (int r = 0; r < rounds_; ++r) ptx::mbarrier_wait_cluster(&bars_->full[r], calls_ & 1);
  }

  uint4* out_;
  int seg_vecs_;
};

}  // namespace jax_cluster
