// Probe: moe_decode's expert kernels (cpp/ops/moe_decode/launch.cu, compiled in) alone,
// bf16, checked against the CPU handler (cpp/ops/moe_decode/cpu.cc) on the same inputs: for
// compute-sanitizer outside a JAX process and for timing kernel changes without building
// the package.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo \
//     -Icpp -Icpp/include benchmarks/probes/moe_decode_kernel.cu cpp/ops/moe_decode/cpu.cc -o /tmp/moe
//   /tmp/moe N H I E k Is [cols_up cols_down]   (Is 0: no shared experts; cols 0 or left
//   out: the default tiles; every row picks k distinct random experts, a residual always;
//   MOE_TIME=1: also time 50 back-to-back calls; MOE_PDL=0: plain launches, for racecheck)
// Prints the largest error against the CPU computation (relative to the largest |y|) and
// exits 1 above 2e-2.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu/numerics.h"
#include "ops/moe_decode/cpu.h"
#include "ops/moe_decode/launch.cu"

#include "probe_check.h"

int main(int argc, char** argv) {
  using namespace jax_cluster;
  if (argc < 7) {
    std::printf("usage: %s N H I E k Is [cols_up cols_down]\n", argv[0]);
    return 2;
  }
  const int64_t N = std::atoll(argv[1]), H = std::atoll(argv[2]), I = std::atoll(argv[3]), E = std::atoll(argv[4]),
                K = std::atoll(argv[5]), IS = std::atoll(argv[6]);
  const int cu = argc > 7 ? std::atoi(argv[7]) : 0, cd = argc > 8 ? std::atoi(argv[8]) : 0;
  MoeDecodeParams p{};
  p.dtype = DType::kBF16;
  p.n = N, p.h = H, p.i = I, p.e = E, p.k = K, p.i_s = IS;
  p.cols_up = cu > 0 ? cu : moe_decode_default_cols(I, N, K, E, IS, I);
  p.cols_down = cd > 0 ? cd : moe_decode_default_cols(H, N, K, E, IS, I);
  p.has_residual = true;
  p.pdl = std::getenv("MOE_PDL") == nullptr || std::atoi(std::getenv("MOE_PDL")) != 0;

  ProbeRandom rng(12345);
  std::vector<uint16_t> x = rng.bf16s(N * H, 1.f), res = rng.bf16s(N * H, 1.f);
  std::vector<uint16_t> wg = rng.bf16s(E * H * I, 0.05f), wu = rng.bf16s(E * H * I, 0.05f),
                        wd = rng.bf16s(E * I * H, 0.05f);
  std::vector<uint16_t> sg = rng.bf16s(H * IS, 0.05f), su = rng.bf16s(H * IS, 0.05f), sd = rng.bf16s(IS * H, 0.05f);
  std::vector<float> weights(N * K);
  std::vector<int32_t> ids(N * K);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t s = 0; s < K; ++s) {
      int32_t e;
      do {
        e = static_cast<int32_t>(rng.next() % static_cast<uint32_t>(E));
      } while (std::find(&ids[n * K], &ids[n * K + s], e) != &ids[n * K + s]);
      ids[n * K + s] = e;
      weights[n * K + s] = 0.5f + 0.5f * rng.uniform();
    }
  }

  MoeDecodeParams d = p;
  d.x = upload(x), d.residual = upload(res), d.weights = upload(weights), d.ids = upload(ids);
  d.w_gate = upload(wg), d.w_up = upload(wu), d.w_down = upload(wd);
  if (IS > 0) d.s_gate = upload(sg), d.s_up = upload(su), d.s_down = upload(sd);
  CHECK(cudaMalloc(&d.out, N * H * 2));
  CHECK(cudaMalloc(&d.workspace, std::max<int64_t>(16, moe_decode_workspace_bytes(N, K, H, I, IS, p.dtype))));
  CHECK(launch_moe_decode(d, nullptr));
  CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> y(N * H);
  CHECK(cudaMemcpy(y.data(), d.out, y.size() * 2, cudaMemcpyDeviceToHost));

  if (std::getenv("MOE_TIME") != nullptr) {  // us per call, 50 back-to-back calls
    const float us = time_calls_us([&] { return launch_moe_decode(d, nullptr); });
    std::vector<int32_t> distinct(ids);
    std::sort(distinct.begin(), distinct.end());
    const double experts = std::unique(distinct.begin(), distinct.end()) - distinct.begin();
    const double bytes = 2.0 * 3.0 * H * (experts * I + IS);
    std::printf("time: %.2f us per call, %.0f GB/s of expert weights (%d experts)\n", us, bytes / (us * 1e3),
                static_cast<int>(experts));
  }

  MoeDecodeParams hp = p;
  hp.x = x.data(), hp.residual = res.data(), hp.weights = weights.data(), hp.ids = ids.data();
  hp.w_gate = wg.data(), hp.w_up = wu.data(), hp.w_down = wd.data();
  if (IS > 0) hp.s_gate = sg.data(), hp.s_up = su.data(), hp.s_down = sd.data();
  std::vector<uint16_t> want(N * H);
  hp.out = want.data();
  cpu::moe_decode(hp);
  float worst = 0.f, scale = 0.f;
  for (int64_t i = 0; i < N * H; ++i) {
    const float w = cpu::bf16_to_float(want[i]);
    worst = std::max(worst, std::fabs(cpu::bf16_to_float(y[i]) - w));
    scale = std::max(scale, std::fabs(w));
  }
  const float rel = worst / std::max(scale, 1e-6f);
  std::printf("moe_decode N=%lld H=%lld I=%lld E=%lld k=%lld Is=%lld cols %d/%d: rel |err| %.3g\n", (long long)N,
              (long long)H, (long long)I, (long long)E, (long long)K, (long long)IS, p.cols_up, p.cols_down, rel);
  return rel <= 2e-2f ? 0 : 1;
}
