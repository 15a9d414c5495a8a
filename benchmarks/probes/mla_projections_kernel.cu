// Probe: mla_decode's projection kernels (cpp/ops/mla_decode/launch_projections.cu, compiled
// in) alone, bf16, checked against the CPU handlers' computation (cpp/ops/mla_decode/cpu.cc)
// on the same inputs: for compute-sanitizer outside a JAX process (sanitize_attention_kernels.sh)
// and for timing the two kernels without XLA around them.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo \
//     -Icpp -Icpp/include benchmarks/probes/mla_projections_kernel.cu cpp/ops/mla_decode/cpu.cc -o /tmp/mlp
//   /tmp/mlp B H hidden q_lora r dn dr dv   (q_lora 0: q from RMSNorm(x); biases and a
//   residual always; MLA_TIME=1: also time 50 back-to-back calls of each kernel)
// Built with -DJAX_CLUSTER_MLA_TIMELINE=1 it also prints each kernel's per-phase timeline
// (projections.cuh's MlaMark stamps of every block) for one launch with the weights in L2
// (after a launch of the same kernel) and one with L2 flushed first.
// Prints the largest errors against the CPU computation and exits 1 above 2e-2 (relative to
// the largest value).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu/numerics.h"
#include "ops/mla_decode/cpu.h"
#include "ops/mla_decode/launch_projections.cu"

#include "probe_check.h"

namespace {

#if JAX_CLUSTER_MLA_TIMELINE
// One launch of `launch` (kernel 0: mla_project, 1: mla_output) after `before`, then when
// the blocks passed each phase boundary: first, median and last block, us from the first
// block's start.
template <typename F, typename G>
void print_timeline(int kernel, const char* name, const char* when, F&& launch, G&& before) {
  using namespace jax_cluster;
  static std::vector<unsigned long long> zeros(2 * kMlaTimelineBlocks * kMlaTimelineMarks, 0ull);
  CHECK(before());
  CHECK(cudaMemcpyToSymbol(mla_timeline, zeros.data(), zeros.size() * 8));
  CHECK(launch());
  CHECK(cudaDeviceSynchronize());
  std::vector<unsigned long long> t(zeros.size());
  CHECK(cudaMemcpyFromSymbol(t.data(), mla_timeline, t.size() * 8));
  const unsigned long long* k = t.data() + kernel * kMlaTimelineBlocks * kMlaTimelineMarks;
  unsigned long long t0 = ~0ull;
  for (int b = 0; b < kMlaTimelineBlocks; ++b) {
    if (k[b * kMlaTimelineMarks]) t0 = std::min(t0, k[b * kMlaTimelineMarks]);
  }
  static const char* marks[kMlaTimelineMarks] = {"start", "waited", "staged", "gemv", "cluster sum",
                                                 "second", "arrived", "end"};
  std::printf("timeline %s (%s): us from the first block's start\n  %-12s %6s %7s %7s %7s\n", name, when, "mark",
              "blocks", "first", "median", "last");
  for (int m = 0; m < kMlaTimelineMarks; ++m) {
    std::vector<double> v;
    for (int b = 0; b < kMlaTimelineBlocks; ++b) {
      if (k[b * kMlaTimelineMarks + m]) v.push_back((k[b * kMlaTimelineMarks + m] - t0) * 1e-3);
    }
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    std::printf("  %-12s %6zu %7.2f %7.2f %7.2f\n", marks[m], v.size(), v.front(), v[v.size() / 2], v.back());
  }
}
#endif

float rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  float worst = 0.f, big = 1e-6f;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(got[i] - want[i]));
    big = std::max(big, std::fabs(want[i]));
  }
  return worst / big;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace jax_cluster;
  if (argc < 9) {
    std::printf("usage: %s B H hidden q_lora r dn dr dv\n", argv[0]);
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), H = std::atoll(argv[2]), D = std::atoll(argv[3]),
                QL = std::atoll(argv[4]), R = std::atoll(argv[5]), DN = std::atoll(argv[6]),
                DR = std::atoll(argv[7]), DV = std::atoll(argv[8]), E = R + DR, QIN = QL > 0 ? QL : D;
  const float s = 1.f / std::sqrt(static_cast<float>(D));
  ProbeRandom rng(12345);
  auto x = rng.bf16s(B * D, 1.f), norm = rng.bf16s(D, 0.2f, 1.f), q_src = rng.bf16s(QL > 0 ? B * QL : 0, 1.f),
       w_q = rng.bf16s(QIN * H * (DN + DR), 1.f / std::sqrt(static_cast<float>(QIN))), w_kv_a = rng.bf16s(D * E, s),
       kv_a_bias = rng.bf16s(E, 0.1f), kv_a_norm = rng.bf16s(R, 0.2f, 1.f),
       w_kv_b = rng.bf16s(R * H * (DN + DV), 1.f / std::sqrt(static_cast<float>(R))),
       w_o = rng.bf16s(H * DV * D, 1.f / std::sqrt(static_cast<float>(H * DV))), o_bias = rng.bf16s(D, 0.1f),
       o_lat = rng.bf16s(B * H * R, 1.f);
  std::vector<int32_t> lengths(B);
  for (int64_t b = 0; b < B; ++b) lengths[b] = static_cast<int32_t>((b * 7919) % 4096);
  std::vector<float> inv_freq(DR / 2);
  for (int64_t i = 0; i < DR / 2; ++i) inv_freq[i] = std::pow(10000.f, -2.f * i / static_cast<float>(DR));

  MlaProjectParams p{};
  p.dtype = DType::kBF16;
  p.batch = B, p.hidden = D, p.num_heads = H, p.nope = DN, p.rope = DR, p.rank = R, p.v_dim = DV, p.q_in = QIN;
  p.capacity = 4096, p.eps = 1e-6f, p.latent_eps = 1e-6f, p.rope_factor = 1.1f;
  MlaOutputParams o{};
  o.dtype = DType::kBF16;
  o.batch = B, o.hidden = D, o.num_heads = H, o.nope = DN, o.rank = R, o.v_dim = DV;
  if (auto e = mla_projections_check(p.dtype, B, D, QIN, DN, DR, R, DV, true); !e.empty()) {
    std::printf("not a GPU shape: %s\n", e.c_str());
    return 2;
  }

  MlaProjectParams dp = p;
  dp.x = upload(x), dp.norm = upload(norm), dp.q_src = QL > 0 ? upload(q_src) : nullptr, dp.w_q = upload(w_q);
  dp.w_kv_a = upload(w_kv_a), dp.kv_a_bias = upload(kv_a_bias), dp.kv_a_norm = upload(kv_a_norm);
  dp.w_kv_b = upload(w_kv_b), dp.lengths = upload(lengths), dp.inv_freq = upload(inv_freq);
  CHECK(cudaMalloc(&dp.q_full, B * H * E * sizeof(float)));
  CHECK(cudaMalloc(&dp.new_latent, B * E * sizeof(float)));
  CHECK(cudaMalloc(&dp.kv_raw, mla_project_workspace_floats(B, E) * sizeof(float)));
  CHECK(cudaMalloc(&dp.counters, kMlaCounterWords * sizeof(unsigned int)));
  MlaOutputParams dq = o;
  dq.o_lat = upload(o_lat), dq.w_kv_b = dp.w_kv_b, dq.w_o = upload(w_o), dq.o_bias = upload(o_bias);
  dq.residual = dp.x;
  CHECK(cudaMalloc(&dq.y, B * D * 2));
  CHECK(cudaMalloc(&dq.partial, mla_output_workspace_floats(o) * sizeof(float)));
  dq.counters = dp.counters;  // zeroed by launch_mla_project, as in the op
  CHECK(launch_mla_project(dp, nullptr));
  CHECK(launch_mla_output(dq, nullptr));
  CHECK(cudaDeviceSynchronize());
  std::vector<float> q_full(B * H * E), fresh(B * E);
  std::vector<uint16_t> y(B * D);
  CHECK(cudaMemcpy(q_full.data(), dp.q_full, q_full.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(fresh.data(), dp.new_latent, fresh.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(y.data(), dq.y, y.size() * 2, cudaMemcpyDeviceToHost));
  if (std::getenv("MLA_TIME") != nullptr) {
    double wp = 2.0 * (QIN * H * (DN + DR) + D * E + R * H * DN), wo = 2.0 * (R * H * DV + H * DV * D);
    const float tp = time_calls_us([&] { return launch_mla_project(dp, nullptr); });
    // (mla_output alone: its counters zeroed before each call, which the op does not need)
    const float to = time_calls_us([&] {
      CHECK(cudaMemsetAsync(dq.counters, 0, kMlaCounterWords * sizeof(unsigned int)));
      return launch_mla_output(dq, nullptr);
    });
    std::printf("time: mla_project %.2f us (%.0f GB/s of weights), mla_output %.2f us (%.0f GB/s)\n", tp,
                wp / (tp * 1e3), to, wo / (to * 1e3));
  }

#if JAX_CLUSTER_MLA_TIMELINE
  {
    void* flush = nullptr;  // larger than L2: writing it evicts the weights
    const size_t flush_bytes = size_t{256} << 20;
    CHECK(cudaMalloc(&flush, flush_bytes));
    auto project = [&] { return launch_mla_project(dp, nullptr); };
    auto output = [&] {  // its counters zeroed first, as mla_project does in the op
      CHECK(cudaMemsetAsync(dq.counters, 0, kMlaCounterWords * sizeof(unsigned int)));
      return launch_mla_output(dq, nullptr);
    };
    auto cold = [&] { return cudaMemset(flush, 1, flush_bytes); };
    print_timeline(0, "mla_project", "weights in L2", project, project);
    print_timeline(0, "mla_project", "L2 flushed", project, cold);
    print_timeline(1, "mla_output", "weights in L2", output, output);
    print_timeline(1, "mla_output", "L2 flushed", output, cold);
    CHECK(cudaFree(flush));
  }
#endif

  MlaProjectParams hp = p;
  hp.x = x.data(), hp.norm = norm.data(), hp.q_src = QL > 0 ? q_src.data() : nullptr, hp.w_q = w_q.data();
  hp.w_kv_a = w_kv_a.data(), hp.kv_a_bias = kv_a_bias.data(), hp.kv_a_norm = kv_a_norm.data();
  hp.w_kv_b = w_kv_b.data(), hp.lengths = lengths.data(), hp.inv_freq = inv_freq.data();
  std::vector<float> want_q(B * H * E), want_fresh(B * E), want_y(B * D), got_y(B * D);
  std::vector<uint16_t> want_y16(B * D);
  hp.q_full = want_q.data(), hp.new_latent = want_fresh.data();
  cpu::mla_project(hp);
  MlaOutputParams ho = o;
  ho.o_lat = o_lat.data(), ho.w_kv_b = w_kv_b.data(), ho.w_o = w_o.data(), ho.o_bias = o_bias.data();
  ho.residual = x.data(), ho.y = want_y16.data();
  cpu::mla_output(ho);
  for (int64_t i = 0; i < B * D; ++i) {
    want_y[i] = cpu::bf16_to_float(want_y16[i]);
    got_y[i] = cpu::bf16_to_float(y[i]);
  }
  const float eq = rel_err(q_full, want_q), ef = rel_err(fresh, want_fresh), ey = rel_err(got_y, want_y);
  std::printf("mla projections B=%lld H=%lld hidden=%lld q_lora=%lld r=%lld dn=%lld dr=%lld dv=%lld: "
              "rel |err| q_full %.3g, new_latent %.3g, y %.3g\n",
              (long long)B, (long long)H, (long long)D, (long long)QL, (long long)R, (long long)DN, (long long)DR,
              (long long)DV, eq, ef, ey);
  return eq <= 2e-2f && ef <= 2e-2f && ey <= 2e-2f ? 0 : 1;
}
