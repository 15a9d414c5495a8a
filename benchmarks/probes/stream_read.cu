// Measures the HBM bandwidth a weight-streaming kernel reaches (16-byte L1-bypassing loads,
// 8 in flight per thread): the roofline bandwidth of the benchmarks' memory-bound ops.
//
// A standalone XLA FFI library, not part of jax_cluster: benchmarks/common.py compiles it on
// demand with
//   nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a \
//        -isystem $(python -c 'import jax.ffi; print(jax.ffi.include_dir())') \
//        stream_read.cu -o libstream_read.so
// loads it with ctypes and registers the symbol `stream_read` as the CUDA FFI target
// "benchmarks_stream_read". Call: x (any dtype, x.nbytes a multiple of 16 * chunks) ->
// uint32 [chunks], the XOR of the 32-bit words of each of `chunks` equal contiguous pieces
// of x (so the reads cannot be optimised away, and the result is checkable on the host).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kThreads = 512;
constexpr int kInFlight = 8;

__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// One block per chunk.
__global__ void __launch_bounds__(kThreads)
    stream_read_kernel(const uint4* x, int64_t vecs_per_chunk, uint32_t* out) {
  const uint4* src = x + blockIdx.x * vecs_per_chunk;
  uint32_t acc = 0;
  int64_t v = threadIdx.x;
  for (; v + (kInFlight - 1) * kThreads < vecs_per_chunk; v += kInFlight * kThreads) {
    uint4 r[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) r[u] = ldg_stream(src + v + u * kThreads);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  for (; v < vecs_per_chunk; v += kThreads) {
    const uint4 r = ldg_stream(src + v);
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
    out[blockIdx.x] = all;
  }
}

ffi::Error stream_read_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                            int64_t chunks) {
  const int64_t bytes = static_cast<int64_t>(x.size_bytes());
  if (out->element_type() != ffi::DataType::U32 || out->element_count() != static_cast<size_t>(chunks)) {
    return ffi::Error::InvalidArgument("stream_read: out must be uint32 [chunks]");
  }
  if (chunks < 1 || chunks > 2147483647 || bytes % (16 * chunks) != 0) {
    return ffi::Error::InvalidArgument("stream_read: x's bytes (" + std::to_string(bytes) +
                                       ") must be a multiple of 16 * chunks (" + std::to_string(chunks) + ")");
  }
  stream_read_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(
      static_cast<const uint4*>(x.untyped_data()), bytes / 16 / chunks,
      static_cast<uint32_t*>(out->untyped_data()));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("stream_read: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(stream_read, stream_read_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunks"),
                              {ffi::Traits::kCmdBufferCompatible});
