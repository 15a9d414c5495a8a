// NVSHMEM runtime of the one-sided sequence-parallel backend (see runtime.h).
// Compiled with relocatable device code and linked with libnvshmem_device.a (device link):
// nvshmemx_init_attr is inline and calls into the device library.
#include "runtime.h"

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <stdexcept>
#include <unordered_map>

namespace jax_cluster::nvshmem_rt {
namespace {

struct State {
  bool up = false;
  int pe = 0, npes = 1;
  uint8_t* arena = nullptr;
  size_t arena_bytes = 0;
  uint64_t timeout_ns = 60ull * 1000000000ull;
  cudaStream_t side = nullptr;
  Fault* fault_host = nullptr;  // pinned, mapped
  Fault* fault_dev = nullptr;
  std::unordered_map<int64_t, cudaEvent_t> put_done;  // slot signal -> event of its last put
  cudaEvent_t xla_ready = nullptr;
};
State g;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

std::string err(cudaError_t e, const char* what) {
  return e == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(e);
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Wait until *sig >= expected, then subtract `expected` (so arrivals of a next call that come
// early are kept). Past timeout_ns: write the fault record, make it visible, trap.
__device__ void wait_or_trap(uint64_t* sig, uint64_t expected, uint64_t timeout_ns, Fault* fault,
                             int64_t index, int32_t kind) {
  const uint64_t t0 = global_ns();
  uint64_t seen;
  while ((seen = nvshmem_signal_fetch(sig)) < expected) {
    if (global_ns() - t0 > timeout_ns) {
      fault->pe = nvshmem_my_pe();
      fault->signal = index;
      fault->seen = seen;
      fault->expected = expected;
      __threadfence_system();
      atomicExch(&fault->flag, kind);
      __threadfence_system();
      __trap();
    }
    __nanosleep(2000);
  }
  nvshmemx_signal_op(sig, static_cast<uint64_t>(0) - expected, NVSHMEM_SIGNAL_ADD, nvshmem_my_pe());
}

__global__ void wait_signal_kernel(uint64_t* sig, uint64_t timeout_ns, Fault* fault, int64_t index) {
  wait_or_trap(sig, 1, timeout_ns, fault, index, 1);
}

__global__ void barrier_kernel(uint64_t* sig, uint64_t timeout_ns, Fault* fault, int64_t index) {
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  for (int p = threadIdx.x; p < n; p += blockDim.x)
    if (p != me) nvshmemx_signal_op(sig, 1, NVSHMEM_SIGNAL_ADD, p);
  __syncthreads();
  if (threadIdx.x == 0) wait_or_trap(sig, static_cast<uint64_t>(n - 1), timeout_ns, fault, index, 2);
}

uint64_t* signal_ptr(size_t sig_offset, int64_t sig) {
  return reinterpret_cast<uint64_t*>(g.arena + sig_offset) + sig;
}

std::string check_range(size_t offset, size_t nbytes, const char* what) {
  if (!g.up) return std::string(what) + ": NVSHMEM is not initialised (jax_cluster.parallel.nvshmem.init)";
  if (g.fault_host->flag) return std::string(what) + ": an earlier wait failed: " + describe_fault();
  if (offset + nbytes > g.arena_bytes)
    return std::string(what) + ": needs arena bytes [" + std::to_string(offset) + ", " +
           std::to_string(offset + nbytes) + ") but the arena has " + std::to_string(g.arena_bytes) +
           " (jax_cluster.parallel.nvshmem.grow)";
  return {};
}

}  // namespace

std::vector<uint8_t> unique_id() {
  nvshmemx_uniqueid_t id;
  if (nvshmemx_get_uniqueid(&id) != 0) throw std::runtime_error("nvshmemx_get_uniqueid failed");
  std::vector<uint8_t> out(sizeof(id));
  std::memcpy(out.data(), &id, sizeof(id));
  return out;
}

void init(int rank, int world, const std::vector<uint8_t>& uid, size_t arena_bytes, double timeout_s) {
  if (g.up) throw std::runtime_error("NVSHMEM is already initialised in this process");
  nvshmemx_uniqueid_t id;
  if (uid.size() != sizeof(id))
    throw std::runtime_error("unique id of " + std::to_string(uid.size()) + " bytes, expected " +
                             std::to_string(sizeof(id)) + " (NVSHMEM versions differ between processes?)");
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr) != 0)
    throw std::runtime_error("nvshmemx_set_attr_uniqueid_args failed");
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
    throw std::runtime_error("nvshmemx_init_attr failed");
  g.pe = nvshmem_my_pe();
  g.npes = nvshmem_n_pes();
  if (g.pe != rank || g.npes != world)
    throw std::runtime_error("NVSHMEM PE " + std::to_string(g.pe) + "/" + std::to_string(g.npes) +
                             " differs from rank " + std::to_string(rank) + "/" + std::to_string(world));
  g.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  check(cudaHostAlloc(&g.fault_host, sizeof(Fault), cudaHostAllocMapped), "cudaHostAlloc(fault record)");
  std::memset(g.fault_host, 0, sizeof(Fault));
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&g.fault_dev), g.fault_host, 0), "fault record");
  // The highest priority: whatever part of a put runs as a kernel gets the next free SM slot
  // ahead of the blocks of the attention it overlaps, instead of waiting for that kernel's end.
  int least = 0, greatest = 0;
  check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "stream priorities");
  check(cudaStreamCreateWithPriority(&g.side, cudaStreamNonBlocking, greatest), "side stream");
  check(cudaEventCreateWithFlags(&g.xla_ready, cudaEventDisableTiming), "event");
  g.up = true;
  resize_arena(arena_bytes);
}

void resize_arena(size_t bytes) {
  if (!g.up) throw std::runtime_error("resize_arena before init");
  check(cudaDeviceSynchronize(), "before resizing the arena");
  if (g.arena) nvshmem_free(g.arena);  // collective
  g.arena = static_cast<uint8_t*>(nvshmem_malloc(bytes));  // collective, same size everywhere
  if (!g.arena)
    throw std::runtime_error("nvshmem_malloc(" + std::to_string(bytes) +
                             ") failed: raise NVSHMEM_SYMMETRIC_SIZE (the symmetric heap) or use a smaller plan");
  check(cudaMemset(g.arena, 0, bytes), "clearing the arena");
  check(cudaDeviceSynchronize(), "clearing the arena");
  nvshmem_barrier_all();
  g.arena_bytes = bytes;
}

void finalize() {
  if (!g.up) return;
  if (g.fault_host->flag) return;  // a peer may be gone: the collective free/finalize would wait
  cudaDeviceSynchronize();
  if (g.arena) nvshmem_free(g.arena);
  g.arena = nullptr;
  for (auto& [_, e] : g.put_done) cudaEventDestroy(e);
  g.put_done.clear();
  cudaEventDestroy(g.xla_ready);
  cudaStreamDestroy(g.side);
  nvshmem_finalize();
  cudaFreeHost(g.fault_host);
  g = State{};
}

std::string region(size_t offset, size_t nbytes, const char* what, uint8_t** ptr) {
  if (auto e = check_range(offset, nbytes, what); !e.empty()) return e;
  *ptr = g.arena + offset;
  return {};
}

bool initialized() { return g.up; }
int my_pe() { return g.pe; }
int n_pes() { return g.npes; }
size_t arena_bytes() { return g.arena_bytes; }
uint8_t* arena() { return g.arena; }
uint64_t timeout_ns() { return g.timeout_ns; }
const Fault* fault() { return g.fault_host; }

std::string describe_fault() {
  if (!g.fault_host || !g.fault_host->flag) return {};
  const Fault& f = *g.fault_host;
  const double s = g.timeout_ns / 1e9;
  if (f.flag == 1)
    return "PE " + std::to_string(f.pe) + ": the put into slot signal " + std::to_string(f.signal) +
           " never arrived within " + std::to_string(s) + " s (a peer died, or the processes ran different programs)";
  return "PE " + std::to_string(f.pe) + ": the end-of-call barrier saw " + std::to_string(f.seen) + " of " +
         std::to_string(f.expected) + " peers within " + std::to_string(s) + " s";
}

std::string put_signal(cudaStream_t stream, const void* src, size_t offset, size_t nbytes, int peer,
                       size_t sig_offset, int64_t sig) {
  if (auto e = check_range(offset, nbytes, "nvshmem put"); !e.empty()) return e;
  if (auto e = check_range(sig_offset + 8 * (sig + 1), 0, "nvshmem put signal"); !e.empty()) return e;
  if (peer < 0 || peer >= g.npes) return "nvshmem put: peer " + std::to_string(peer) + " out of range";
  if (auto e = err(cudaEventRecord(g.xla_ready, stream), "event"); !e.empty()) return e;
  if (auto e = err(cudaStreamWaitEvent(g.side, g.xla_ready, 0), "side stream wait"); !e.empty()) return e;
  nvshmemx_putmem_signal_on_stream(g.arena + offset, src, nbytes, signal_ptr(sig_offset, sig), 1,
                                   NVSHMEM_SIGNAL_SET, peer, g.side);
  cudaEvent_t& done = g.put_done[sig];
  if (!done) {
    if (auto e = err(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event"); !e.empty()) return e;
  }
  return err(cudaEventRecord(done, g.side), "put event");
}

std::string wait(cudaStream_t stream, size_t sig_offset, int64_t sig) {
  if (auto e = check_range(sig_offset + 8 * (sig + 1), 0, "nvshmem wait"); !e.empty()) return e;
  auto it = g.put_done.find(sig);
  if (it == g.put_done.end()) return "nvshmem wait: slot signal " + std::to_string(sig) + " has no put before it";
  if (auto e = err(cudaStreamWaitEvent(stream, it->second, 0), "wait for the put"); !e.empty()) return e;
  wait_signal_kernel<<<1, 1, 0, stream>>>(signal_ptr(sig_offset, sig), g.timeout_ns, g.fault_dev, sig);
  return err(cudaGetLastError(), "wait kernel");
}

std::string copy_out(cudaStream_t stream, void* dst, size_t offset, size_t nbytes) {
  uint8_t* src = nullptr;
  if (auto e = region(offset, nbytes, "nvshmem copy out", &src); !e.empty()) return e;
  return err(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, stream), "copy out");
}

std::string barrier(cudaStream_t stream, size_t sig_offset, int64_t sig) {
  if (auto e = check_range(sig_offset + 8 * (sig + 1), 0, "nvshmem barrier"); !e.empty()) return e;
  barrier_kernel<<<1, 32, 0, stream>>>(signal_ptr(sig_offset, sig), g.timeout_ns, g.fault_dev, sig);
  return err(cudaGetLastError(), "barrier kernel");
}

}  // namespace jax_cluster::nvshmem_rt
