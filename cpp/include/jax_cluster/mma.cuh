// Tensor-core tile helpers shared by the mma.sync kernels (swiglu, flash_attention):
// swizzled shared-memory tile addressing, cp.async, ldmatrix and m16n8k16 mma.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jax_cluster {

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of `row_bytes`-byte rows (a
// multiple of 128): chunks XOR-swizzled within each 128-byte segment, so ldmatrix (8 rows,
// one chunk) and the row-wise cp.async writes are conflict-free.
__device__ __forceinline__ uint32_t swz(int row, int chunk, int row_bytes) {
  return static_cast<uint32_t>(row * row_bytes + (((chunk & ~7) | ((chunk ^ row) & 7)) << 4));
}

// 16 bytes global -> shared; src_bytes = 0 fills zeros (src is not read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Waits until at most n groups are pending, n a runtime value in 0..6 (deeper: 6).
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    default: cp_async_wait<6>(); break;
  }
}

// 16 bytes global -> shared of a stream read once (weights): with `hint`, under the L2
// cache policy `policy` (ptx::l2_evict_first), else a plain cp_async_16.
__device__ __forceinline__ void cp_async_16_hinted(uint32_t dst, const void* src, bool hint,
                                                   uint64_t policy) {
  if (hint) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst),
                 "l"(src), "l"(policy)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  }
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Zeroes an array of mma accumulators of any shape.
template <int A, int B, int C>
__device__ __forceinline__ void zero_acc(float (&acc)[A][B][C]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j)
#pragma unroll
      for (int k = 0; k < C; ++k) acc[i][j][k] = 0.f;
}

// c += a * b: one m16n8k16 tensor-core mma of fp16 (T = __half) or bf16 (__nv_bfloat16)
// fragments, fp32 accumulators.
#define JAX_CLUSTER_MMA16816(ab_type)                                                       \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." ab_type "." ab_type                 \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"        \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "mma16816: fp16 or bf16 fragments");
  if constexpr (std::is_same_v<T, __half>) {
    JAX_CLUSTER_MMA16816("f16");
  } else {
    JAX_CLUSTER_MMA16816("bf16");
  }
}
#undef JAX_CLUSTER_MMA16816

// Two fp32 values rounded to one 16-bit pair (an mma A fragment register).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace jax_cluster
