// Probe: decoder_layer's one-launch kernel (cpp/ops/decoder_layer/launch.cu, compiled in)
// alone, bf16, checked against the CPU handler (cpp/ops/decoder_layer/cpu.cc) on the same
// inputs: for compute-sanitizer outside a JAX process (sanitize_attention_kernels.sh), where
// racecheck stops with an internal error at the attention code inside JAX.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo \
//     -Icpp -Icpp/include benchmarks/probes/decoder_layer_kernel.cu cpp/ops/decoder_layer/cpu.cc -o /tmp/dl
//   /tmp/dl family B D F Hq Hkv Dh S_max   (family: llama, neox (parallel residual) or
//   neox_seq; row b's length is (b * 7919) % S_max; neox: biases, rotary_dim = Dh / 4)
// Prints the relative L2 error of y and the largest cache difference; exits 1 above 1e-2 / 5e-2.
// LAYER_ROLLING=1: the caches are a rolling buffer (rolling = true) and row b's position is
// (b * 7919) % (3 S_max), so rows wrap past the buffer.
// LAYER_TIME=n: then times n launches with every row's length S_max - 1 and prints the mean
// launch, its bytes over the time, and the median block's time at each phase boundary.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cpu/numerics.h"
#include "ops/decoder_layer/cpu.h"
#include "ops/decoder_layer/launch.cu"

#include "probe_check.h"

// Times n launches at full length (S_max - 1 cached tokens per row); prints the mean and,
// from the last launch's timeline in the workspace, the median block's phase boundaries.
void time_launches(jax_cluster::DecoderLayerParams d, int n, double bytes) {
  using namespace jax_cluster;
  std::vector<int32_t> full(d.batch, static_cast<int32_t>(d.max_seq - 1));
  CHECK(cudaMemcpy(const_cast<int32_t*>(d.lengths), full.data(), full.size() * 4, cudaMemcpyHostToDevice));
  for (int i = 0; i < 3; ++i) CHECK(launch_decoder_layer(d, static_cast<float*>(d.workspace), nullptr));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  CHECK(cudaEventRecord(t0));
  for (int i = 0; i < n; ++i) CHECK(launch_decoder_layer(d, static_cast<float*>(d.workspace), nullptr));
  CHECK(cudaEventRecord(t1));
  CHECK(cudaEventSynchronize(t1));
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  const double us = 1e3 * ms / n;
  std::printf("timed: %.1f us per launch, %.1f MB, %.2f TB/s\n", us, bytes / 1e6, bytes / us / 1e6);
  const DecoderLayerPlan pl = plan_decoder_layer(d, 1);  // the timeline's offset is grid-independent
  std::vector<unsigned long long> tl(1 + kLayerTimelineMaxBlocks * kLayerTimelineMarks);
  CHECK(cudaMemcpy(tl.data(), static_cast<float*>(d.workspace) + pl.timeline, tl.size() * 8, cudaMemcpyDeviceToHost));
  const int64_t blocks = static_cast<int64_t>(tl[0]);
  unsigned long long start = ~0ull;
  for (int64_t b = 0; b < blocks; ++b) start = std::min(start, tl[1 + b * kLayerTimelineMarks]);
  std::printf("timeline (median block, us from the first start):");
  for (int m = 1; m < kLayerTimelineMarks; ++m) {
    std::vector<double> t;
    for (int64_t b = 0; b < blocks; ++b) {
      const unsigned long long v = tl[1 + b * kLayerTimelineMarks + m];
      if (v >= start) t.push_back((v - start) * 1e-3);
    }
    if (t.empty()) continue;
    std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
    std::printf(" [%d] %.1f", m, t[t.size() / 2]);
  }
  std::printf("\n");
}

int main(int argc, char** argv) {
  using namespace jax_cluster;
  if (argc < 9) {
    std::printf("usage: %s llama|neox|neox_seq B D F Hq Hkv Dh S_max\n", argv[0]);
    return 2;
  }
  const std::string family = argv[1];
  const int64_t B = std::atoll(argv[2]), D = std::atoll(argv[3]), F = std::atoll(argv[4]),
                HQ = std::atoll(argv[5]), HKV = std::atoll(argv[6]), DH = std::atoll(argv[7]),
                S = std::atoll(argv[8]);
  const bool llama = family == "llama";
  ProbeRandom rng(12345);
  const int64_t QKV = (HQ + 2 * HKV) * DH;
  const float sd = 1.7f / std::sqrt(static_cast<float>(D)), sf = 1.7f / std::sqrt(static_cast<float>(F));
  auto x = rng.bf16s(B * D, 1.f), norm_w = rng.bf16s(D, 0.2f, 1.f), post_w = rng.bf16s(D, 0.2f, 1.f);
  auto w_qkv = rng.bf16s(D * QKV, sd), w_o = rng.bf16s(HQ * DH * D, 1.7f / std::sqrt(static_cast<float>(HQ * DH)));
  auto w1 = rng.bf16s(D * F, sd), w2 = rng.bf16s(llama ? D * F : 0, sd), w3 = rng.bf16s(F * D, sf);
  auto norm_b = rng.bf16s(llama ? 0 : D, 0.1f), post_b = rng.bf16s(llama ? 0 : D, 0.1f);
  auto qkv_b = rng.bf16s(llama ? 0 : QKV, 0.1f), o_b = rng.bf16s(llama ? 0 : D, 0.1f);
  auto b1 = rng.bf16s(llama ? 0 : F, 0.1f), b3 = rng.bf16s(llama ? 0 : D, 0.1f);
  auto k_cache = rng.bf16s(B * HKV * S * DH, 1.f), v_cache = rng.bf16s(B * HKV * S * DH, 1.f);
  const int64_t rot = llama ? DH : DH / 4;
  std::vector<float> inv_freq(rot / 2);
  for (int64_t i = 0; i < rot / 2; ++i) inv_freq[i] = std::pow(10000.f, -2.f * i / rot);
  const char* rolling_env = std::getenv("LAYER_ROLLING");
  const bool rolling = rolling_env != nullptr && std::atoi(rolling_env) != 0;
  std::vector<int32_t> lengths(B);
  for (int64_t b = 0; b < B; ++b) lengths[b] = static_cast<int32_t>((b * 7919) % (rolling ? 3 * S : S));
  const char* time_env = std::getenv("LAYER_TIME");
  const int timed = time_env != nullptr ? std::atoi(time_env) : 0;

  DecoderLayerParams p{};
  p.dtype = DType::kBF16;
  p.batch = B, p.hidden = D, p.num_q_heads = HQ, p.num_kv_heads = HKV, p.head_dim = DH, p.max_seq = S;
  p.inter = F, p.rotary_dim = rot, p.rope_layout = RopeLayout::kHalf;
  p.norm = llama ? NormKind::kRms : NormKind::kLayer;
  p.mlp = llama ? MlpKind::kSwiglu : MlpKind::kGelu;
  p.parallel_residual = family == "neox";
  p.rolling = rolling;
  p.eps = 1e-5f, p.scale = 1.f / std::sqrt(static_cast<float>(DH));
  if (auto e = decoder_layer_check(p) + decoder_layer_cuda_check(p); !e.empty()) {
    std::printf("not covered: %s\n", e.c_str());
    return 2;
  }
  auto opt = [&](const std::vector<uint16_t>& h) -> const void* { return h.empty() ? nullptr : upload(h); };
  DecoderLayerParams d = p;
  d.x = upload(x), d.norm_w = upload(norm_w), d.norm_b = opt(norm_b), d.w_qkv = upload(w_qkv);
  d.qkv_bias = opt(qkv_b), d.w_o = upload(w_o), d.o_bias = opt(o_b), d.post_norm_w = upload(post_w);
  d.post_norm_b = opt(post_b), d.w1 = upload(w1), d.w2 = opt(w2), d.w3 = upload(w3), d.b1 = opt(b1);
  d.b3 = opt(b3), d.inv_freq = upload(inv_freq), d.lengths = upload(lengths);
  d.k_cache = upload(k_cache), d.v_cache = upload(v_cache);
  CHECK(cudaMalloc(&d.y, B * D * 2));
  CHECK(cudaMalloc(&d.workspace, decoder_layer_workspace_floats(p) * sizeof(float)));
  CHECK(launch_decoder_layer(d, d.workspace, nullptr));
  CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> y(B * D), kc(k_cache.size()), vc(v_cache.size());
  CHECK(cudaMemcpy(y.data(), d.y, y.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(kc.data(), d.k_cache, kc.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(vc.data(), d.v_cache, vc.size() * 2, cudaMemcpyDeviceToHost));

  std::vector<uint16_t> want(B * D);
  DecoderLayerParams h = p;
  auto host = [](const std::vector<uint16_t>& v) -> const void* { return v.empty() ? nullptr : v.data(); };
  h.x = x.data(), h.norm_w = norm_w.data(), h.norm_b = host(norm_b), h.w_qkv = w_qkv.data();
  h.qkv_bias = host(qkv_b), h.w_o = w_o.data(), h.o_bias = host(o_b), h.post_norm_w = post_w.data();
  h.post_norm_b = host(post_b), h.w1 = w1.data(), h.w2 = host(w2), h.w3 = w3.data(), h.b1 = host(b1);
  h.b3 = host(b3), h.inv_freq = inv_freq.data(), h.lengths = lengths.data();
  h.k_cache = k_cache.data(), h.v_cache = v_cache.data(), h.y = want.data();
  cpu::decoder_layer(h);  // writes the new k, v into the host caches
  double num = 0, den = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const double a = cpu::bf16_to_float(y[i]), b = cpu::bf16_to_float(want[i]);
    num += (a - b) * (a - b), den += b * b;
  }
  float cache_diff = 0.f;
  for (size_t i = 0; i < kc.size(); ++i) {
    cache_diff = std::max(cache_diff, std::fabs(cpu::bf16_to_float(kc[i]) - cpu::bf16_to_float(k_cache[i])));
    cache_diff = std::max(cache_diff, std::fabs(cpu::bf16_to_float(vc[i]) - cpu::bf16_to_float(v_cache[i])));
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  if (timed > 0) time_launches(d, timed, 2.0 * (w_qkv.size() + w_o.size() + w1.size() + w2.size() + w3.size()) +
                                              4.0 * B * HKV * (S - 1) * DH);
  std::printf("decoder_layer %s B=%lld D=%lld F=%lld Hq=%lld Hkv=%lld Dh=%lld S=%lld: rel L2 %.3g, cache max diff %.3g\n",
              family.c_str(), (long long)B, (long long)D, (long long)F, (long long)HQ, (long long)HKV,
              (long long)DH, (long long)S, rel, cache_diff);
  return rel <= 1e-2 && cache_diff <= 5e-2f ? 0 : 1;
}
