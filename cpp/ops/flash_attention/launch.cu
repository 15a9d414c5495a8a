// flash_attention: several query chunks x several KV chunks in one launch, folded into a
// running (o, lse) state (see ops/flash_attention/params.h for the math and layouts).
//
// FlashAttention-2 structure (StreamFusion App. C, Alg. 2), per block of 128 threads:
//  * grid (sum_i ceil(Lq_i / 128), H, B): block x is a 128-row tile of one query chunk
//    (found by a scan of the chunks' first-tile indices, kernel parameters);
//  * warp w owns query rows [32 w, 32 w + 32) of the tile: two m16 tiles;
//  * the KV chunks form ONE sequence of 64-key tiles (the last tile of each chunk is
//    partial and masked); K and V tiles stream through a two-stage cp.async double
//    buffer (16-byte copies, zero-filled past the chunk end) in XOR-swizzled shared
//    memory, prefetching across chunk boundaries;
//  * S = Q K^T with mma.sync m16n8k16 (Q, K fragments by ldmatrix), fp32 accumulators;
//    online softmax in the exp2 domain (row max / sum over the 4 lanes of a quad);
//    O += P V with P re-packed from the S accumulators as A fragments and V fragments
//    by ldmatrix.trans;
//  * the incoming state seeds the running (m, l, O) = (lse log2 e, 1, o) (l on one lane
//    of the quad), so the merge with earlier KV (the paper's Eq. 3) costs nothing;
//  * epilogue: l summed over the quad, o = O / l (0 where l = 0), lse = (m + log2 l) ln 2
//    (-inf where l = 0); fp32 state or, with finalize, o in the input dtype.
// Deterministic: every output element is written once by one thread, no atomics.
//
// The Hopper kernel (launch_wgmma.cu) is faster; this one runs what that one does not
// serve (a negative scale, a buffer TMA cannot map) and on request
// (FlashAttentionConfig(kernel="mma")): launch_flash_attention below tries the wgmma kernel
// first.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/mma.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/vec.cuh"
#include "ops/flash_attention/launch.h"
#include "jax_cluster/launch.cuh"
#include "ops/flash_attention/launch_args.h"

namespace jax_cluster {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMT = 2;                   // m16 tiles per warp
constexpr int kBM = kWarps * kMT * 16;   // query rows per block
constexpr int kBN = 64;                  // keys per KV tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ------------------------------------------------------------------ kernel parameters
struct QDesc : FlashQDesc {
  const void* q;  // [B, len, H, D]
};

struct KVDesc {
  const void* k;
  const void* v;
  int32_t len;
  int32_t tile_start;  // first KV tile of this chunk in the sequence of tiles
};

struct FlashArgs {
  int32_t heads, num_q, num_kv, kv_tiles;
  float scale_log2;  // scale * log2(e)
  int32_t finalize;
  QDesc q[kFlashMaxQChunks];
  KVDesc kv[kFlashMaxKVChunks];
};

// ------------------------------------------------------------------ PTX helpers
// (swizzled tiles, cp.async, ldmatrix, mma: jax_cluster/mma.cuh)

// ROWS x D tile (rows `stride` elements apart in global memory) -> swizzled shared memory;
// rows >= valid are zero-filled (never read from global memory).
template <typename T, int ROWS, int D>
__device__ __forceinline__ void load_tile(uint32_t dst, const T* src, int64_t stride, int valid,
                                          int tid) {
  constexpr int kChunks = D / 8;
  constexpr int kPer = ROWS * kChunks / kThreads;
  static_assert(ROWS * kChunks % kThreads == 0, "tile must split evenly over the threads");
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = tid + i * kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = r < valid;
    cp_async_16(dst + swz(r, c, D * 2), src + (ok ? r * stride : 0) + c * 8, ok ? 16u : 0u);
  }
}

// ------------------------------------------------------------------ the kernel
// Unrolling of the Q K^T k-loop: fully at Dh 64 (235 registers); not at Dh 128, where the
// 128 O accumulators leave no room for the hoisted swizzled ldmatrix addresses of eight
// k-steps (unrolled: 255 registers plus spills; rolled: 255, none). Both: 2 blocks/SM.
template <int D>
struct HeadDimTraits;
template <>
struct HeadDimTraits<64> {
  static constexpr int kKUnroll = 4;
};
template <>
struct HeadDimTraits<128> {
  static constexpr int kKUnroll = 1;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2)
    flash_attention_kernel(const __grid_constant__ FlashArgs a) {
  constexpr int kRowBytes = D * 2;
  constexpr int kQBytes = kBM * kRowBytes;
  constexpr int kKVBytes = kBN * kRowBytes;
  constexpr int kKSteps = D / 16;   // k16 steps of Q K^T
  constexpr int kKUnroll = HeadDimTraits<D>::kKUnroll;
  constexpr int kNTiles = kBN / 8;  // n8 tiles of S
  constexpr int kDTiles = D / 8;    // n8 tiles of O
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s_q = ptx::smem_addr(smem);
  const uint32_t s_kv = s_q + kQBytes;  // stage s: K at s_kv + 2 s kKVBytes, V after it

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int quad_row = lane >> 2, quad_col = lane & 3;
  const int h = blockIdx.y, b = blockIdx.z, H = a.heads;
  const int64_t row_stride = static_cast<int64_t>(H) * D;  // elements between rows

  // Which query chunk (empty chunks own no tiles: the scan passes them).
  int qi = 0;
  while (qi + 1 < a.num_q && a.q[qi + 1].tile_start <= static_cast<int>(blockIdx.x)) ++qi;
  const QDesc& qc = a.q[qi];
  const int lq = qc.len;
  const int q0 = (static_cast<int>(blockIdx.x) - qc.tile_start) * kBM;
  const int kv_tiles = a.kv_tiles;

  // Loader: the KV tile sequence crosses chunk boundaries; `lj` follows it.
  int lj = 0;
  auto issue_kv = [&](int t, int stage) -> int {
    while (lj + 1 < a.num_kv && a.kv[lj + 1].tile_start <= t) ++lj;
    const KVDesc& c = a.kv[lj];
    const int r0 = (t - c.tile_start) * kBN;
    const int valid = min(kBN, c.len - r0);
    const int64_t off = (static_cast<int64_t>(b) * c.len + r0) * row_stride + static_cast<int64_t>(h) * D;
    const uint32_t k_dst = s_kv + 2 * stage * kKVBytes;
    load_tile<T, kBN, D>(k_dst, static_cast<const T*>(c.k) + off, row_stride, valid, tid);
    load_tile<T, kBN, D>(k_dst + kKVBytes, static_cast<const T*>(c.v) + off, row_stride, valid, tid);
    return valid;
  };

  int valid_next = 0;
  if (kv_tiles > 0) {
    const int64_t off = (static_cast<int64_t>(b) * lq + q0) * row_stride + static_cast<int64_t>(h) * D;
    load_tile<T, kBM, D>(s_q, static_cast<const T*>(qc.q) + off, row_stride, lq - q0, tid);
    valid_next = issue_kv(0, 0);
    cp_async_commit();
  }

  // Running state, seeded from the incoming one (overlaps the first copies).
  float o[kMT][kDTiles][4];
  float m_run[kMT][2], l_run[kMT][2];
  const int warp_row0 = q0 + warp * kMT * 16;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = warp_row0 + mt * 16 + hf * 8 + quad_row;
      float lse0 = -INFINITY;
      if (qc.lse_in != nullptr && row < lq) {
        lse0 = qc.lse_in[(static_cast<int64_t>(b) * H + h) * lq + row];
      }
      const bool seeded = lse0 > -INFINITY;  // NaN / -inf: empty
      m_run[mt][hf] = seeded ? lse0 * kLog2e : -INFINITY;
      l_run[mt][hf] = seeded && quad_col == 0 ? 1.f : 0.f;
      const float* src = qc.o_in + (static_cast<int64_t>(b) * lq + row) * row_stride +
                         static_cast<int64_t>(h) * D + 2 * quad_col;
#pragma unroll
      for (int dn = 0; dn < kDTiles; ++dn) {
        float2 v = make_float2(0.f, 0.f);
        if (seeded) v = *reinterpret_cast<const float2*>(src + dn * 8);
        o[mt][dn][2 * hf] = v.x;
        o[mt][dn][2 * hf + 1] = v.y;
      }
    }
  }

  // ldmatrix lane addressing (row & 7 == lane & 7 for every fragment below).
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_chunk = lane >> 4;  // Q, V (trans)
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_chunk = (lane >> 3) & 1;
  const float sl2 = a.scale_log2;

  for (int t = 0; t < kv_tiles; ++t) {
    const int valid = valid_next;
    if (t + 1 < kv_tiles) {
      valid_next = issue_kv(t + 1, (t + 1) & 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint32_t s_k = s_kv + 2 * (t & 1) * kKVBytes, s_v = s_k + kKVBytes;

    // S = Q K^T
    float s[kMT][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int n = 0; n < kNTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
#pragma unroll kKUnroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t qa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        ldsm_x4(qa[mt], s_q + swz(warp * kMT * 16 + mt * 16 + a_row, kk * 2 + a_chunk, kRowBytes));
      }
#pragma unroll
      for (int nn = 0; nn < kBN / 16; ++nn) {
        uint32_t kb[4];
        ldsm_x4(kb, s_k + swz(nn * 16 + k_row, kk * 2 + k_chunk, kRowBytes));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(s[mt][2 * nn], qa[mt], kb[0], kb[1]);
          mma16816<T>(s[mt][2 * nn + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }

    // Online softmax (log2 domain); keys past the chunk end masked.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int n = 0; n < kNTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] *= sl2;
    if (valid < kBN) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int n = 0; n < kNTiles; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (n * 8 + 2 * quad_col + (e & 1) >= valid) s[mt][n][e] = -INFINITY;
          }
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = m_run[mt][hf];
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
          mx = fmaxf(mx, fmaxf(s[mt][n][2 * hf], s[mt][n][2 * hf + 1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float ref = mx == -INFINITY ? 0.f : mx;  // no (-inf) - (-inf)
        const float alpha = ptx::ex2(m_run[mt][hf] - ref);
        m_run[mt][hf] = mx;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
          for (int e = 2 * hf; e < 2 * hf + 2; ++e) {
            const float p = ptx::ex2(s[mt][n][e] - ref);
            s[mt][n][e] = p;
            sum += p;
          }
        }
        l_run[mt][hf] = l_run[mt][hf] * alpha + sum;
#pragma unroll
        for (int dn = 0; dn < kDTiles; ++dn) {
          o[mt][dn][2 * hf] *= alpha;
          o[mt][dn][2 * hf + 1] *= alpha;
        }
      }
    }

    // O += P V
#pragma unroll
    for (int kj = 0; kj < kBN / 16; ++kj) {
      uint32_t pa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        pa[mt][0] = pack2<T>(s[mt][2 * kj][0], s[mt][2 * kj][1]);
        pa[mt][1] = pack2<T>(s[mt][2 * kj][2], s[mt][2 * kj][3]);
        pa[mt][2] = pack2<T>(s[mt][2 * kj + 1][0], s[mt][2 * kj + 1][1]);
        pa[mt][3] = pack2<T>(s[mt][2 * kj + 1][2], s[mt][2 * kj + 1][3]);
      }
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t vb[4];
        ldsm_x4_trans(vb, s_v + swz(kj * 16 + a_row, dn * 2 + a_chunk, kRowBytes));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(o[mt][2 * dn], pa[mt], vb[0], vb[1]);
          mma16816<T>(o[mt][2 * dn + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // this stage is refilled by the next iteration's prefetch
  }

  // Epilogue: normalise, write o and lse of the rows inside the chunk.
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float l = l_run[mt][hf];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = warp_row0 + mt * 16 + hf * 8 + quad_row;
      if (row >= lq) continue;
      const bool any = l > 0.f;
      const float inv = any ? 1.f / l : 0.f;
      if (quad_col == 0) {
        qc.lse[(static_cast<int64_t>(b) * H + h) * lq + row] =
            any ? (m_run[mt][hf] + __log2f(l)) * kLn2 : -INFINITY;
      }
      const int64_t off = (static_cast<int64_t>(b) * lq + row) * row_stride +
                          static_cast<int64_t>(h) * D + 2 * quad_col;
      if (a.finalize) {
        T* dst = static_cast<T*>(qc.o) + off;
#pragma unroll
        for (int dn = 0; dn < kDTiles; ++dn) {
          *reinterpret_cast<uint32_t*>(dst + dn * 8) =
              pack2<T>(o[mt][dn][2 * hf] * inv, o[mt][dn][2 * hf + 1] * inv);
        }
      } else {
        float* dst = static_cast<float*>(qc.o) + off;
#pragma unroll
        for (int dn = 0; dn < kDTiles; ++dn) {
          *reinterpret_cast<float2*>(dst + dn * 8) =
              make_float2(o[mt][dn][2 * hf] * inv, o[mt][dn][2 * hf + 1] * inv);
        }
      }
    }
  }
}

template <int D>
constexpr int smem_bytes() {
  return kBM * D * 2 + 2 * 2 * kBN * D * 2;  // Q + two stages of (K, V)
}

template <typename T, int D>
cudaError_t launch(const FlashArgs& args, int q_tiles, int batch, cudaStream_t stream) {
  auto kernel = flash_attention_kernel<T, D>;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(configure_kernel_once(reinterpret_cast<const void*>(kernel)));
  kernel<<<dim3(q_tiles, args.heads, batch), kThreads, smem_bytes<D>(), stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_flash_attention(const FlashAttentionParams& p, cudaStream_t stream) {
  if (!flash_attention_cuda_supports(p) || p.num_q < 1 || p.num_q > kFlashMaxQChunks ||
      p.num_kv < 0 || p.num_kv > kFlashMaxKVChunks) {
    return cudaErrorInvalidValue;
  }
  if (p.kernel != FlashKernel::kMma) {  // the Hopper kernel first (launch_wgmma.cu)
    const cudaError_t err = launch_flash_attention_sm90(p, stream);
    if (err != cudaErrorNotSupported || p.kernel != FlashKernel::kAuto) return err;
  }
  FlashArgs args{};
  int qt = 0;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(flash_launch_args(
      p, kBM, kBN, p.scale * kLog2e, &args, &qt,
      [&](int i, const FlashQChunk& c, int32_t first_tile) {
        args.q[i] = {{c.o_in, c.lse_in, c.o, c.lse, static_cast<int32_t>(c.len), first_tile}, c.q};
        return cudaSuccess;
      },
      [&](int j, const FlashKVChunk& c, int32_t first_tile) {
        args.kv[j] = {c.k, c.v, static_cast<int32_t>(c.len), first_tile};
        return cudaSuccess;
      }));
  if (qt == 0) return cudaSuccess;  // nothing to do
  const int bs = static_cast<int>(p.batch);
  return dispatch_half(p.dtype, [&](auto t) {
    return dispatch_int<64, 128>(p.head_dim, [&](auto d) {
      return launch<typename decltype(t)::type, decltype(d)::value>(args, qt, bs, stream);
    });
  });
}

}  // namespace jax_cluster
