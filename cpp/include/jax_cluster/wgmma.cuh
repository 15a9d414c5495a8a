// Warpgroup matrix multiply (wgmma, sm_90a) and what goes with it: shared-memory matrix
// descriptors for the 128-byte swizzle that TMA writes, the asynchronous fence / commit /
// wait protocol, and setmaxnreg for warp-specialised kernels. Header-only, no XLA.
//
//  * A warpgroup (4 consecutive warps, the first one's index divisible by 4) issues
//    wgmma.mma_async m64nNk16: D[64, N] (+)= A[64, 16] B[16, N], fp32 accumulators in
//    registers. Warp w of the group holds rows [16 w, 16 w + 16) of D in the mma.sync
//    m16n8 accumulator layout, repeated over the N / 8 column tiles:
//        d[4 j + 2 h + e] = D[16 w + lane / 4 + 8 h][8 j + 2 (lane % 4) + e]
//    and an A operand from registers in the m16n8k16 A fragment layout (4 x 32 bits).
//  * Operands in shared memory are described by a 64-bit descriptor. Here every tile is
//    a stack of 128-byte-swizzled panels: rows of 64 16-bit elements (128 bytes), 16-byte
//    chunk c of row r stored at chunk c ^ (r % 8), 8-row atoms of 1024 bytes, the tile
//    1024-byte aligned: exactly what a TMA box of 64 elements x rows writes with
//    CU_TENSOR_MAP_SWIZZLE_128B.
//      - K-major (the operand's contraction dim is contiguous: Q and K of Q K^T): the
//        descriptor points at the k16 slice (start + 32 bytes per k16 step inside a panel,
//        the next panel for k >= 64); stride byte offset (SBO) = 1024 between 8-row atoms.
//      - MN-major B (N contiguous: V of P V, N = head dim; a [K, N] weight tile): SBO = 1024 between groups of
//        8 k-rows (start + 2048 bytes per k16 step), leading byte offset (LBO) = the
//        distance to the next 64-column panel.
//  * Asynchrony: wgmma_fence() before the first wgmma that reads registers written by
//    ordinary instructions; wgmma_commit() closes a group; wgmma_wait<N>() waits until at
//    most N groups are pending. Between issue and wait the accumulators (and A registers)
//    belong to the tensor cores: fence_operand() after the wait keeps the compiler from
//    moving their uses above it (ptxas would otherwise serialise, and warn).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jax_cluster {

namespace wgmma {

// Descriptor of a 128-byte-swizzled operand at shared address `addr` (see above).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo_bytes,
                                               uint32_t sbo_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32 |
         static_cast<uint64_t>(1) << 62;  // layout type 1: 128-byte swizzle
}

// K-major operand (Q, K): LBO unused by the swizzled K-major layout (1 by convention).
__device__ __forceinline__ uint64_t desc_k_major(uint32_t addr) {
  return desc_sw128(addr, 16, 1024);
}

// MN-major operand whose 64-column panels lie `panel_bytes` apart (V).
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t addr, uint32_t panel_bytes) {
  return desc_sw128(addr, panel_bytes, 1024);
}

__device__ __forceinline__ void fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Pins a register's value at this point of the instruction stream (no code).
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& r) {
  asm volatile("" : "+r"(r)::"memory");
}
template <typename R, int N>
__device__ __forceinline__ void fence_operand(R (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_operand(r[i]);
}

// Register budget of a warpgroup from here on (sm_90a; the kernel needs a register cap at
// entry: __launch_bounds__(threads, 1)). All threads of the warpgroup execute it.
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ------------------------------------------------------------------ mma_async
// Generated operand lists: accumulators first, then descriptors / A registers, scale-d.
#define JC_WGMMA_ACC8(d, i)                                                           \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])

#define JC_WGMMA_SS_N64(TY, TB)                              \
  asm volatile(                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                     \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
      "%32, %33, p, 1, 1, 0, " TB ";\n}\n"                                     \
      : JC_WGMMA_ACC8(d, 0), JC_WGMMA_ACC8(d, 8), JC_WGMMA_ACC8(d, 16), JC_WGMMA_ACC8(d, 24) \
      : "l"(a), "l"(b), "r"(scale_d))

#define JC_WGMMA_SS_N128(TY, TB)                              \
  asm volatile(                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                     \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
      "%64, %65, p, 1, 1, 0, " TB ";\n}\n"                                     \
      : JC_WGMMA_ACC8(d, 0), JC_WGMMA_ACC8(d, 8), JC_WGMMA_ACC8(d, 16), JC_WGMMA_ACC8(d, 24), \
        JC_WGMMA_ACC8(d, 32), JC_WGMMA_ACC8(d, 40), JC_WGMMA_ACC8(d, 48), JC_WGMMA_ACC8(d, 56) \
      : "l"(a), "l"(b), "r"(scale_d))

#define JC_WGMMA_SS_N192(TY, TB)                              \
  asm volatile(                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                     \
      "wgmma.mma_async.sync.aligned.m64n192k16.f32." TY "." TY " {"              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "  \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "  \
      "%96, %97, p, 1, 1, 0, " TB ";\n}\n"                                     \
      : JC_WGMMA_ACC8(d, 0), JC_WGMMA_ACC8(d, 8), JC_WGMMA_ACC8(d, 16), JC_WGMMA_ACC8(d, 24), \
        JC_WGMMA_ACC8(d, 32), JC_WGMMA_ACC8(d, 40), JC_WGMMA_ACC8(d, 48), JC_WGMMA_ACC8(d, 56), \
        JC_WGMMA_ACC8(d, 64), JC_WGMMA_ACC8(d, 72), JC_WGMMA_ACC8(d, 80), JC_WGMMA_ACC8(d, 88) \
      : "l"(a), "l"(b), "r"(scale_d))

#define JC_WGMMA_RS_N64(TY)                              \
  asm volatile(                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                     \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"            \
      : JC_WGMMA_ACC8(d, 0), JC_WGMMA_ACC8(d, 8), JC_WGMMA_ACC8(d, 16), JC_WGMMA_ACC8(d, 24) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))

#define JC_WGMMA_RS_N128(TY)                              \
  asm volatile(                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                     \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"            \
      : JC_WGMMA_ACC8(d, 0), JC_WGMMA_ACC8(d, 8), JC_WGMMA_ACC8(d, 16), JC_WGMMA_ACC8(d, 24), \
        JC_WGMMA_ACC8(d, 32), JC_WGMMA_ACC8(d, 40), JC_WGMMA_ACC8(d, 48), JC_WGMMA_ACC8(d, 56) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))

template <typename T>
inline constexpr bool kIsHalf = std::is_same_v<T, __half>;

// D (+)= A B, A [64, 16] K-major and B [16, N] in shared memory: K-major (kBMnMajor =
// false: K of S = Q K^T) or MN-major (true: a [K, N] row-major weight tile, swiglu_tma).
// accumulate = false overwrites D.
template <typename T, int N, bool kBMnMajor = false>
__device__ __forceinline__ void mma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(N == 64 || N == 128 || N == 192, "add the shape's operand list above");
  const uint32_t scale_d = accumulate ? 1u : 0u;
#define JC_WGMMA_SS_DISPATCH(MACRO)                                      \
  if constexpr (kIsHalf<T>) {                                            \
    if constexpr (kBMnMajor) { MACRO("f16", "1"); } else { MACRO("f16", "0"); }   \
  } else {                                                               \
    if constexpr (kBMnMajor) { MACRO("bf16", "1"); } else { MACRO("bf16", "0"); } \
  }
  if constexpr (N == 64) {
    JC_WGMMA_SS_DISPATCH(JC_WGMMA_SS_N64)
  } else if constexpr (N == 128) {
    JC_WGMMA_SS_DISPATCH(JC_WGMMA_SS_N128)
  } else {
    JC_WGMMA_SS_DISPATCH(JC_WGMMA_SS_N192)
  }
#undef JC_WGMMA_SS_DISPATCH
}

// D (+)= A B, A [64, 16] from registers (m16n8k16 A fragments), B [16, N] MN-major in
// shared memory (O += P V).
template <typename T, int N>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,
                                       bool accumulate) {
  static_assert(N == 64 || N == 128, "add the shape's operand list above");
  const uint32_t scale_d = accumulate ? 1u : 0u;
  if constexpr (N == 64) {
    if constexpr (kIsHalf<T>) { JC_WGMMA_RS_N64("f16"); } else { JC_WGMMA_RS_N64("bf16"); }
  } else {
    if constexpr (kIsHalf<T>) { JC_WGMMA_RS_N128("f16"); } else { JC_WGMMA_RS_N128("bf16"); }
  }
}

#undef JC_WGMMA_ACC8
#undef JC_WGMMA_SS_N64
#undef JC_WGMMA_SS_N128
#undef JC_WGMMA_SS_N192
#undef JC_WGMMA_RS_N64
#undef JC_WGMMA_RS_N128

}  // namespace wgmma

}  // namespace jax_cluster
