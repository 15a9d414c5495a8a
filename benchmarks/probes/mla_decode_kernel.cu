// Probe: mla_decode's latent-attention kernels (cpp/ops/mla_decode/launch.cu, compiled in)
// alone, bf16, checked against the CPU handler's computation (cpp/ops/mla_decode/cpu.cc) on
// the same inputs: for compute-sanitizer outside a JAX process (sanitize_attention_kernels.sh).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo \
//     -Icpp -Icpp/include benchmarks/probes/mla_decode_kernel.cu cpp/ops/mla_decode/cpu.cc -o /tmp/mla
//   /tmp/mla B H r dr S_max splits page   (page 0: a contiguous cache; else a shuffled pool of
//   page-token pages; row b's length is (b * 7919) % S_max, row 0 at the first token;
//   MLA_LEN=n: every row's length n instead; MLA_TIME=1: also time 50 back-to-back calls)
// Prints the largest error against the CPU computation and exits 1 above 2e-2.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "cpu/numerics.h"
#include "ops/mla_decode/cpu.h"
#include "ops/mla_decode/launch.cu"

#include "probe_check.h"

int main(int argc, char** argv) {
  using namespace jax_cluster;
  if (argc < 8) {
    std::printf("usage: %s B H r dr S_max splits page\n", argv[0]);
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), H = std::atoll(argv[2]), R = std::atoll(argv[3]),
                DR = std::atoll(argv[4]), S = std::atoll(argv[5]), splits = std::atoll(argv[6]),
                page = std::atoll(argv[7]), E = R + DR;
  ProbeRandom rng(12345);
  MlaDecodeParams p{};
  p.dtype = DType::kBF16;
  p.batch = B, p.num_heads = H, p.rank = R, p.rope_dim = DR, p.splits = splits, p.scale = 0.3f;
  p.paged = page > 0;
  const int64_t blocks = p.paged ? (S + page - 1) / page : 0;
  p.capacity = p.paged ? blocks * page : S;
  p.page_size = page, p.max_blocks = blocks, p.num_pages = B * blocks;
  const int64_t tokens = p.paged ? p.num_pages * page : B * S;
  std::vector<float> q(B * H * E), fresh(B * E);
  std::vector<uint16_t> cache(tokens * E);
  for (auto& v : q) v = rng.uniform();
  for (auto& v : fresh) v = rng.uniform();
  for (auto& v : cache) v = cpu::float_to_bf16(rng.uniform());
  std::vector<int32_t> lengths(B), table(B * blocks);
  const char* fixed = std::getenv("MLA_LEN");
  for (int64_t b = 0; b < B; ++b) lengths[b] = static_cast<int32_t>(fixed ? std::atoll(fixed) : (b * 7919) % S);
  std::iota(table.begin(), table.end(), 0);
  std::reverse(table.begin(), table.end());  // rows' pages out of order

  MlaDecodeParams d = p;
  d.q = upload(q);
  d.new_latent = upload(fresh);
  d.cache = upload(cache);
  d.block_table = p.paged ? upload(table) : nullptr;
  d.lengths = upload(lengths);
  CHECK(cudaMalloc(&d.out, B * H * R * 2));
  CHECK(cudaMalloc(&d.partial, std::max<int64_t>(1, mla_decode_workspace_floats(p)) * sizeof(float)));
  CHECK(launch_mla_decode(d, nullptr));
  CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> out(B * H * R), out_cache(tokens * E);
  CHECK(cudaMemcpy(out.data(), d.out, out.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(out_cache.data(), d.cache, out_cache.size() * 2, cudaMemcpyDeviceToHost));

  if (std::getenv("MLA_TIME") != nullptr) {  // us per call (split + merge), 50 back-to-back calls
    const float us = time_calls_us([&] { return launch_mla_decode(d, nullptr); });
    double bytes = 0;
    for (int64_t b = 0; b < B; ++b) bytes += (lengths[b] + 1.0) * E * 2;
    int per_sm = 0;  // split-kernel blocks resident per SM (rank 512: the V2 kernel)
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, mla_decode_split_kernel<__nv_bfloat16, 512>,
                                                        MlaTile<512>::kThreads, MlaTile<512>::kSmemBytes));
    std::printf("time: %.2f us per call, %.0f GB/s of latent cache, %d split blocks per SM\n", us,
                bytes / (us * 1e3), per_sm);
  }
  std::vector<uint16_t> want(B * H * R);
  MlaDecodeParams h = p;
  h.q = q.data(), h.new_latent = fresh.data(), h.cache = cache.data(), h.lengths = lengths.data();
  h.block_table = p.paged ? table.data() : nullptr;
  h.out = want.data();
  cpu::mla_decode(h);
  float worst = 0.f;
  for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::fabs(cpu::bf16_to_float(out[i]) - cpu::bf16_to_float(want[i])));
  const bool cache_ok = out_cache == cache;  // the CPU run wrote the same slots
  std::printf("mla_decode B=%lld H=%lld r=%lld dr=%lld S=%lld splits=%lld page=%lld: max |err| %.3g, cache %s\n",
              (long long)B, (long long)H, (long long)R, (long long)DR, (long long)S, (long long)splits,
              (long long)page, worst, cache_ok ? "same" : "DIFFERS");
  return worst <= 2e-2f && cache_ok ? 0 : 1;
}
