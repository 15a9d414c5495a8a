// The NVSHMEM runtime of the one-sided sequence-parallel backend: bootstrap from a unique id,
// one symmetric arena (data regions + uint64 signals), a side stream for puts, and a fault
// record written by a device wait that timed out. Host API only; no XLA, no nanobind.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_cluster::nvshmem_rt {

// Written by a device-side wait that gave up (host-mapped pinned memory), then the kernel traps.
struct Fault {
  int32_t flag;         // 0: none; 1: a slot's signal never came; 2: the end barrier timed out
  int32_t pe;           // this PE
  int64_t signal;       // signal index waited on
  uint64_t seen;        // the signal's value when it gave up
  uint64_t expected;    // the value waited for
};

// The unique id (bytes) to be broadcast from rank 0.
std::vector<uint8_t> unique_id();
// Collective: NVSHMEM from the unique id, then an arena of `arena_bytes` (nvshmem_malloc,
// same size on every PE). `timeout_s` bounds every device-side wait.
void init(int rank, int world, const std::vector<uint8_t>& uid, size_t arena_bytes, double timeout_s);
// Collective: free the arena and allocate `bytes` (no transfer may be in flight).
void resize_arena(size_t bytes);
void finalize();
bool initialized();

int my_pe();
int n_pes();
size_t arena_bytes();
uint8_t* arena();  // local address of the symmetric arena
uint64_t timeout_ns();
const Fault* fault();  // host view of the fault record
std::string describe_fault();

// The local address of arena bytes [offset, offset + nbytes) in *ptr, or an error string
// (not initialised, an earlier fault, past the arena's end).
std::string region(size_t offset, size_t nbytes, const char* what, uint8_t** ptr);
// One-sided put of `nbytes` from `src` (device memory, or this PE's own arena) into `peer`'s
// arena at `offset`, then SET signal `sig` (at `sig_offset` + 8 sig) to 1, on the side stream
// after `stream`'s work so far. Records the completion event of slot `sig`. Returns an error
// string ("" = ok).
std::string put_signal(cudaStream_t stream, const void* src, size_t offset, size_t nbytes, int peer,
                       size_t sig_offset, int64_t sig);
// `stream` waits for the put of slot `sig` (issued by this PE), then for this PE's signal `sig`
// (device kernel, timeout -> fault + trap) and resets it: the slot's region has arrived and
// `stream`'s later work may read it in place.
std::string wait(cudaStream_t stream, size_t sig_offset, int64_t sig);
// Copies an arrived region into `dst` (device memory) on `stream`.
std::string copy_out(cudaStream_t stream, void* dst, size_t offset, size_t nbytes);
// Every PE signals every other and waits (timeout) for n_pes - 1 arrivals on signal `sig`.
std::string barrier(cudaStream_t stream, size_t sig_offset, int64_t sig);

}  // namespace jax_cluster::nvshmem_rt
