// Probe: attention_block's kernels (cpp/ops/attention_block/launch.cu, compiled in) timed
// alone, without JAX: one decode step per launch, us per step and the rate at which it reads
// the roofline bytes. Used for kernel experiments without building the package, and to run
// the kernels under compute-sanitizer outside a JAX process
// (benchmarks/probes/sanitize_attention_kernels.sh; docs/attention_block.md says why).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -Icpp -Icpp/include benchmarks/probes/attention_kernel.cu -o /tmp/attention_kernel
//   /tmp/attention_kernel D Hq Hkv Dh ctx batch cluster heads_per_cluster [VARIANT]
// VARIANT: tma (the SplitToken kernel with the TMA pipeline) or split_head; none: the
// SplitToken kernel with the register pipeline.
// One decode step at lengths[b] = ctx - 1 (RMS norm, residual, fp16; AK_RAGGED=1: lengths
// from 0 at row 0 to ctx - 1 at the last row). Prints us per step (best of 5 x 20
// back-to-back steps, main + combine kernel; AK_STEPS=N: one rep of N steps, N=1 under
// compute-sanitizer) and the rate at which it reads the roofline bytes (weights + KV
// cache). AK_DUMP=FILE writes y of one more step (raw fp16), to compare two builds' outputs.
// An experiment swaps a kernel header: put a modified copy at
// DIR/ops/attention_block/<name>.cuh and pass -IDIR before -Icpp. A copy that records phase
// timestamps into `__device__ unsigned long long g_phase_ns[kPhaseBlocks][kPhaseMarks]`
// (entry, then up to 14 phase ends, and %smid + 1 in the last mark; define AD_PHASES) gets
// them summarised per phase (median/max over blocks) and the number of SMs the blocks ran on.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#ifdef AD_PHASES
constexpr int kPhaseBlocks = 4096;
constexpr int kPhaseMarks = 16;
__device__ unsigned long long g_phase_ns[kPhaseBlocks][kPhaseMarks];
#endif
#include "ops/attention_block/launch.cu"
#include "probe_check.h"

// Deterministic values in [-scale, scale): a hash of the index.
__global__ void fill_half(__half* p, int64_t n, float scale, uint32_t seed) {
  for (int64_t i = blockIdx.x * 256LL + threadIdx.x; i < n; i += 256LL * gridDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2half(scale * (static_cast<float>(h & 0xffffff) / 8388608.f - 1.f));
  }
}

template <typename T>
T* alloc_filled(int64_t n, float scale, uint32_t seed) {
  __half* p;
  CHECK(cudaMalloc(&p, n * 2));
  fill_half<<<1024, 256>>>(p, n, scale, seed);
  return reinterpret_cast<T*>(p);
}

int main(int argc, char** argv) {
  using namespace jax_cluster;
  if (argc < 9) {
    std::fprintf(stderr, "usage: %s D Hq Hkv Dh ctx batch cluster heads_per_cluster [tma|split_head]\n",
                 argv[0]);
    return 2;
  }
  AttentionBlockParams p{};
  p.dtype = DType::kF16;
  p.hidden = atoll(argv[1]);
  p.num_q_heads = atoll(argv[2]);
  p.num_kv_heads = atoll(argv[3]);
  p.head_dim = atoll(argv[4]);
  const int64_t ctx = atoll(argv[5]);
  p.batch = atoll(argv[6]);
  p.cluster_size = atoi(argv[7]);
  if (!is_valid_cluster_size(p.cluster_size)) {  // 9-15 are untested (14 hung on H100)
    std::fprintf(stderr, "cluster size must be 1..8 or 16\n");
    return 2;
  }
  p.max_heads_per_cluster = atoi(argv[8]);
  const std::string variant = argc > 9 ? argv[9] : "";
  if (!variant.empty() && variant != "tma" && variant != "split_head") {
    // a typo must not time the default kernel silently
    std::fprintf(stderr, "unknown variant %s (tma, split_head)\n", variant.c_str());
    return 2;
  }
  p.pipeline = variant == "tma" ? AttnPipeline::kTma : AttnPipeline::kRegisters;
  if (variant == "split_head") p.dataflow = AttnDataflow::kSplitHead;
  p.max_seq = ctx;
  p.rotary_dim = p.head_dim;
  p.rope_layout = RopeLayout::kHalf;
  p.norm = NormKind::kRms;
  p.eps = 1e-5f;
  p.scale = 1.f / std::sqrt(static_cast<float>(p.head_dim));
  p.residual = true;
  const int64_t d = p.hidden, dh = p.head_dim, qkv_cols = (p.num_q_heads + 2 * p.num_kv_heads) * dh;
  const int64_t cache = p.batch * p.num_kv_heads * ctx * dh;
  p.x = alloc_filled<__half>(p.batch * d, 1.f, 1);
  p.norm_w = alloc_filled<__half>(d, 1.f, 2);
  p.w_qkv = alloc_filled<__half>(d * qkv_cols, 1.f / std::sqrt(static_cast<float>(d)), 3);
  p.w_o = alloc_filled<__half>(p.num_q_heads * dh * d, 1.f / std::sqrt(static_cast<float>(d)), 4);
  p.k_cache = alloc_filled<__half>(cache, 1.f, 5);
  p.v_cache = alloc_filled<__half>(cache, 1.f, 6);
  CHECK(cudaMalloc(&p.y, p.batch * d * 2));
  CHECK(cudaMalloc(&p.partial, attention_block_workspace_bytes(p)));
  std::vector<float> inv(dh / 2);
  for (int64_t i = 0; i < dh / 2; ++i) inv[i] = std::pow(10000.f, -2.f * i / dh);
  float* inv_freq;
  CHECK(cudaMalloc(&inv_freq, inv.size() * 4));
  CHECK(cudaMemcpy(inv_freq, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
  p.inv_freq = inv_freq;
  std::vector<int32_t> len(p.batch, static_cast<int32_t>(ctx - 1));
  if (std::getenv("AK_RAGGED")) {  // 0 (the first token) at row 0 ... ctx - 1 at the last
    for (int64_t b = 0; b < p.batch; ++b) {
      len[b] = static_cast<int32_t>((ctx - 1) * b / std::max<int64_t>(1, p.batch - 1));
    }
  }
  int32_t* lengths;
  CHECK(cudaMalloc(&lengths, p.batch * 4));
  CHECK(cudaMemcpy(lengths, len.data(), p.batch * 4, cudaMemcpyHostToDevice));
  p.lengths = lengths;
  CHECK(cudaDeviceSynchronize());

  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  // AK_STEPS=N: N steps per timed rep and one rep (N=1 under compute-sanitizer).
  const char* steps_env = std::getenv("AK_STEPS");
  const int steps = steps_env ? std::max(1, atoi(steps_env)) : 20, reps = steps_env ? 1 : 5;
  for (int i = 0; i < (steps_env ? 1 : 3); ++i) CHECK(launch_attention_block(p, stream));
  CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int rep = 0; rep < reps; ++rep) {
    CHECK(cudaEventRecord(e0, stream));
    for (int i = 0; i < steps; ++i) CHECK(launch_attention_block(p, stream));
    CHECK(cudaEventRecord(e1, stream));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  const double us = 1000.0 * best / steps;
  const double bytes = 2.0 * (d * qkv_cols + p.num_q_heads * dh * d + 2 * cache);
  std::printf("D%lld q%lld kv%lld dh%lld ctx%lld b%lld n%d:h%lld%s  %8.1f us  %6.0f GB/s\n",
              (long long)d, (long long)p.num_q_heads, (long long)p.num_kv_heads, (long long)dh,
              (long long)ctx, (long long)p.batch, p.cluster_size,
              (long long)p.heads_per_cluster(), variant.empty() ? "" : (" " + variant).c_str(), us,
              bytes / us / 1e3);
  if (const char* path = std::getenv("AK_DUMP")) {  // y of one more step, raw fp16, to compare builds
    CHECK(launch_attention_block(p, stream));
    CHECK(cudaStreamSynchronize(stream));
    std::vector<uint16_t> y(p.batch * d);
    CHECK(cudaMemcpy(y.data(), p.y, y.size() * 2, cudaMemcpyDeviceToHost));
    FILE* f = std::fopen(path, "wb");
    std::fwrite(y.data(), 2, y.size(), f);
    std::fclose(f);
  }
#ifdef AD_PHASES
  // One more launch alone; per block: phase durations (us) from the recorded timestamps.
  std::vector<unsigned long long> ph(kPhaseBlocks * kPhaseMarks, 0);
  CHECK(cudaMemcpyToSymbol(g_phase_ns, ph.data(), ph.size() * 8));
  CHECK(launch_attention_block(p, stream));
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaMemcpyFromSymbol(ph.data(), g_phase_ns, ph.size() * 8));
  const int blocks = static_cast<int>(p.batch * p.num_kv_heads * p.head_chunks() * p.cluster_size);
  unsigned long long t0 = ~0ull, t_end = 0;
  for (int b = 0; b < blocks; ++b) t0 = std::min(t0, ph[b * kPhaseMarks]);
  std::printf("   phase:");
  for (int k = 1; k < kPhaseMarks; ++k) {
    std::vector<double> dur;
    for (int b = 0; b < blocks; ++b) {
      const unsigned long long* t = &ph[b * kPhaseMarks];
      if (t[k] == 0) continue;
      t_end = std::max(t_end, t[k]);
      dur.push_back((t[k] - t[k - 1]) / 1e3);
    }
    if (dur.empty()) break;
    std::sort(dur.begin(), dur.end());
    std::printf("  p%d %.1f/%.1f", k, dur[dur.size() / 2], dur.back());
  }
  std::printf("  (median/max us)  span %.1f us\n", (t_end - t0) / 1e3);
  // A copy that also stores %smid + 1 in the last mark: how many SMs the blocks ran on.
  std::vector<unsigned long long> sms;
  for (int b = 0; b < blocks; ++b) {
    if (ph[b * kPhaseMarks + kPhaseMarks - 1] != 0) sms.push_back(ph[b * kPhaseMarks + kPhaseMarks - 1]);
  }
  std::sort(sms.begin(), sms.end());
  if (!sms.empty()) {
    std::printf("   %zu blocks on %zu SMs\n", sms.size(),
                static_cast<size_t>(std::unique(sms.begin(), sms.end()) - sms.begin()));
  }
#endif
  return 0;
}
