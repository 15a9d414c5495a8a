// flash_attention on Hopper (sm_90a): the FlashAttention-3 structure (warp specialisation,
// TMA, wgmma) over several query chunks x several KV chunks in one launch, folded into a
// running (o, lse) state (math and layouts: ops/flash_attention/params.h).
//
// Per block (384 threads = 3 warpgroups), one 128-row query tile of one (head, batch):
//  * warpgroup 0 is the producer: it gives registers away (setmaxnreg) and one thread
//    issues every TMA copy: the Q tile once, then K and V tiles of kBN keys into a ring of
//    kStages stages (separate full/empty mbarriers for K and V, so Q K^T starts as soon as
//    K lands). The KV chunks form ONE key sequence of tiles; a chunk's last tile reads past
//    its end, which TMA fills with zeros, and the consumers mask those keys. Order:
//    K0, K1, V0, K2, V1, ... (the order the consumers need them);
//  * warpgroups 1 and 2 are consumers, 64 query rows each: S = Q K^T on wgmma (both
//    operands from 128-byte-swizzled shared memory), online softmax on the fp32
//    accumulators in registers (exp2 domain), O += P V on wgmma with P from registers
//    (the S accumulators re-packed as A fragments) and V from shared memory (MN-major);
//  * intra-warpgroup overlap (FA3 Alg. 2): the softmax of tile t runs while the tensor
//    cores do P_{t-1} V_{t-1}; and a ping-pong between the two consumer warpgroups
//    (named barriers) lets one issue its GEMMs while the other does its softmax;
//  * the incoming state seeds the running (m, l, O) = (lse log2 e, 1, o) as in the
//    mma.sync kernel; epilogue: o = O / l (0 where l = 0), lse = (m + log2 l) ln 2.
// Tensor maps (one per Q chunk, two per KV chunk: chunks are separate arrays) are encoded
// on the host per call and passed by value in the __grid_constant__ parameter struct
// (~14 KB for 32 + 32 chunks: past the classic 4 KB, within the 32 KB that CUDA >= 12.1
// drivers take); no device memory holds them, so the launch is command-buffer safe.
// Deterministic: every output element is written once by one thread, no atomics.
// Serves Dh 64 / 128, fp16 / bf16, scale >= 0 (the softmax takes the row max of the raw
// scores); anything else, or a buffer the driver will not map, runs the mma.sync kernel.
//
// Resources (ptxas, sm_90a): 168 registers per thread at entry (384 x 168 <= 64K), then
// setmaxnreg: producer 24, consumers 240; no spills, no stack. Shared memory: Dh 128
// 161 KB (Q 32 KB + 2 stages x (K 32 KB + V 32 KB)), Dh 64 113 KB (3 stages); 1 block/SM.
// Measurements and what was tried: docs/flash_attention.md.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include "jax_cluster/dispatch.cuh"
#include "jax_cluster/mma.cuh"
#include "jax_cluster/ptx.cuh"
#include "jax_cluster/thread_group.cuh"
#include "jax_cluster/tma.cuh"
#include "jax_cluster/wgmma.cuh"
#include "ops/flash_attention/launch.h"
#include "jax_cluster/launch.cuh"
#include "jax_cluster/tma_host.h"
#include "ops/flash_attention/launch_args.h"

namespace jax_cluster {
namespace {

constexpr int kConsumerWGs = 2;
constexpr int kThreads = 128 * (1 + kConsumerWGs);
constexpr int kBM = 64 * kConsumerWGs;  // query rows per block
constexpr int kPanel = 64;              // elements in one 128-byte swizzled row
constexpr int kPanelRowBytes = 128;
constexpr uint32_t kProducerRegs = 24, kConsumerRegs = 240;  // 128 x 24 + 256 x 240 <= 64K
constexpr uint32_t kTurnBarrier = 1;  // named barriers 1, 2: consumer warpgroup 0's, 1's turn
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int D>
struct TileConfig;
template <>
struct TileConfig<64> {
  static constexpr int kBN = 128, kStages = 3;
};
template <>
struct TileConfig<128> {
  static constexpr int kBN = 128, kStages = 2;
};

// ------------------------------------------------------------------ kernel parameters
using QDesc = FlashQDesc;  // (Q itself comes through q_map)

struct KVDesc {
  int32_t len;
  int32_t tile_start;  // first KV tile of this chunk in the sequence of tiles
};

struct Sm90Args {
  CUtensorMap q_map[kFlashMaxQChunks];  // [B, len, H, Dh] as (Dh, H, len, B), box (64, 1, kBM, 1)
  CUtensorMap k_map[kFlashMaxKVChunks];  // box (64, 1, kBN, 1)
  CUtensorMap v_map[kFlashMaxKVChunks];
  QDesc q[kFlashMaxQChunks];
  KVDesc kv[kFlashMaxKVChunks];
  int32_t heads, num_q, num_kv, kv_tiles;
  float scale_log2;  // scale * log2(e), >= 0
  int32_t finalize;
};
static_assert(sizeof(Sm90Args) <= 32764, "kernel parameters past the CUDA limit");

// Shared memory: Q, K stages, V stages (each 1024-byte aligned), then the barriers.
template <int D>
struct SmemLayout {
  static constexpr int kBN = TileConfig<D>::kBN, kStages = TileConfig<D>::kStages;
  static constexpr uint32_t kQBytes = kBM * D * 2;
  static constexpr uint32_t kKVBytes = kBN * D * 2;  // one K (or V) stage
  static constexpr uint32_t kK = kQBytes;
  static constexpr uint32_t kV = kK + kStages * kKVBytes;
  static constexpr uint32_t kBarriers = kV + kStages * kKVBytes;
  static constexpr uint32_t kBytes = kBarriers + 2 * sizeof(Ring<kStages>) + 8;
  static constexpr uint32_t kAlloc = kBytes + 1024;  // slack to align the base
};

// ------------------------------------------------------------------ softmax
// Online softmax of one S tile (raw scores, this thread's two rows: s[4 j + 2 h + e] is
// row h, key 8 j + 2 quad_col + e), exp2 domain with c = scale log2 e >= 0:
//   m' = max(m, c rowmax(s)), p = 2^(c s - m'), alpha = 2^(m - m'), l' = l alpha + rowsum(p)
// (l is this thread's partial sum; the quad sums it in the epilogue). s becomes p; with
// kMask, keys >= valid are left out of the max and get p = 0.
template <int N, bool kMask>
__device__ __forceinline__ void online_softmax(float (&s)[N / 2], float (&m)[2], float (&l)[2],
                                               float (&alpha)[2], float c, int valid,
                                               int quad_col) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx0 = -INFINITY, mx1 = -INFINITY;  // two chains: half the dependent latency
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = s[4 * j + 2 * h + e];
        if (!kMask || 8 * j + 2 * quad_col + e < valid) {
          if (j & 1) {
            mx1 = fmaxf(mx1, v);
          } else {
            mx0 = fmaxf(mx0, v);
          }
        }
      }
    }
    float mx = fmaxf(mx0, mx1);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // Every tile has a valid key (key 0), so mx is finite and so is m_new.
    const float m_new = fmaxf(m[h], mx * c);
    alpha[h] = ptx::ex2(m[h] - m_new);  // 2^-inf = 0 for an empty incoming state
    m[h] = m_new;
    const float neg = -m_new;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float p = ptx::ex2(fmaf(s[4 * j + 2 * h + e], c, neg));
        if (kMask && 8 * j + 2 * quad_col + e >= valid) p = 0.f;
        s[4 * j + 2 * h + e] = p;
        if (j & 1) {
          sum1 += p;
        } else {
          sum0 += p;
        }
      }
    }
    l[h] = l[h] * alpha[h] + (sum0 + sum1);
  }
}

// ------------------------------------------------------------------ the kernel
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    flash_attention_sm90_kernel(const __grid_constant__ Sm90Args a) {
  using L = SmemLayout<D>;
  constexpr int kBN = L::kBN, kStages = L::kStages;
  constexpr int kPanels = D / kPanel;
  constexpr uint32_t kQPanelBytes = kBM * kPanelRowBytes;
  constexpr uint32_t kKVPanelBytes = kBN * kPanelRowBytes;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t s_q = ptx::smem_addr(smem);
  const uint32_t s_k = s_q + L::kK, s_v = s_q + L::kV;
  Ring<kStages>* rings = reinterpret_cast<Ring<kStages>*>(smem + L::kBarriers);
  Ring<kStages>& ring_k = rings[0];
  Ring<kStages>& ring_v = rings[1];
  uint64_t* q_full = reinterpret_cast<uint64_t*>(rings + 2);

  const int h = blockIdx.y, b = blockIdx.z;
  // Which query chunk (empty chunks own no tiles: the scan passes them).
  int qi = 0;
  while (qi + 1 < a.num_q && a.q[qi + 1].tile_start <= static_cast<int>(blockIdx.x)) ++qi;
  const int q0 = (static_cast<int>(blockIdx.x) - a.q[qi].tile_start) * kBM;
  const int kv_tiles = a.kv_tiles;

  if (threadIdx.x == 0) {
    ring_k.init(kConsumerWGs * 4);
    ring_v.init(kConsumerWGs * 4);
    ptx::mbarrier_init(q_full, 1);
    ptx::fence_mbarrier_init_cluster();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    // ---------------------------------------------------------------- producer
    wgmma::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0 && kv_tiles > 0) {
      const uint64_t pol_q = ptx::l2_evict_first(), pol_kv = ptx::l2_evict_last();
      ptx::mbarrier_arrive_expect_tx(q_full, L::kQBytes);
#pragma unroll
      for (int p = 0; p < kPanels; ++p) {
        ptx::tma_load_4d(smem + p * kQPanelBytes, &a.q_map[qi], p * kPanel, h, q0, b, q_full,
                         pol_q);
      }
      RingCursor ck, cv;
      auto load = [&](Ring<kStages>& ring, RingCursor& cur, const CUtensorMap* map,
                      uint32_t stages_offset, int row) {
        uint64_t* bar = ring_acquire(ring, cur, L::kKVBytes);
        uint8_t* dst = smem + stages_offset + cur.stage * L::kKVBytes;
#pragma unroll
        for (int p = 0; p < kPanels; ++p) {
          ptx::tma_load_4d(dst + p * kKVPanelBytes, map, p * kPanel, h, row, b, bar, pol_kv);
        }
        cur.advance<kStages>();
      };
      int lj = 0, prev_lj = 0, prev_row = 0;
      for (int t = 0; t < kv_tiles; ++t) {
        while (lj + 1 < a.num_kv && a.kv[lj + 1].tile_start <= t) ++lj;
        const int row = (t - a.kv[lj].tile_start) * kBN;
        load(ring_k, ck, &a.k_map[lj], L::kK, row);
        if (t > 0) load(ring_v, cv, &a.v_map[prev_lj], L::kV, prev_row);
        prev_lj = lj;
        prev_row = row;
      }
      load(ring_v, cv, &a.v_map[prev_lj], L::kV, prev_row);
    }
  } else {
    // ---------------------------------------------------------------- consumers
    wgmma::setmaxnreg_inc<kConsumerRegs>();
    const int wg = threadIdx.x / 128 - 1;  // consumer warpgroup 0 / 1
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int quad_row = lane >> 2, quad_col = lane & 3;
    const QDesc& qc = a.q[qi];
    const int lq = qc.len, H = a.heads;
    const int64_t row_stride = static_cast<int64_t>(H) * D;
    const int row0 = q0 + wg * 64 + warp * 16 + quad_row;  // rows row0 and row0 + 8

    // Running state, seeded from the incoming one (overlaps the first copies).
    float o[D / 2];
    float m_run[2], l_run[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = row0 + 8 * hf;
      float lse0 = -INFINITY;
      if (qc.lse_in != nullptr && row < lq) {
        lse0 = qc.lse_in[(static_cast<int64_t>(b) * H + h) * lq + row];
      }
      const bool seeded = lse0 > -INFINITY;  // NaN / -inf: empty
      m_run[hf] = seeded ? lse0 * kLog2e : -INFINITY;
      l_run[hf] = seeded && quad_col == 0 ? 1.f : 0.f;
      const float* src = qc.o_in + (static_cast<int64_t>(b) * lq + row) * row_stride +
                         static_cast<int64_t>(h) * D + 2 * quad_col;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        float2 v = make_float2(0.f, 0.f);
        if (seeded) v = *reinterpret_cast<const float2*>(src + j * 8);
        o[4 * j + 2 * hf] = v.x;
        o[4 * j + 2 * hf + 1] = v.y;
      }
    }

    if (kv_tiles > 0) {
      const float c = a.scale_log2;
      const uint32_t q_rows = s_q + wg * 64 * kPanelRowBytes;  // this warpgroup's 64 rows
      // S = Q K^T over the head dim: k16 steps of 32 bytes inside a panel, then the next.
      auto issue_qk = [&](float (&s)[kBN / 2], int stage) {
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint32_t off = (kk % 4) * 32;
          const uint64_t da = wgmma::desc_k_major(q_rows + (kk / 4) * kQPanelBytes + off);
          const uint64_t db =
              wgmma::desc_k_major(s_k + stage * L::kKVBytes + (kk / 4) * kKVPanelBytes + off);
          wgmma::mma_ss<T, kBN>(s, da, db, kk > 0);
        }
        wgmma::commit();
      };
      // O += P V: k16 steps over the keys (16 rows of V = 2048 bytes each).
      auto issue_pv = [&](const uint32_t (&pf)[kBN / 16][4], int stage) {
        wgmma::fence();
#pragma unroll
        for (int kj = 0; kj < kBN / 16; ++kj) {
          const uint64_t db = wgmma::desc_mn_major(
              s_v + stage * L::kKVBytes + kj * 16 * kPanelRowBytes, kKVPanelBytes);
          wgmma::mma_rs<T, D>(o, pf[kj], db, true);
        }
        wgmma::commit();
      };
      // Keys of tile t inside its chunk (the last tile of a chunk is partial).
      int lj = 0;
      auto valid_keys = [&](int t) {
        while (lj + 1 < a.num_kv && a.kv[lj + 1].tile_start <= t) ++lj;
        return min(kBN, a.kv[lj].len - (t - a.kv[lj].tile_start) * kBN);
      };
      auto softmax = [&](float (&s)[kBN / 2], float (&alpha)[2], int valid) {
        if (valid < kBN) {
          online_softmax<kBN, true>(s, m_run, l_run, alpha, c, valid, quad_col);
        } else {
          online_softmax<kBN, false>(s, m_run, l_run, alpha, c, valid, quad_col);
        }
      };
      auto rescale_and_pack = [&](float (&s)[kBN / 2], const float (&alpha)[2],
                                  uint32_t (&pf)[kBN / 16][4]) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[4 * j + e] *= alpha[e >> 1];
        }
#pragma unroll
        for (int kj = 0; kj < kBN / 16; ++kj) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            pf[kj][i] = pack2<T>(s[8 * kj + 2 * i], s[8 * kj + 2 * i + 1]);
          }
        }
      };

      if (wg == 0) ptx::named_barrier_arrive(kTurnBarrier, 256);  // 0 goes first
      RingCursor ck, cv;
      float s[kBN / 2];
      float alpha[2];
      uint32_t pf[kBN / 16][4];
      ptx::mbarrier_wait(q_full, 0);

      // Tile 0: S, softmax, P.
      ring_wait(ring_k, ck);
      issue_qk(s, ck.stage);
      wgmma::wait<0>();
      wgmma::fence_operand(s);
      ring_release(ring_k, ck);
      ck.advance<kStages>();
      softmax(s, alpha, valid_keys(0));
      rescale_and_pack(s, alpha, pf);

      // Tile t: S_t = Q K_t^T and O += P_{t-1} V_{t-1} in flight together; the softmax
      // of S_t runs while P V still computes.
      for (int t = 1; t < kv_tiles; ++t) {
        const int valid = valid_keys(t);
        ptx::named_barrier_sync(kTurnBarrier + wg, 256);
        ring_wait(ring_k, ck);
        issue_qk(s, ck.stage);
        ring_wait(ring_v, cv);
        issue_pv(pf, cv.stage);
        ptx::named_barrier_arrive(kTurnBarrier + 1 - wg, 256);
        wgmma::wait<1>();  // S_t done
        wgmma::fence_operand(s);
        ring_release(ring_k, ck);
        ck.advance<kStages>();
        softmax(s, alpha, valid);
        wgmma::wait<0>();  // P_{t-1} V_{t-1} done
        wgmma::fence_operand(o);
        ring_release(ring_v, cv);
        cv.advance<kStages>();
        rescale_and_pack(s, alpha, pf);
      }
      ring_wait(ring_v, cv);
      issue_pv(pf, cv.stage);
      wgmma::wait<0>();
      wgmma::fence_operand(o);
      ring_release(ring_v, cv);
      // Takes warpgroup 1's last "your turn" (or 0's own first one): the barrier ends
      // with no pending arrivals.
      if (wg == 0) ptx::named_barrier_sync(kTurnBarrier, 256);
    }

    // Epilogue: normalise, write o and lse of the rows inside the chunk.
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float l = l_run[hf];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = row0 + 8 * hf;
      if (row >= lq) continue;
      const bool any = l > 0.f;
      const float inv = any ? 1.f / l : 0.f;
      if (quad_col == 0) {
        qc.lse[(static_cast<int64_t>(b) * H + h) * lq + row] =
            any ? (m_run[hf] + __log2f(l)) * kLn2 : -INFINITY;
      }
      const int64_t off = (static_cast<int64_t>(b) * lq + row) * row_stride +
                          static_cast<int64_t>(h) * D + 2 * quad_col;
      if (a.finalize) {
        T* dst = static_cast<T*>(qc.o) + off;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          *reinterpret_cast<uint32_t*>(dst + j * 8) =
              pack2<T>(o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv);
        }
      } else {
        float* dst = static_cast<float*>(qc.o) + off;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          *reinterpret_cast<float2*>(dst + j * 8) =
              make_float2(o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv);
        }
      }
    }
  }
}

// ------------------------------------------------------------------ host
// [B, len, H, Dh] as the 4-D tensor (Dh, H, len, B), boxes of (64, 1, rows, 1), swizzled.
// cudaErrorNotSupported where the driver refuses (e.g. a misaligned buffer): the caller
// then runs the mma.sync kernel.
cudaError_t encode_rows_map(CUtensorMap* map, DType dtype, const void* base, int64_t batch,
                            int64_t len, int64_t heads, int64_t head_dim, uint32_t rows) {
  const uint64_t e = 2;
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(heads),
                            static_cast<uint64_t>(len), static_cast<uint64_t>(batch)};
  const uint64_t strides[3] = {head_dim * e, heads * head_dim * e, len * heads * head_dim * e};
  const uint32_t box[4] = {kPanel, 1, rows, 1};
  return encode_tensor_map(map, dtype, base, 4, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B) ==
                 cudaSuccess
             ? cudaSuccess
             : cudaErrorNotSupported;
}

template <typename T, int D>
cudaError_t launch(const Sm90Args& args, int q_tiles, int batch, cudaStream_t stream) {
  auto kernel = flash_attention_sm90_kernel<T, D>;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(configure_kernel_once(reinterpret_cast<const void*>(kernel)));
  kernel<<<dim3(q_tiles, args.heads, batch), kThreads, SmemLayout<D>::kAlloc, stream>>>(args);
  return cudaGetLastError();
}

template <int D>
cudaError_t launch_for_dim(const FlashAttentionParams& p, cudaStream_t stream) {
  constexpr int kBN = TileConfig<D>::kBN;
  Sm90Args args{};
  int qt = 0;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(flash_launch_args(
      p, kBM, kBN, p.scale * kLog2e, &args, &qt,
      [&](int i, const FlashQChunk& c, int32_t first_tile) {
        if (c.len > 0) {
          JAX_CLUSTER_CUDA_RETURN_IF_ERROR(encode_rows_map(&args.q_map[i], p.dtype, c.q, p.batch,
                                                           c.len, p.heads, D, kBM));
        }
        args.q[i] = {c.o_in, c.lse_in, c.o, c.lse, static_cast<int32_t>(c.len), first_tile};
        return cudaSuccess;
      },
      [&](int j, const FlashKVChunk& c, int32_t first_tile) {
        if (c.len > 0) {
          JAX_CLUSTER_CUDA_RETURN_IF_ERROR(encode_rows_map(&args.k_map[j], p.dtype, c.k, p.batch,
                                                           c.len, p.heads, D, kBN));
          JAX_CLUSTER_CUDA_RETURN_IF_ERROR(encode_rows_map(&args.v_map[j], p.dtype, c.v, p.batch,
                                                           c.len, p.heads, D, kBN));
        }
        args.kv[j] = {static_cast<int32_t>(c.len), first_tile};
        return cudaSuccess;
      }));
  if (qt == 0) return cudaSuccess;  // nothing to do
  const int bs = static_cast<int>(p.batch);
  return dispatch_half(p.dtype, [&](auto t) {
    return launch<typename decltype(t)::type, D>(args, qt, bs, stream);
  });
}

}  // namespace

bool flash_attention_sm90_serves(const FlashAttentionParams& p) {
  return flash_attention_cuda_supports(p) && p.scale >= 0.f && p.num_q >= 1 &&
         p.num_q <= kFlashMaxQChunks && p.num_kv >= 0 && p.num_kv <= kFlashMaxKVChunks;
}

cudaError_t launch_flash_attention_sm90(const FlashAttentionParams& p, cudaStream_t stream) {
  if (!flash_attention_sm90_serves(p)) return cudaErrorNotSupported;
  return dispatch_int<64, 128>(p.head_dim, [&](auto d) {
    return launch_for_dim<decltype(d)::value>(p, stream);
  });
}

}  // namespace jax_cluster
