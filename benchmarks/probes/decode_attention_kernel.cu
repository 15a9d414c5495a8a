// Probe: decode_attention's split-K kernels (cpp/ops/decode_attention/launch.cu, compiled
// in) timed alone, fp16, and checked against a CPU computation of a few (row, KV head) pairs.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -Icpp -Icpp/include benchmarks/probes/decode_attention_kernel.cu -o /tmp/da
//   /tmp/da B Hkv G Dh S_max splits [length]   (length: lengths[b] of every row, default
//   S_max - 1; attention covers slots 0..length)
// DA_APPEND=1: append mode (decode_attention_append's kernels: q from an fp32 QKV row,
// RoPE, the new k, v written at slot length); timed only (the check covers the plain mode).
// DA_ROLLING=1 (with DA_APPEND): over a rolling buffer, every row at position length + 2 S_max
// (the new token at slot length, the slot after it the oldest one).
// Prints us per call (best of 5 x 20 back-to-back calls, split + merge kernel), the rate at
// which it reads the K/V bytes of length + 1 tokens, and the largest error of the checked pairs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ops/decode_attention/launch.cu"

#include "probe_check.h"

static std::vector<__half> random_half(int64_t n, float scale, uint32_t seed) {
  ProbeRandom rng(seed);
  std::vector<__half> v(n);
  for (auto& e : v) e = __float2half(scale * rng.uniform());
  return v;
}

int main(int argc, char** argv) {
  using namespace jax_cluster;
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s B Hkv G Dh S_max splits [length]\n", argv[0]);
    return 2;
  }
  DecodeAttentionParams p{};
  p.dtype = DType::kF16;
  p.batch = atoll(argv[1]);
  p.num_kv_heads = atoll(argv[2]);
  p.group = atoll(argv[3]);
  p.head_dim = atoll(argv[4]);
  p.max_seq = atoll(argv[5]);
  p.splits = atoll(argv[6]);
  const int len = argc > 7 ? atoi(argv[7]) : static_cast<int>(p.max_seq - 1);
  const int64_t dh = p.head_dim, cache = p.batch * p.num_kv_heads * p.max_seq * dh;
  const int64_t qn = p.batch * p.num_kv_heads * p.group * dh;
  auto hq = random_half(qn, 1.f / std::sqrt(static_cast<float>(dh)), 1);
  auto hk = random_half(cache, 1.f, 2), hv = random_half(cache, 1.f, 3);
  p.q = upload(hq);
  p.k_cache = upload(hk);
  p.v_cache = upload(hv);
  p.lengths = upload(std::vector<int32_t>(p.batch, len));
  CHECK(cudaMalloc(&p.out, qn * 2));
  CHECK(cudaMalloc(&p.partial, decode_attention_workspace_floats(p) * 4));

  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  CHECK(launch_decode_attention(p, stream));  // plain mode, checked below
  DecodeAttentionParams timed = p;
  if (std::getenv("DA_APPEND")) {
    const int64_t cols = (p.group + 2) * p.num_kv_heads * dh;
    std::vector<float> qkv(p.batch * cols), inv(dh / 2);
    for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = __half2float(hq[i % hq.size()]);
    for (int64_t i = 0; i < dh / 2; ++i) inv[i] = std::pow(10000.f, -2.f * i / dh);
    timed.qkv = upload(qkv);
    timed.inv_freq = upload(inv);
    timed.rotary_dim = dh;
    timed.scale = 1.f;
    if (std::getenv("DA_ROLLING")) {
      timed.rolling = true;
      timed.lengths = upload(std::vector<int32_t>(p.batch, len + 2 * static_cast<int>(p.max_seq)));
    }
  }
  CHECK(cudaStreamSynchronize(stream));
  std::vector<__half> out(qn);
  CHECK(cudaMemcpy(out.data(), p.out, qn * 2, cudaMemcpyDeviceToHost));
  // CPU check of the first and last (row, KV head).
  float err = 0.f;
  const int64_t pairs = p.batch * p.num_kv_heads;
  for (int64_t bg : {int64_t{0}, pairs - 1}) {
    for (int64_t h = 0; h < p.group; ++h) {
      const int64_t qo = (bg * p.group + h) * dh;
      std::vector<double> s(len + 1), o(dh, 0.0);
      double mx = -1e30, l = 0.0;
      for (int t = 0; t <= len; ++t) {
        double d = 0.0;
        for (int64_t i = 0; i < dh; ++i) {
          d += __half2float(hq[qo + i]) * __half2float(hk[(bg * p.max_seq + t) * dh + i]);
        }
        s[t] = d;
        mx = std::max(mx, d);
      }
      for (int t = 0; t <= len; ++t) {
        const double w = std::exp(s[t] - mx);
        l += w;
        for (int64_t i = 0; i < dh; ++i) o[i] += w * __half2float(hv[(bg * p.max_seq + t) * dh + i]);
      }
      for (int64_t i = 0; i < dh; ++i) {
        err = std::max(err, static_cast<float>(std::fabs(o[i] / l - __half2float(out[qo + i]))));
      }
    }
  }
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(a, stream));
    for (int i = 0; i < 20; ++i) CHECK(launch_decode_attention(timed, stream));
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms * 1000.f / 20.f);
  }
  const double bytes = 2.0 * p.batch * p.num_kv_heads * (len + 1) * dh * 2;
  std::printf("%s %s B%lld kv%lld G%lld dh%lld S%lld len%d splits%lld  %8.2f us  %6.0f GB/s  max_err %.2e\n",
              decode_attention_uses_tensor_cores(p) ? "tensor" : "cuda  ", timed.qkv ? "append" : "plain ", (long long)p.batch, (long long)p.num_kv_heads, (long long)p.group, (long long)dh,
              (long long)p.max_seq, len, (long long)p.splits, best, bytes / best * 1e-3, err);
  return 0;
}
