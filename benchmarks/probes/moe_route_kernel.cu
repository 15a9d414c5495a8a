// Probe: moe_decode's router kernels (cpp/ops/moe_decode/launch_route.cu, compiled in) alone,
// bf16 x, checked against the CPU handler (cpp/ops/moe_decode/cpu.cc) on the same inputs: for
// compute-sanitizer outside a JAX process (racecheck segfaults inside one on the H200) and
// for timing router changes without building the package.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo \
//     -Icpp -Icpp/include benchmarks/probes/moe_route_kernel.cu cpp/ops/moe_decode/cpu.cc -o /tmp/route
//   /tmp/route N H E k method norm router   (method: greedy, grouped (8 groups, 3 kept) or
//   noaux (8 groups, 4 kept, a random score_bias); norm 0/1: the RMSNorm in the kernels;
//   router: f32 or bf16. MOE_TIME=1: also time 50 back-to-back calls; MOE_PDL=0: plain launches)
// Prints the chunk count, whether the ids equal the CPU's, the
// largest relative weight error and h's largest error in ulps; exits 1 on different ids,
// a weight error above 1e-4 or h off by more than one ulp.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu/numerics.h"
#include "ops/moe_decode/cpu.h"
#include "ops/moe_decode/launch_route.cu"

#include "probe_check.h"

int main(int argc, char** argv) {
  using namespace jax_cluster;
  if (argc < 8) {
    std::printf("usage: %s N H E k greedy|grouped|noaux norm(0/1) f32|bf16\n", argv[0]);
    return 2;
  }
  const int64_t N = std::atoll(argv[1]), H = std::atoll(argv[2]), E = std::atoll(argv[3]), K = std::atoll(argv[4]);
  const std::string method = argv[5];
  const bool norm = std::atoi(argv[6]) != 0, f32 = std::strcmp(argv[7], "f32") == 0;
  MoeRouteParams p{};
  p.dtype = DType::kBF16;
  p.router_dtype = f32 ? DType::kF32 : DType::kBF16;
  p.n = N, p.h = H, p.e = E, p.k = K;
  p.group_limited = method != "greedy";
  p.noaux_tc = method == "noaux";
  p.n_group = p.group_limited ? 8 : 1;
  p.topk_group = method == "noaux" ? 4 : method == "grouped" ? 3 : 1;
  p.norm_topk_prob = method == "noaux";
  p.scaling = method == "noaux" ? 2.5f : 1.f;
  p.norm_eps = 1e-6f;
  if (const std::string why = moe_route_check(p) + moe_route_cuda_check(p); !why.empty()) {
    std::printf("bad call: %s\n", why.c_str());
    return 2;
  }
  setenv("JAX_CLUSTER_PDL", std::getenv("MOE_PDL") != nullptr ? std::getenv("MOE_PDL") : "1", 1);

  ProbeRandom rng(4242);
  std::vector<uint16_t> x = rng.bf16s(N * H, 3.f), gamma = rng.bf16s(H, 0.5f, 1.f);
  std::vector<float> router(H * E), bias(E);
  for (auto& v : router) v = rng.uniform() / std::sqrt(static_cast<float>(H));
  for (auto& v : bias) v = 0.5f * rng.uniform();
  std::vector<uint16_t> router16(H * E);
  for (int64_t i = 0; i < H * E; ++i) {
    router16[i] = cpu::float_to_bf16(router[i]);
    if (!f32) router[i] = cpu::bf16_to_float(router16[i]);
  }

  MoeRouteParams d = p;
  d.x = upload(x);
  d.router = f32 ? static_cast<const void*>(upload(router)) : static_cast<const void*>(upload(router16));
  d.score_bias = upload(bias);
  if (norm) {
    d.norm = upload(gamma);
    CHECK(cudaMalloc(&d.normed, N * H * 2));
  }
  CHECK(cudaMalloc(&d.weights, N * K * 4));
  CHECK(cudaMalloc(&d.ids, N * K * 4));
  CHECK(cudaMalloc(&d.workspace, std::max<int64_t>(16, moe_route_workspace_bytes(N, H, E, p.router_dtype))));
  CHECK(launch_moe_route(d, nullptr));
  CHECK(cudaDeviceSynchronize());
  std::vector<float> w(N * K);
  std::vector<int32_t> ids(N * K);
  std::vector<uint16_t> h(norm ? N * H : 0);
  CHECK(cudaMemcpy(w.data(), d.weights, w.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(ids.data(), d.ids, ids.size() * 4, cudaMemcpyDeviceToHost));
  if (norm) CHECK(cudaMemcpy(h.data(), d.normed, h.size() * 2, cudaMemcpyDeviceToHost));
  if (std::getenv("MOE_TIME") != nullptr) {
    std::printf("time: %.2f us per call\n", time_calls_us([&] { return launch_moe_route(d, nullptr); }));
  }

  MoeRouteParams hp = p;
  std::vector<float> want_w(N * K);
  std::vector<int32_t> want_ids(N * K);
  std::vector<uint16_t> want_h(norm ? N * H : 0);
  hp.x = x.data();
  hp.router = f32 ? static_cast<const void*>(router.data()) : static_cast<const void*>(router16.data());
  hp.score_bias = bias.data();
  if (norm) hp.norm = gamma.data(), hp.normed = want_h.data();
  hp.weights = want_w.data(), hp.ids = want_ids.data();
  cpu::moe_route(hp);
  float werr = 0.f;
  for (int64_t i = 0; i < N * K; ++i) werr = std::max(werr, std::fabs(w[i] - want_w[i]) / std::max(std::fabs(want_w[i]), 1e-6f));
  int64_t hulps = 0;  // bf16 bit patterns of one sign are ordered: their distance is in ulps
  for (size_t i = 0; i < h.size(); ++i) hulps = std::max<int64_t>(hulps, std::abs(static_cast<int64_t>(h[i]) - want_h[i]));
  const bool same_ids = ids == want_ids;
  std::printf("moe_route N=%lld H=%lld E=%lld k=%lld %s norm=%d router %s, %lld chunks: ids %s, weights rel err %.3g, h %lld ulp\n",
              (long long)N, (long long)H, (long long)E, (long long)K, method.c_str(), norm ? 1 : 0, argv[7],
              (long long)moe_route_chunks(N, H, E, p.router_dtype),
              same_ids ? "equal" : "DIFFER", werr, (long long)hulps);
  return same_ids && werr <= 1e-4f && hulps <= 1 ? 0 : 1;
}
